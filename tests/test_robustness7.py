"""Robustness (session 7): edges of what landed in session 7 (compression.buckets, the Hourglass
boundary message probe, hgsgc plan's bounded fc_workers search). Exact values, no wall clock."""
import numpy as np


def _tiny_split():
    import tensorflow as tf

    from hgsgc.hourglass.split import split_model

    inp = tf.keras.Input((6, 6, 1))
    z = tf.keras.layers.Conv2D(4, 3, activation="relu")(inp)
    z = tf.keras.layers.Flatten(name="flatten")(z)
    out = tf.keras.layers.Dense(3)(tf.keras.layers.Dense(8, activation="relu")(z))
    return split_model(tf.keras.Model(inp, out), "flatten")


def test_fc_fit_of_a_huge_cluster_concatenates_at_most_64_micro_batches(monkeypatch):
    """hgsgc plan --nodes 100000 on an Hourglass model measured the FC rank on N - 1 = 99999 CONV
    ranks' micro-batches at once (a 37 GiB array for alexnet_small: MemoryError traceback). The
    linear fit fc_call_s + rows fc_row_s needs two sizes: 1 and at most FC_FIT_MAX_CONVS parts."""
    from hgsgc.hourglass import costmodel

    split = _tiny_split()
    x = np.random.default_rng(0).random((8, 6, 6, 1)).astype(np.float32)
    parts = []
    real = np.concatenate

    def counting(arrays, *a, **k):
        arrays = list(arrays)
        parts.append(len(arrays))
        return real(arrays, *a, **k)

    monkeypatch.setattr(np, "concatenate", counting)
    got = costmodel.measure_pipeline_stages(split, x, micro_batches=2, max_convs_per_fc=99999, repeats=1)
    assert costmodel.FC_FIT_MAX_CONVS == 64
    assert max(parts) == 64 and parts.count(64) == 2 * 2  # activations and labels, warm-up + 1 timed call
    assert set(got) == {"conv_fwd_mb_s", "conv_bwd_mb_s", "fc_call_s", "fc_row_s"} and min(got.values()) >= 0
    parts.clear()
    costmodel.measure_pipeline_stages(split, x, micro_batches=2, max_convs_per_fc=3, repeats=1)
    assert max(parts) == 3 and parts.count(3) == 2 * 2    # small clusters: N - 1 parts, as before
