"""hgsgc: Hourglass layout and Sparse Gradient Compression for Horovod/TensorFlow on MPI clusters.

Switching from Horovod is one argument::

    import hgsgc
    opt = hgsgc.DistributedOptimizer(opt, compression=hgsgc.Compression.sgc(density=0.005, delay=4))
"""
__version__ = "0.1.0"

from hgsgc.compression import Compression  # noqa: E402


def __getattr__(name):  # lazy: importing hgsgc does not import horovod until needed
    if name in ("DistributedOptimizer", "DistributedGradientTape", "SynchronizeCallback"):
        from hgsgc import optimizer

        return getattr(optimizer, name)
    if name == "Exchanger":
        from hgsgc.communicator import Exchanger

        return Exchanger
    raise AttributeError(f"module 'hgsgc' has no attribute {name!r}")


__all__ = ["Compression", "DistributedOptimizer", "DistributedGradientTape", "SynchronizeCallback",
           "Exchanger", "__version__"]
