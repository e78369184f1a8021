"""Compatibility shim for scripts: the code lives in :mod:`hgsgc.cluster` (import it from there).

    from hgsgc.cluster import EmulatedCluster, cluster_sh, ClusterError
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from hgsgc.cluster import (CLUSTER_SH, NETBENCH, ClusterError, EmulatedCluster,  # noqa: E402,F401
                           cluster_sh)
