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


class ResidualMemory:
    """Residuals keyed by variable name; explicit, serialisable state.

    Residual variables are created on first use (eagerly, via ``tf.init_scope``, so first use may
    happen inside a ``tf.function``) as non-trainable float32 variables of the tensor's shape.
    """

    def __init__(self):
        self._residuals: Dict[str, tf.Variable] = {}

    def residual(self, name: str, shape) -> tf.Variable:
        """The residual variable for ``name`` (zeros of ``shape`` on first use)."""
        if name not in self._residuals:
            with tf.init_scope():
                self._residuals[name] = tf.Variable(
                    tf.zeros(shape, tf.float32), trainable=False,
                    name="hgsgc_residual/" + name.replace(":", "_"))
        var = self._residuals[name]
        want = tf.TensorShape(shape)
        # callers may view the same residual flat ([numel]) or shaped: only the size must agree
        if want.is_fully_defined() and want.num_elements() != var.shape.num_elements():
            raise ValueError(f"residual {name!r} has shape {var.shape.as_list()} but a tensor of "
                             f"shape {tf.TensorShape(shape).as_list()} came with the same name: two "
                             f"models or variables share a name; give each its own optimizer")
        return var

    def compensate(self, name: str, x: tf.Tensor) -> tf.Tensor:
        """``x + residual[name]`` (float32, x's shape)."""
        return tf.cast(x, tf.float32) + self.residual(name, x.shape)

    def update(self, name: str, compensated: tf.Tensor, sent: tf.Tensor):
        """``residual[name] = compensated - sent``; returns the assign op."""
        return self.residual(name, compensated.shape).assign(compensated - sent)

    def names(self):
        return sorted(self._residuals)

    def state_dict(self) -> Dict[str, np.ndarray]:
        """Residuals as numpy arrays (for checkpoints)."""
        return {k: v.numpy() for k, v in self._residuals.items()}

    def load_state_dict(self, state: Dict[str, np.ndarray]):
        """Restore residuals saved by :meth:`state_dict`.

        Raises:
            ValueError: a saved residual's shape differs from an existing one.
        """
        for k, arr in state.items():
            if k in self._residuals and tuple(self._residuals[k].shape) != tuple(arr.shape):
                raise ValueError(f"residual {k!r}: checkpoint shape {arr.shape} != "
                                 f"{tuple(self._residuals[k].shape)}")
            self.residual(k, arr.shape).assign(arr)
