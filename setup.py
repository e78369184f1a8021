"""Build and install hgsgc.

The custom TensorFlow kernels in ``ops/*.cc`` are compiled into ``hgsgc/_ops*.so`` with the
compile and link flags of the installed TensorFlow (``tf.sysconfig``), so install TensorFlow
first and use ``pip install --no-build-isolation -e .`` (``scripts/install.sh`` does this).
"""
import glob
import os
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext


class TFBuildExt(build_ext):
    """Compile ``ops/*.cc`` against the installed TensorFlow with g++ (C++17, -O2)."""

    def build_extension(self, ext):
        try:
            import tensorflow as tf  # noqa: F401  (imported for its sysconfig flags)
        except ImportError as exc:  # pragma: no cover - install-time guard
            raise RuntimeError(
                "building hgsgc's custom ops needs TensorFlow installed first: "
                "pip install tensorflow-cpu==2.15.1, then pip install --no-build-isolation -e ."
            ) from exc
        out = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        cmd = (
            [os.environ.get("CXX", "g++"), "-std=c++17", "-shared", "-fPIC", "-O2", "-Wall", "-ffp-contract=off"]
            + ext.sources
            + ["-o", out]
            + tf.sysconfig.get_compile_flags()
            + tf.sysconfig.get_link_flags()
        )
        print(" ".join(cmd))
        subprocess.check_call(cmd)


setup(
    name="hgsgc",
    version="0.1.0",
    description="Hourglass layout and Sparse Gradient Compression for Horovod/TensorFlow training on MPI clusters",
    packages=find_packages(include=["hgsgc", "hgsgc.*"]),
    python_requires=">=3.9,<3.12",
    ext_modules=[Extension("hgsgc._ops", sources=sorted(glob.glob("ops/*.cc")),
                           depends=sorted(glob.glob("ops/*.h")))],
    cmdclass={"build_ext": TFBuildExt},
    install_requires=["numpy<2", "mpi4py", "omegaconf>=2.3", "pyyaml", "tqdm", "matplotlib"],
    entry_points={"console_scripts": ["hgsgc=hgsgc.cli:main"]},
    zip_safe=False,
)
