"""The partitioners: each turns a CostGraph and a request into a Partition; ``auto`` runs them all.
Beside them, ``plan_slicing`` cuts a causal LM's sequences into token slices (TeraPipe).

Importing the package registers every built-in partitioner under its name.
"""

from hf_ftpipe.partitioners.auto import compare_partitioners, partition_auto
from hf_ftpipe.partitioners.baselines import find_blocks, partition_params, partition_uniform
from hf_ftpipe.partitioners.contiguous import greedy_cuts
from hf_ftpipe.partitioners.mixed import partition_mixed
from hf_ftpipe.partitioners.registry import available_partitioners, get_partitioner, register_partitioner
from hf_ftpipe.partitioners.seq_dp import partition_seq_dp
from hf_ftpipe.partitioners.seq_greedy import partition_seq_greedy
from hf_ftpipe.partitioners.slicing import Slicing, plan_slicing

__all__ = [
    "Slicing",
    "available_partitioners",
    "compare_partitioners",
    "find_blocks",
    "get_partitioner",
    "greedy_cuts",
    "partition_auto",
    "partition_mixed",
    "partition_params",
    "partition_seq_dp",
    "partition_seq_greedy",
    "partition_uniform",
    "plan_slicing",
    "register_partitioner",
]
