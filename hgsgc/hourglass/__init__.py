"""The Hourglass layout: CONV ranks train the convolutional trunk, a few FC ranks the FC head.

FC parameters and their gradients travel only among FC ranks; the cluster carries boundary
activations (CONV -> FC) and their gradients (FC -> CONV) instead. See ``docs/hourglass.md``.

Public API::

    from hgsgc.hourglass import Layout, split_model, HourglassTrainer
    split = split_model(model)                           # trunk + head sharing model's layers
    layout = Layout(MPI.COMM_WORLD, fc_workers=1)        # Comm.Split + Horovod process sets
    trainer = HourglassTrainer(layout, split, batch_size=32, optimizer=SGD(0.05, momentum=0.9),
                               compression=hgsgc.Compression.sgc(0.005, delay=4))
    trainer.train_step(x, y) if layout.is_conv else trainer.train_step()
    loss, acc = trainer.evaluate(x_shard, y_shard)       # FC ranks: trainer.evaluate()

The main job is :func:`hgsgc.hourglass.train.run`. Modules import TensorFlow/Horovod lazily:
``import hgsgc.hourglass`` alone loads neither.
"""

_EXPORTS = {
    "Layout": "layout", "LayoutError": "layout", "LayoutPlan": "layout", "plan_layout": "layout",
    "check_fc_workers": "layout",
    "split_model": "split", "SplitModel": "split", "SplitError": "split", "find_boundary": "split",
    "HourglassTrainer": "step",
    "CostInputs": "costmodel", "choose_fc_workers": "costmodel", "measure_costs": "costmodel",
    "stage_times": "costmodel", "probe_link": "costmodel", "link_inputs": "costmodel",
    "BoundaryCodec": "boundary", "BoundaryCodecError": "boundary",
}


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"hgsgc.hourglass.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'hgsgc.hourglass' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
