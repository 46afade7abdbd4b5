"""hf_ftpipe: fine-tune models too large for one GPU by swapping `Trainer` for `PipeTrainer`.

Every name below is imported on first use: ``import hf_ftpipe`` loads neither torch nor
transformers, and the planning packages can be used without them.
"""

__version__ = "0.1.0"

from hf_ftpipe import _moved
from hf_ftpipe._lazy import lazy_getattr

_HOMES = {
    "PipeTrainer": "hf_ftpipe.trainer",
    "PipeTrainingArguments": "hf_ftpipe.trainer",
    "PipeSeq2SeqTrainer": "hf_ftpipe.trainer",
    "PipeSeq2SeqTrainingArguments": "hf_ftpipe.trainer",
    "CheckpointError": "hf_ftpipe.errors",
    "CostTableError": "hf_ftpipe.errors",
    "FtpipeError": "hf_ftpipe.errors",
    "HubError": "hf_ftpipe.errors",
    "PartitionError": "hf_ftpipe.errors",
    "PartitionFormatError": "hf_ftpipe.errors",
    "PipelineError": "hf_ftpipe.errors",
    "ProfileError": "hf_ftpipe.errors",
    "TraceError": "hf_ftpipe.errors",
    "CostGraph": "hf_ftpipe.graph",
    "capture_model": "hf_ftpipe.graph",
    "trace_model": "hf_ftpipe.graph",
    "Partition": "hf_ftpipe.plan",
    "PartitionKey": "hf_ftpipe.plan",
    "validate_partition": "hf_ftpipe.plan",
    "partition_seq_greedy": "hf_ftpipe.partitioners",
    "CostTable": "hf_ftpipe.costmodel",
    "GPUProfile": "hf_ftpipe.costmodel",
    "detect_profile": "hf_ftpipe.costmodel",
    "get_profile": "hf_ftpipe.costmodel",
    "list_profiles": "hf_ftpipe.costmodel",
    "PipelineEngine": "hf_ftpipe.runtime",
    "SimulationResult": "hf_ftpipe.simulator",
    "simulate": "hf_ftpipe.simulator",
    "profile_model": "hf_ftpipe.trainer.measured_costs",
}
__all__ = ["__version__", *sorted(_HOMES)]
__getattr__ = lazy_getattr(__name__, _HOMES)

_moved.install()
