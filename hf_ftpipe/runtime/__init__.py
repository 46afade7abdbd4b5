"""Pipeline runtime: stages built from the exported graph and the per-rank engine that runs a schedule."""

from hf_ftpipe.runtime.comm import Messenger
from hf_ftpipe.runtime.encoder_decoder_decoding import EncoderDecoderKV
from hf_ftpipe.runtime.engine import PipelineEngine, StagePlacement
from hf_ftpipe.runtime.kv_decoding import KVDecoder
from hf_ftpipe.runtime.peak_memory import PeakMemory
from hf_ftpipe.runtime.per_shape import PerShapeOptions
from hf_ftpipe.runtime.replicas import ReplicaGroups, ReplicaLayout
from hf_ftpipe.runtime.stage import StageSpec, build_stage_module, plan_stages
from hf_ftpipe.runtime.watchdog import Watchdog

__all__ = [
    "EncoderDecoderKV",
    "KVDecoder",
    "Messenger",
    "PeakMemory",
    "PerShapeOptions",
    "PipelineEngine",
    "ReplicaGroups",
    "ReplicaLayout",
    "StagePlacement",
    "StageSpec",
    "Watchdog",
    "build_stage_module",
    "plan_stages",
]
