"""Sequence models: the LSTM language model of Zaremba et al. (2014) and a small CTC speech model.

``lstm_small`` / ``lstm_medium`` (Zaremba et al. 2014, Sec. 4.1): embedding of ``units``, two LSTM
layers of ``units`` (200 / 650) and a softmax over the vocabulary; dropout 0 / 0.5 on the
non-recurrent connections; weights uniform in +-0.1 / +-0.05. The model maps
``(x int32 [B, T], h1, c1, h2, c2 float32 [B, units])`` to ``(logits [B, T, V], h1, c1, h2, c2)``,
so the training loop carries the state from one BPTT window to the next. Its embedding gradient is
a ``tf.IndexedSlices`` (only the rows of the words in the batch). No conv/FC boundary.

``ctc_small``: log-mel ``[B, T, n_mels]`` -> two 1-D convolutions (the second with stride 2, so
``T' = ceil(T / 2)``) -> two bidirectional GRU layers -> per-frame logits over 29 characters
(0 = CTC blank). No conv/FC boundary (the classifier is a per-frame layer after the recurrent
layers).
"""
from __future__ import annotations

import tensorflow as tf

L = tf.keras.layers
LSTM_SETTINGS = {"lstm_small": (200, 0.0, 0.1), "lstm_medium": (650, 0.5, 0.05)}


def lstm_lm(name: str, vocab_size: int, units=None, dropout=None) -> tf.keras.Model:
    """Two-layer LSTM language model with explicit state inputs/outputs (see module docstring)."""
    u, p, scale = LSTM_SETTINGS[name]
    u = units or u
    p = p if dropout is None else dropout
    init = lambda: tf.keras.initializers.RandomUniform(-scale, scale)  # noqa: E731  (one per use)
    x = L.Input((None,), dtype=tf.int32, name="tokens")
    states = [L.Input((u,), name=n) for n in ("h1", "c1", "h2", "c2")]
    e = L.Embedding(vocab_size, u, embeddings_initializer=init(), name="embedding")(x)
    e = L.Dropout(p)(e)
    y, h1, c1 = L.LSTM(u, return_sequences=True, return_state=True, kernel_initializer=init(),
                       recurrent_initializer=init(), name="lstm1")(e, initial_state=states[:2])
    y = L.Dropout(p)(y)
    y, h2, c2 = L.LSTM(u, return_sequences=True, return_state=True, kernel_initializer=init(),
                       recurrent_initializer=init(), name="lstm2")(y, initial_state=states[2:])
    y = L.Dropout(p)(y)
    logits = L.Dense(vocab_size, kernel_initializer=init(), name="softmax")(y)
    return tf.keras.Model([x] + states, [logits, h1, c1, h2, c2], name=name)


def ctc_small(n_mels: int = 40, num_classes: int = 29, units: int = 128, channels: int = 64) -> tf.keras.Model:
    """Small CTC speech model; float32 ``[B, T, n_mels]`` -> logits ``[B, ceil(T/2), num_classes]``."""
    inp = L.Input((None, n_mels), name="features")
    x = L.Conv1D(channels, 5, padding="same", activation="relu", name="conv1")(inp)
    x = L.Conv1D(channels, 5, strides=2, padding="same", activation="relu", name="conv2")(x)
    x = L.Bidirectional(L.GRU(units, return_sequences=True), name="gru1")(x)
    x = L.Bidirectional(L.GRU(units, return_sequences=True), name="gru2")(x)
    out = L.Dense(num_classes, name="chars")(x)
    return tf.keras.Model(inp, out, name="ctc_small")
