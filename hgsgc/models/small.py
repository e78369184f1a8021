"""Fashion-MNIST models of the main job (28x28x1 inputs).

``alexnet_small``: an AlexNet-shaped CNN for 28x28x1 inputs: a small convolutional trunk
(~0.06 M parameters, most of the FLOPs) feeding a fully connected head that holds ~97 % of the
parameters (~1.7 M) - the shape for which the Hourglass layout pays off (Stanza, Wu et al. 2018).
"""
from __future__ import annotations

import tensorflow as tf

SMALL = ("alexnet_small", "tiny")


def build_small(name: str = "alexnet_small", num_classes: int = 10, seed: int = 0,
                fc_units=(512, 256)) -> tf.keras.Model:
    """Build a Keras Sequential model; weights are seeded (same on every rank for one seed).

    Layers: ``conv1, pool1, conv2, pool2, flatten, fc1.., logits`` (``tiny``: 8/16 channels, one
    FC layer of 64, for fast tests).

    Raises:
        ValueError: unknown ``name``.
    """
    if name not in SMALL:
        raise ValueError(f"unknown model {name!r}: choose one of {SMALL}")
    init = lambda i: tf.keras.initializers.GlorotUniform(seed=seed * 100 + i)  # noqa: E731
    c1, c2 = (32, 64) if name == "alexnet_small" else (8, 16)
    units = tuple(fc_units) if name == "alexnet_small" else (64,)
    layers = [
        tf.keras.layers.InputLayer(input_shape=(28, 28, 1)),
        tf.keras.layers.Conv2D(c1, 3, padding="same", activation="relu", name="conv1", kernel_initializer=init(1)),
        tf.keras.layers.MaxPooling2D(2, name="pool1"),
        tf.keras.layers.Conv2D(c2, 3, padding="same", activation="relu", name="conv2", kernel_initializer=init(2)),
        tf.keras.layers.MaxPooling2D(2, name="pool2"),
        tf.keras.layers.Flatten(name="flatten"),
    ]
    for i, u in enumerate(units):
        layers.append(tf.keras.layers.Dense(u, activation="relu", name=f"fc{i + 1}",
                                            kernel_initializer=init(10 + i)))
    layers.append(tf.keras.layers.Dense(num_classes, name="logits", kernel_initializer=init(20)))
    return tf.keras.Sequential(layers, name=name)
