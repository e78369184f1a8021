"""Image classifiers: ResNet-20 and a VGG-16-style net (CIFAR-10), AlexNet and ResNet-50 (ImageNet).

- ResNet-20 (He et al. 2016, Sec. 4.2): 3x3 conv 16, three stages of 3 basic blocks (16, 32, 64
  channels; stride 2 at stages 2 and 3, projection shortcuts), batch norm, global average pool,
  ``logits``; 0.27 M parameters.
- VGG-16-style (Simonyan & Zisserman 2015, configuration D, CIFAR variant): 13 3x3 convolutions
  (64, 64, M, 128, 128, M, 256 x3, M, 512 x3, M, 512 x3, M) with batch norm, then ``fc1``, ``fc2``
  (512 each, dropout 0.5) and ``logits``; ``width`` scales every channel and FC count.
- AlexNet (Krizhevsky et al. 2012, single tower, as in torchvision): conv 64 11x11/4, 192 5x5,
  384, 256, 256 3x3, three max pools, ``fc1``/``fc2`` 4,096 (dropout 0.5), ``logits``; inputs below
  128 pixels use a 5x5 stride-2 first convolution (the offline 64x64 default).
- ResNet-50: ``tf.keras.applications.ResNet50`` (weights=None), the classifier layer named
  ``logits``.

Every model's conv/FC boundary for the Hourglass layout is the input of its first Dense layer
after the last convolution (``fc1`` for VGG and AlexNet, ``logits`` for the ResNets, whose head
is one layer).
"""
from __future__ import annotations

import tensorflow as tf

L = tf.keras.layers
# moving-average momentum of batch norm (PyTorch's 0.1 update = Keras 0.9): the evaluation
# statistics follow the weights within tens of steps, so short runs evaluate sensibly
BN_MOMENTUM = 0.9


def _conv_bn(x, ch, k=3, stride=1, wd=0.0, name=None):
    x = L.Conv2D(ch, k, strides=stride, padding="same", use_bias=False,
                 kernel_regularizer=tf.keras.regularizers.l2(wd) if wd else None,
                 kernel_initializer="he_normal", name=name)(x)
    return L.BatchNormalization(momentum=BN_MOMENTUM, name=None if name is None else name + "_bn")(x)


def resnet20(input_shape=(32, 32, 3), num_classes=10, width: float = 1.0) -> tf.keras.Model:
    """ResNet-20 for 32x32 inputs; float32 ``[B, 32, 32, 3]`` -> logits ``[B, num_classes]``."""
    inp = L.Input(input_shape)
    x = L.ReLU()(_conv_bn(inp, int(16 * width)))
    for stage, ch in enumerate((16, 32, 64)):
        ch = int(ch * width)
        for block in range(3):
            stride = 2 if stage > 0 and block == 0 else 1
            y = L.ReLU()(_conv_bn(x, ch, stride=stride))
            y = _conv_bn(y, ch)
            if stride != 1 or x.shape[-1] != ch:
                x = _conv_bn(x, ch, k=1, stride=stride)
            x = L.ReLU()(L.Add()([x, y]))
    x = L.GlobalAveragePooling2D(name="pool")(x)
    out = L.Dense(num_classes, name="logits")(x)
    return tf.keras.Model(inp, out, name="resnet20")


VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


def vgg16(input_shape=(32, 32, 3), num_classes=10, width: float = 1.0, fc_units: int = 512) -> tf.keras.Model:
    """VGG-16-style CIFAR net; float32 ``[B, H, W, 3]`` -> logits ``[B, num_classes]``."""
    layers = [L.InputLayer(input_shape=input_shape)]
    i = 0
    for v in VGG16:
        if v == "M":
            layers.append(L.MaxPooling2D(2))
        else:
            i += 1
            layers += [L.Conv2D(max(4, int(v * width)), 3, padding="same", use_bias=False,
                                kernel_initializer="he_normal", name=f"conv{i}"),
                       L.BatchNormalization(momentum=BN_MOMENTUM), L.ReLU()]
    fc = max(8, int(fc_units * width))
    layers += [L.Flatten(name="flatten"),
               L.Dense(fc, activation="relu", name="fc1"), L.Dropout(0.5),
               L.Dense(fc, activation="relu", name="fc2"), L.Dropout(0.5),
               L.Dense(num_classes, name="logits")]
    return tf.keras.Sequential(layers, name="vgg16")


def alexnet(input_shape=(224, 224, 3), num_classes=1000, width: float = 1.0, fc_units: int = 4096) -> tf.keras.Model:
    """AlexNet; float32 ``[B, S, S, 3]`` -> logits ``[B, num_classes]``."""
    small = input_shape[0] < 128
    c = lambda n: max(4, int(n * width))  # noqa: E731
    fc = max(8, int(fc_units * width))
    layers = [L.InputLayer(input_shape=input_shape),
              L.Conv2D(c(64), 11 if not small else 5, strides=4 if not small else 2, padding="same",
                       activation="relu", name="conv1"),
              L.MaxPooling2D(3, 2), L.Conv2D(c(192), 5, padding="same", activation="relu", name="conv2"),
              L.MaxPooling2D(3, 2), L.Conv2D(c(384), 3, padding="same", activation="relu", name="conv3"),
              L.Conv2D(c(256), 3, padding="same", activation="relu", name="conv4"),
              L.Conv2D(c(256), 3, padding="same", activation="relu", name="conv5"),
              L.MaxPooling2D(3, 2), L.Flatten(name="flatten"),
              L.Dropout(0.5), L.Dense(fc, activation="relu", name="fc1"),
              L.Dropout(0.5), L.Dense(fc, activation="relu", name="fc2"),
              L.Dense(num_classes, name="logits")]
    return tf.keras.Sequential(layers, name="alexnet")


def resnet50(input_shape=(224, 224, 3), num_classes=1000) -> tf.keras.Model:
    """ResNet-50 (``tf.keras.applications``, random init); the classifier is named ``logits``."""
    base = tf.keras.applications.ResNet50(weights=None, include_top=False, input_shape=input_shape,
                                          pooling="avg")
    out = L.Dense(num_classes, name="logits")(base.output)
    return tf.keras.Model(base.input, out, name="resnet50")
