"""Error-feedback memory: the residual each rank keeps of what it did not send.

For every tensor (keyed by variable name) the memory holds ``r`` with the tensor's shape
(float32). Compression sees ``a = g + r`` (compensate) and afterwards keeps
``r = a - decompress(compress(a))`` (update), so nothing selected away or lost to quantization is
dropped: it is added to a later step. This is the error feedback of 1-bit SGD (Seide et al. 2014)
and Deep Gradient Compression (Lin et al. 2018, "local gradient accumulation"), the "memory" of
the GRACE framework (Xu et al. 2021).
"""
from __future__ import annotations

from typing import Dict

import numpy as np
import tensorflow as tf


class VariableStore:
    """float32 variables keyed by tensor name: the state of one stateful piece, serialisable.

    Variables are created on first use (eagerly, via ``tf.init_scope``, so first use may happen
    inside a ``tf.function``) as non-trainable float32 variables, zeros or ``init``.
    :meth:`state_dict` is a plain ``{name: numpy float32 array}``.

    Args:
        prefix: variable-name prefix (``"hgsgc_residual"``, ``"hgsgc_velocity"``, ...).
    """

    def __init__(self, prefix: str = "hgsgc_state"):
        self.prefix = prefix
        self._residuals: Dict[str, tf.Variable] = {}

    def variable(self, name: str, shape, init=None) -> tf.Variable:
        """The variable for ``name`` (``init`` or zeros of ``shape`` on first use).

        ``init``: an array, or a zero-argument callable returning one (called eagerly).

        Raises:
            ValueError: ``name`` exists with a different number of entries (two models or
                variables share a name).
        """
        if name not in self._residuals:
            with tf.init_scope():
                if init is None:
                    value = tf.zeros(shape, tf.float32)
                else:
                    value = tf.cast(init() if callable(init) else init, tf.float32)
                self._residuals[name] = tf.Variable(
                    value, trainable=False, name=self.prefix + "/" + name.replace(":", "_"))
        var = self._residuals[name]
        want = tf.TensorShape(shape)
        # callers may view the same residual flat ([numel]) or shaped: only the size must agree
        if want.is_fully_defined() and want.num_elements() != var.shape.num_elements():
            raise ValueError(f"{self.prefix} {name!r} has shape {var.shape.as_list()} but a tensor of "
                             f"shape {tf.TensorShape(shape).as_list()} came with the same name: two "
                             f"models or variables share a name; give each its own optimizer")
        return var

    def __contains__(self, name) -> bool:
        return name in self._residuals

    def __len__(self) -> int:
        return len(self._residuals)

    def names(self):
        return sorted(self._residuals)

    def state_dict(self) -> Dict[str, np.ndarray]:
        """The variables as numpy float32 arrays (for checkpoints)."""
        return {k: v.numpy() for k, v in self._residuals.items()}

    def load_state_dict(self, state: Dict[str, np.ndarray]):
        """Restore :meth:`state_dict` output (creates variables not built yet).

        Safe to call inside a ``tf.function`` trace: the assignments run eagerly.

        Raises:
            ValueError: a saved array's shape differs from an existing variable's.
        """
        with tf.init_scope():
            for k, arr in state.items():
                arr = np.asarray(arr, np.float32)
                if k in self._residuals and tuple(self._residuals[k].shape) != tuple(arr.shape):
                    raise ValueError(f"{self.prefix} {k!r}: checkpoint shape {arr.shape} != "
                                     f"{tuple(self._residuals[k].shape)}")
                self.variable(k, arr.shape, init=arr).assign(arr)


class ResidualMemory(VariableStore):
    """Error-feedback residuals keyed by variable name (float32, the reducer's view shape)."""

    def __init__(self):
        super().__init__("hgsgc_residual")

    def residual(self, name: str, shape) -> tf.Variable:
        """The residual variable for ``name`` (zeros of ``shape`` on first use)."""
        return self.variable(name, shape)

    def compensate(self, name: str, x: tf.Tensor) -> tf.Tensor:
        """``x + residual[name]`` (float32, x's shape)."""
        return tf.cast(x, tf.float32) + self.residual(name, x.shape)

    def update(self, name: str, compensated: tf.Tensor, sent: tf.Tensor):
        """``residual[name] = compensated - sent``; returns the assign op."""
        return self.residual(name, compensated.shape).assign(compensated - sent)
