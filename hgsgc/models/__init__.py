"""Model zoo: every model with the task it serves and its conv/FC boundary (or none).

========== ========= ============================= ================================
name       task      input                          Hourglass boundary (head starts)
========== ========= ============================= ================================
alexnet_small image  28x28x1 (Fashion-MNIST)        ``fc1``
tiny       image     28x28x1                        ``fc1``
resnet20   image     32x32x3 (CIFAR-10)             ``logits``
vgg16      image     32x32x3 (CIFAR-10)             ``fc1``
alexnet    image     SxSx3 (ImageNet)               ``fc1``
resnet50   image     SxSx3 (ImageNet)               ``logits``
lstm_small lm        int32 tokens [B, T]            none
lstm_medium lm       int32 tokens [B, T]            none
ctc_small  speech    log-mel [B, T, n_mels]         none
========== ========= ============================= ================================

``build_model(name, ...)`` keeps its old signature for the Fashion-MNIST models.
"""
from __future__ import annotations

from typing import Optional

MODELS = ("alexnet_small", "tiny", "resnet20", "vgg16", "alexnet", "resnet50",
          "lstm_small", "lstm_medium", "ctc_small")
TASK_OF = {"alexnet_small": "image", "tiny": "image", "resnet20": "image", "vgg16": "image",
           "alexnet": "image", "resnet50": "image", "lstm_small": "lm", "lstm_medium": "lm",
           "ctc_small": "speech"}
BOUNDARY = {"alexnet_small": "fc1", "tiny": "fc1", "resnet20": "logits", "vgg16": "fc1",
            "alexnet": "fc1", "resnet50": "logits", "lstm_small": None, "lstm_medium": None,
            "ctc_small": None}
WHY_NO_BOUNDARY = {"lstm_small": "a recurrent language model: embedding, LSTMs, softmax",
                   "lstm_medium": "a recurrent language model: embedding, LSTMs, softmax",
                   "ctc_small": "a speech model: per-frame classifier after recurrent layers"}


def has_boundary(name: str) -> bool:
    """Whether model ``name`` has a conv/FC boundary for the Hourglass layout."""
    return BOUNDARY.get(name) is not None


def why_no_boundary(name: str, split_layer: Optional[str] = None) -> Optional[str]:
    """What model ``name`` is, when it is a built-in model without a conv/FC boundary and no
    ``split_layer`` names one (e.g. ``"a recurrent language model: embedding, LSTMs, softmax"``);
    else None (the split is tried, and :class:`hgsgc.hourglass.split.SplitError` says why it fails).
    The config check, ``hgsgc plan`` and ``layout: auto`` word their refusals with it."""
    if split_layer is None and not has_boundary(name):
        return WHY_NO_BOUNDARY.get(name)
    return None


def build_model(name: str = "alexnet_small", num_classes: int = 10, seed: int = 0, fc_units=(512, 256),
                input_shape=None, width: float = 1.0, units: Optional[int] = None,
                dropout: Optional[float] = None):
    """Build model ``name`` (a Keras model, float32 weights).

    ``alexnet_small`` / ``tiny`` use seeded initialisers; the others draw from the global seed
    (``tf.keras.utils.set_random_seed``), which the runners set from ``run.seed`` on every rank.
    ``input_shape`` (image models: ``(S, S, 3)``; ``ctc_small``: ``(None, n_mels)``), ``width``
    (channel / FC multiplier: vgg16, alexnet, resnet20), ``units`` / ``dropout`` (LSTM; default
    the Zaremba setting); ``num_classes`` is the vocabulary size for the language models.

    Raises:
        ValueError: unknown ``name``.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: choose one of {MODELS}")
    if name in ("alexnet_small", "tiny"):
        from hgsgc.models.small import build_small

        return build_small(name, num_classes=num_classes, seed=seed, fc_units=fc_units)
    from hgsgc.models import sequence, vision

    if name == "resnet20":
        return vision.resnet20(input_shape or (32, 32, 3), num_classes, width)
    if name == "vgg16":
        return vision.vgg16(input_shape or (32, 32, 3), num_classes, width)
    if name == "alexnet":
        return vision.alexnet(input_shape or (224, 224, 3), num_classes, width)
    if name == "resnet50":
        return vision.resnet50(input_shape or (224, 224, 3), num_classes)
    if name in ("lstm_small", "lstm_medium"):
        return sequence.lstm_lm(name, num_classes, units, dropout)
    return sequence.ctc_small(n_mels=(input_shape or (None, 40))[-1], num_classes=num_classes)
