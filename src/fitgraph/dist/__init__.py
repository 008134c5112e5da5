"""Many devices: the cluster, what its collectives cost, and (coming) the parallel planner.

Torch-free, like the single-device planner it builds on (``tests/test_boundary.py``).
"""

from .cluster import LINKS, Cluster, Link, dgx_a100
from .collectives import all_gather_s, all_reduce_s, p2p_s, reduce_scatter_s
from .megatron_table import TABLE1, GptShape, MegatronRow

__all__ = ["LINKS", "TABLE1", "Cluster", "GptShape", "Link", "MegatronRow", "all_gather_s",
           "all_reduce_s", "dgx_a100", "p2p_s", "reduce_scatter_s"]
