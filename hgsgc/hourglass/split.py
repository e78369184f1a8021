"""Split a Keras model into a CONV trunk and an FC head at one boundary tensor.

The boundary is the input of the *first fully connected layer after the last convolution*
(``alexnet_small``: the output of ``flatten``, the input of ``fc1``), or the input of the layer
named by ``split_layer``. The trunk maps the model input to the boundary tensor ``A``; the head
maps ``A`` to the model output. Both share the original model's layer objects (and so its
variables): ``head(trunk(x))`` runs exactly the whole model's operations, and the original model,
with trunk weights and head weights filled in, is the ordinary Keras model to save.

Supported: Sequential models with a known input shape and functional models with one input and
one output, where the boundary tensor is the only tensor the head needs (no skip connection
across the boundary).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import tensorflow as tf


class SplitError(ValueError):
    """The model has no usable conv/FC boundary (or ``split_layer`` is unusable)."""


_CONV_TYPES = tuple(t for t in (
    getattr(tf.keras.layers, n, None) for n in (
        "Conv1D", "Conv2D", "Conv3D", "Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose",
        "SeparableConv1D", "SeparableConv2D", "DepthwiseConv1D", "DepthwiseConv2D")) if t is not None)


def is_conv(layer) -> bool:
    """True for Keras convolution layers (any dimension, transposed, separable, depthwise)."""
    return isinstance(layer, _CONV_TYPES)


def is_dense(layer) -> bool:
    """True for fully connected layers (``Dense``)."""
    return isinstance(layer, tf.keras.layers.Dense)


@dataclass
class SplitModel:
    """A model split at one boundary.

    Attributes:
        model: the original model (shares layers and variables with trunk and head).
        trunk: Keras model, model input -> boundary activations ``A``.
        head: Keras model, ``A`` -> model output.
        boundary_layer: name of the first head layer.
        boundary_shape: shape of ``A`` without the batch dimension.
        boundary_dtype: dtype of ``A`` (numpy name, e.g. ``"float32"``).
    """

    model: tf.keras.Model
    trunk: tf.keras.Model
    head: tf.keras.Model
    boundary_layer: str
    boundary_shape: tuple
    boundary_dtype: str

    @property
    def features(self) -> int:
        """Entries of ``A`` per example."""
        n = 1
        for s in self.boundary_shape:
            n *= int(s)
        return n

    @property
    def trunk_variables(self) -> List[tf.Variable]:
        return list(self.trunk.trainable_variables)

    @property
    def head_variables(self) -> List[tf.Variable]:
        return list(self.head.trainable_variables)


def _layers(model) -> list:
    return [l for l in model.layers if not isinstance(l, tf.keras.layers.InputLayer)]


def find_boundary(model: tf.keras.Model, split_layer: Optional[str] = None) -> str:
    """Name of the first head layer: ``split_layer``, or the first Dense after the last conv.

    Raises:
        SplitError: no convolution, no Dense after the last convolution, unknown or first
            ``split_layer``.
    """
    layers = _layers(model)
    names = [l.name for l in layers]
    if split_layer is not None:
        if split_layer not in names:
            raise SplitError(f"hourglass.split_layer={split_layer!r} is not a layer of model "
                             f"{model.name!r}: choose one of {names}")
        if names.index(split_layer) == 0:
            raise SplitError(f"hourglass.split_layer={split_layer!r} is the model's first layer: "
                             f"the CONV trunk would be empty; choose a later layer of {names}")
        return split_layer
    conv_idx = [i for i, l in enumerate(layers) if is_conv(l)]
    if not conv_idx:
        raise SplitError(f"model {model.name!r} has no convolution layer, so no conv/FC boundary "
                         f"for the Hourglass layout: use layout=data_parallel or set "
                         f"hourglass.split_layer to one of {names}")
    dense_after = [i for i in range(conv_idx[-1] + 1, len(layers)) if is_dense(layers[i])]
    if not dense_after:
        raise SplitError(f"model {model.name!r} has no Dense layer after its last convolution "
                         f"{layers[conv_idx[-1]].name!r}, so no conv/FC boundary: use "
                         f"layout=data_parallel or set hourglass.split_layer")
    return layers[dense_after[0]].name


def split_model(model: tf.keras.Model, split_layer: Optional[str] = None) -> SplitModel:
    """Split ``model`` into trunk and head at :func:`find_boundary`'s layer.

    Returns:
        :class:`SplitModel`; ``head(trunk(x))`` equals ``model(x)``.

    Raises:
        SplitError: no boundary, a model without known input shape, several inputs/outputs, or
            a head that needs more than the boundary tensor (skip connection across it).
    """
    try:
        inputs, outputs = model.inputs, model.outputs
    except AttributeError:
        inputs = outputs = None
    if not inputs or not outputs:
        raise SplitError(f"model {model.name!r} has no known input shape: build it with an Input "
                         f"layer (tf.keras.Input / InputLayer) before splitting")
    if len(inputs) != 1 or len(outputs) != 1:
        raise SplitError(f"model {model.name!r} has {len(inputs)} inputs and {len(outputs)} "
                         f"outputs: the Hourglass split supports one of each")
    name = find_boundary(model, split_layer)
    layer = model.get_layer(name)
    try:
        boundary = layer.get_input_at(0)  # the model's own node (splitting adds more nodes)
    except (AttributeError, ValueError, RuntimeError) as exc:
        raise SplitError(f"layer {name!r} has no single input tensor: {exc}") from None
    if isinstance(boundary, (list, tuple)):
        raise SplitError(f"layer {name!r} takes {len(boundary)} tensors: the boundary must be one "
                         f"tensor; choose another hourglass.split_layer")
    try:
        trunk = tf.keras.Model(inputs[0], boundary, name=f"{model.name}_trunk")
        head = tf.keras.Model(boundary, outputs[0], name=f"{model.name}_head")
    except ValueError as exc:
        raise SplitError(f"cannot split model {model.name!r} at {name!r}: the head needs tensors "
                         f"other than {name!r}'s input (a connection across the boundary): "
                         f"{str(exc).splitlines()[0]}") from None
    if any(s is None for s in boundary.shape[1:]):
        raise SplitError(f"boundary tensor at {name!r} has a variable (unknown) shape {tuple(boundary.shape)}: "
                         f"the Hourglass layout needs a fixed shape per example: use layout=data_parallel")
    shape = tuple(int(s) for s in boundary.shape[1:])
    n_model = len(model.trainable_variables)
    if len(trunk.trainable_variables) + len(head.trainable_variables) != n_model:
        raise SplitError(f"split at {name!r} does not partition the model's variables")
    if not trunk.trainable_variables or not head.trainable_variables:
        raise SplitError(f"split at {name!r} leaves the "
                         f"{'trunk' if not trunk.trainable_variables else 'head'} without trainable "
                         f"variables: choose another hourglass.split_layer")
    return SplitModel(model, trunk, head, name, shape, tf.as_dtype(boundary.dtype).name)
