"""``layout: auto``: measure at start-up, predict data parallelism and the Hourglass, run the fastest.

Every rank measures (:func:`measure`), the per-field medians are the model's inputs:

* ``t_conv``, ``t_fc``: seconds per example of the trunk's and the head's forward + backward pass
  (the configured per-rank batch ``b``; median of 3 timed calls after a tracing call);
* ``act_bytes``, ``grad_bytes``: bytes per example of the boundary with the CONFIGURED codecs
  (:func:`hgsgc.hourglass.costmodel.configured_codecs`), by the codecs' payload formulas
  (:func:`hgsgc.hourglass.costmodel.boundary_bytes`, the function ``fc_workers: auto`` and
  ``hgsgc plan`` use too) over the non-zeros of the trunk's real activations of one training
  batch (initial weights: the density of non-zeros is higher at initialisation than after
  training, so this overestimates sparse codecs' bytes), in ``hourglass.micro_batches`` messages;
  ``codec_s``: encode + decode seconds per example for both directions together (one warm-up
  round, then the median of 3);
* ``alpha`` (seconds per message) and ``beta`` (bytes per second) of the link:
  :func:`hgsgc.hourglass.costmodel.link_inputs`, the same probe as ``fc_workers: auto``: a
  short point-to-point ping-pong between rank 0 and every other rank
  (:func:`~hgsgc.hourglass.costmodel.probe_link`: 8 B x 20 for ``alpha``, 1 MiB x 3 for
  ``beta``; medians; the slowest pair counts, as the slowest link bounds a step), unless
  ``hourglass.link_bandwidth_mbps`` overrides it (no probe, ``alpha = 0``);
* the gradient payloads of one exchange (data parallel: the whole model with the configured
  compression; Hourglass: the trunk with it, the head with ``hourglass.fc_method``) from
  :func:`hgsgc.compression.codec.exchange_payload_bytes`.

* Horovod's cycle time (``HOROVOD_CYCLE_TIME``, :func:`hgsgc.perfmodel.horovod_cycle_s`) for the
  coordination of each gradient exchange. Not measured here (0 in the model): the compression
  cost of the exchanges and the optimizer updates (``hgsgc plan`` measures both).

The predictions are :func:`hgsgc.perfmodel.predict_data_parallel` and
:func:`hgsgc.perfmodel.predict_hourglass` (the one performance model of the project, also used
by ``hgsgc plan``); the
choice is the highest predicted throughput (examples per second; the Hourglass trains
``C b`` examples per step, data parallelism ``n b``). Rank 0 decides and broadcasts, logs the
inputs, every prediction and the choice, and they are written to ``summary.json`` under
``layout_choice``.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from hgsgc.hourglass.costmodel import link_inputs, probe_link  # noqa: F401 (the one link probe)


def measure(split, x: np.ndarray, act_codec, grad_codec, repeats: int = 3, micro_batches: int = 1) -> dict:
    """This rank's compute and codec figures (see the module docstring).

    Args:
        split: :class:`~hgsgc.hourglass.split.SplitModel`; x: one real training batch ``[b, ...]``.
        act_codec, grad_codec: :class:`~hgsgc.hourglass.boundary.BoundaryCodec` (or specs).
        micro_batches: boundary messages per batch (``hourglass.micro_batches``).

    Returns:
        ``{"t_conv", "t_fc", "codec_s"}`` (seconds per example), ``{"act_bytes", "grad_bytes"}``
        (bytes per example, :func:`~hgsgc.hourglass.costmodel.boundary_bytes`) and ``"density"``
        (fraction of non-zero activations).
    """
    import tensorflow as tf

    from hgsgc.hourglass.boundary import BoundaryCodec
    from hgsgc.hourglass.costmodel import boundary_bytes, codec_seconds, median_seconds, stage_passes

    ac, gc = BoundaryCodec.parse(act_codec), BoundaryCodec.parse(grad_codec)
    trunk, head = split.trunk, split.head
    b = len(x)
    xt = tf.constant(x)
    a = trunk(xt, training=False).numpy().reshape(b, -1)
    n_out = int(head.outputs[0].shape[-1])
    y = tf.constant(np.random.default_rng(0).integers(0, n_out, b).astype(np.int32))

    conv_pass, fc_pass = stage_passes(split)
    t_conv = median_seconds(conv_pass, (xt,), repeats) / b
    a_t = tf.constant(a.reshape((b,) + tuple(split.boundary_shape)))
    t_fc = median_seconds(fc_pass, (a_t, y), repeats) / b
    g = fc_pass(a_t, y)[-1].numpy().reshape(b, -1)
    codec_s = codec_seconds(ac, gc, a, g, repeats)
    act_bytes, grad_bytes = boundary_bytes(ac, gc, a != 0, micro_batches)
    return {"t_conv": t_conv, "t_fc": t_fc, "act_bytes": act_bytes,
            "grad_bytes": grad_bytes, "codec_s": codec_s,
            "density": float(np.count_nonzero(a)) / a.size}


def choose(comm, split, x, cfg, log: Optional[Callable] = None) -> dict:
    """Measure on every rank, predict, decide on rank 0, broadcast; collective over ``comm``.

    Returns (every rank): ``{"layout": "data_parallel" | "hourglass", "fc_workers": F or None,
    "inputs": {...}, "predictions": [...], "choice": {...}}``.
    """
    from hgsgc import perfmodel
    from hgsgc.compression import as_compression
    from hgsgc.compression.codec import exchange_payload_bytes
    from hgsgc.config import compression_from_config
    from hgsgc.hourglass.train import fc_compression_from_config

    from hgsgc.hourglass.costmodel import configured_codecs

    h = cfg.hourglass
    try:
        act_codec, grad_codec = configured_codecs(h)
        mine, err = measure(split, x, act_codec, grad_codec, micro_batches=int(h.micro_batches)), None
    except Exception as exc:  # report on every rank instead of hanging the others
        mine, err = None, f"rank {comm.Get_rank()}: {type(exc).__name__}: {exc}"
    gathered = comm.allgather((mine, err))
    errors = [e for _, e in gathered if e]
    if errors:
        raise RuntimeError("layout=auto: measurement failed on " + "; ".join(errors))
    link = link_inputs(comm, getattr(h, "link_bandwidth_mbps", None))  # collective (probe) unless overridden
    report = None
    if comm.Get_rank() == 0:
        meas = {k: float(np.median([m[k] for m, _ in gathered])) for k in gathered[0][0]}
        cc = as_compression(compression_from_config(cfg.compression))
        fcc = as_compression(fc_compression_from_config(cfg))
        conv_shapes = [tuple(v.shape) for v in split.trunk_variables]
        fc_shapes = [tuple(v.shape) for v in split.head_variables]
        inputs = perfmodel.LayoutInputs(
            world_size=comm.Get_size(), batch_size=len(x), t_conv=meas["t_conv"], t_fc=meas["t_fc"],
            act_bytes=meas["act_bytes"], grad_bytes=meas["grad_bytes"], codec_s=meas["codec_s"],
            alpha=link["alpha_s"], beta=link["beta_Bps"],
            dp_payload=float(exchange_payload_bytes(cc, conv_shapes + fc_shapes)),
            conv_payload=float(exchange_payload_bytes(cc, conv_shapes)),
            fc_payload=float(exchange_payload_bytes(fcc, fc_shapes)),
            dp_algorithm=perfmodel.algorithm_of(cc), conv_algorithm=perfmodel.algorithm_of(cc),
            fc_algorithm=perfmodel.algorithm_of(fcc), delay=int(cc.delay), fc_delay=int(fcc.delay),
            micro_batches=int(h.micro_batches), cycle_s=perfmodel.horovod_cycle_s())
        report = perfmodel.choose_layout(inputs)
        report["measured"] = {"density_of_nonzero_activations": meas["density"], "link_pairs": link["pairs"]}
        report["link"] = link
    report = comm.bcast(report, root=0)
    if log is not None and comm.Get_rank() == 0:
        log(perfmodel.format_layout_report(report))
    return report


def run(cfg, run_layout, log=print) -> dict:
    """``layout: auto``: :func:`choose`, then run the chosen layout with ``run_layout(cfg, log=)``
    (``hgsgc.train.run``, passed in so this module does not import the runner); the summary
    (and rank 0's ``summary.json``) gets ``layout_setting: "auto"`` and ``layout_choice`` (the
    inputs, every prediction, the choice). A model without a conv/FC boundary runs data-parallel
    without measuring (the reason is logged and recorded).
    """
    import dataclasses
    import json
    import os

    from mpi4py import MPI

    from hgsgc.hourglass.split import SplitError, split_model
    from hgsgc.loop import setup_threads
    from hgsgc.tasks import make_task

    world = MPI.COMM_WORLD
    setup_threads(cfg.train.threads)
    import tensorflow as tf

    tf.keras.utils.set_random_seed(cfg.run.seed)
    # the configured task's data and model (format, width, input shape, classes), as the runners
    # build them; a DataError here is raised on every rank, before any collective
    task = make_task(cfg)
    try:
        split = split_model(task.build_model(), cfg.hourglass.split_layer)
    except SplitError as exc:
        split, reason = None, str(exc)
    if split is None or world.Get_size() < 2:
        report = {"layout": "data_parallel", "fc_workers": None,
                  "reason": reason if split is None else "one rank: no Hourglass layout possible"}
        if world.Get_rank() == 0:
            log(f"layout auto -> data_parallel ({report['reason']})")
    else:
        batches, _ = task.train_data(0, 1, 0)  # the first training batch of epoch 0 (every rank the same)
        x = np.asarray(next(iter(batches))[0], dtype=np.float32)
        report = choose(world, split, x, cfg, log=log)
    h = cfg.hourglass
    if report["layout"] == "hourglass":
        chosen = dataclasses.replace(cfg, layout="hourglass",
                                     hourglass=dataclasses.replace(h, fc_workers=int(report["fc_workers"])))
    else:
        chosen = dataclasses.replace(cfg, layout="data_parallel")
    summary = run_layout(chosen, log=log)
    summary["layout_setting"] = "auto"
    summary["layout_choice"] = report
    if world.Get_rank() == 0:
        path = os.path.join(cfg.run.out_dir, summary["run_id"], "summary.json")
        with open(path, "w") as f:
            json.dump(summary, f, indent=2)
    world.Barrier()
    return summary
