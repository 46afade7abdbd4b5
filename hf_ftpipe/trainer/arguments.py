"""PipeTrainingArguments: `TrainingArguments` plus the pipeline's settings."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from transformers import TrainingArguments

from hf_ftpipe.schedules.registry import SCHEDULES, ScheduleTraits
from hf_ftpipe.trainer.launch import use_cpu_for_launch
from hf_ftpipe.trainer.replicas import (
    check_auto_replicas,
    check_data_parallel_size,
    launched_world_size,
    parse_data_parallel_size,
)
from hf_ftpipe.trainer.schedule_choice import SCHEDULE_HELP, check_schedule_argument

__all__ = ["PipeTrainingArguments"]

SLICING_SCHEDULES = [name for name, traits in SCHEDULES.items() if traits.token_slices]
"""The schedules that can pipeline token slices (``token_slices``)."""


@dataclass
class PipeTrainingArguments(TrainingArguments):
    """`TrainingArguments` for `PipeTrainer`.

    Batch sizes: ``per_device_train_batch_size`` is the mini-batch of one pipeline step; it is split
    into ``num_microbatches`` equal micro-batches that flow through the stages. Every rank reads the
    same mini-batch from its own data loader, so the effective batch size is
    ``per_device_train_batch_size * gradient_accumulation_steps`` whatever the number of stages:
    with ``gpipe`` and ``1f1b`` the G mini-batches of one optimizer update run as one flush of
    G x ``num_microbatches`` micro-batches (`microbatches_per_step`). With ``data_parallel_size=D``
    replicas of the pipeline, ``per_device_train_batch_size`` is one replica's mini-batch, as under
    DDP, and the global batch D times that (`hf_ftpipe.trainer.replicas`); with ``"auto"`` the planner
    picks D and ``per_device_train_batch_size`` is the global batch, which the replicas share.

    Several processes launched on a machine without a GPU (``torchrun``, ``accelerate launch
    --multi_gpu``) run on CPU as with ``use_cpu=True``, which these arguments then set: otherwise
    transformers would make every rank process 0 and each would write the outputs.
    """

    pipeline_schedule: str = field(default="gpipe", metadata={"help": SCHEDULE_HELP})
    """A `hf_ftpipe.schedules.ScheduleName` or a schedule file's path (`hf_ftpipe.trainer.schedule_choice`)."""
    async_weight_prediction: bool = field(
        default=False,
        metadata={
            "help": "'async' with SGD-momentum, Adam or AdamW: run each micro-batch on the weights its gradient "
            "will be applied to, extrapolated along the optimizer's momentum (less staleness, one weight copy "
            "per micro-batch in flight)."
        },
    )
    async_update_interval: int = field(
        default=1,
        metadata={"help": "'async' only: micro-batches whose gradients each stage accumulates per weight update."},
    )
    data_parallel_size: int | str | None = field(
        default=1,
        metadata={
            "help": "Replicas of the pipeline (data parallelism): the launched processes form data_parallel_size "
            "pipelines of world_size / data_parallel_size stages each, and every stage's gradients are summed "
            "across its replicas. per_device_train_batch_size is one replica's mini-batch, as under DDP. 'auto': "
            "the planner picks it from the launched machines and GPUs (the fastest predicted layout that fits "
            "memory); the global batch is then per_device_train_batch_size whatever it picks (each replica takes "
            "its share of the num_microbatches micro-batches), so the run trains on the same batches, with the "
            "same losses, as one pipeline would."
        },
    )
    """D, or ``"auto"`` (`hf_ftpipe.trainer.replicas.parse_data_parallel_size`). ``None`` is in the annotation
    only so that `HfArgumentParser` reads ``--data_parallel_size`` as text ("2" or "auto"; it keeps the
    second member of a union with None); None itself is refused."""
    num_microbatches: int = field(
        default=4,
        metadata={"help": "Micro-batches per mini-batch; per_device_train_batch_size must be a multiple of it."},
    )
    partitioner: str = field(
        default="auto",
        metadata={
            "help": "How the model is cut into stages: a registered partitioner (hf_ftpipe.partitioners."
            "available_partitioners()). 'auto': run them all and keep the fastest plan that fits memory; "
            "'seq-greedy': contiguous stages of equal cost."
        },
    )
    partition_memory_headroom: float = field(
        default=0.1,
        metadata={
            "help": "Fraction of each GPU's memory the partition leaves free (allocator, CUDA context, buffers)."
        },
    )
    partition_time_budget_s: float = field(
        default=60.0,
        metadata={
            "help": "With partitioner='auto': seconds of planning after which no further partitioner starts (the "
            "first always runs; the others are skipped, said in the log). Rank 0 plans while the other ranks wait, "
            "at most pipeline_timeout_s. A plan from partition_file, the cache or the Hub skips planning. With "
            "data_parallel_size='auto', the layouts compared share it."
        },
    )
    gpu_profile: str = field(
        default="auto",
        metadata={
            "help": "GPU profile for the cost model: 'auto' (each rank detects its own GPU; GPUs of different "
            "kinds get a profile per pipeline position), a built-in name (e.g. 'a100-80gb'), a profile's JSON "
            "file, or a topology as `hf-ftpipe compare --topology` takes it: a built-in name (e.g. "
            "'rtx3090+rtx2080ti') or a JSON file (Topology.to_json) with a GPU per launched process."
        },
    )
    cost_table: str | None = field(
        default=None,
        metadata={
            "help": "Price the ops with measured times instead of the GPU profile's roofline: a table written by "
            "`hf-ftpipe profile` for this model at this micro-batch's shapes, or 'measured' to time the model's "
            "blocks on rank 0's device first (cached under HF_HOME/hf_ftpipe/costs; the other ranks wait). Plans "
            "made from it are not cached, so a roofline plan in the cache is never taken for a measured one."
        },
    )
    partition_file: str | None = field(
        default=None,
        metadata={
            "help": "A partition JSON to use instead of computing one; refused if made for another model or setup."
        },
    )
    partition_repo: str | None = field(
        default=None,
        metadata={
            "help": "A Hub dataset repo ('namespace/name') of shared partitions: rank 0 pulls the plan made for this "
            "model, input shapes, dtype, schedule and GPU profile instead of computing it. Unreachable Hub: "
            "computed, with a warning. Honours HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE."
        },
    )
    partition_revision: str | None = field(
        default=None,
        metadata={"help": "Branch or commit of `partition_repo` to pull from (default: main); skips the local cache."},
    )
    push_partition_to_hub: bool = field(
        default=False,
        metadata={"help": "Push a computed partition to `partition_repo` (created if needed; needs HF_TOKEN)."},
    )
    partition_cache: bool = field(
        default=True,
        metadata={"help": "Read and write plans in the local cache, $HF_HOME/hf_ftpipe/partitions."},
    )
    weights_path: str | None = field(
        default=None,
        metadata={
            "help": "Checkpoint folder (safetensors) each rank reads its own stages' weights from. Needed when the "
            "model was built with empty weights (accelerate.init_empty_weights); default: the model's "
            "name_or_path when that is a local folder."
        },
    )
    release_unused_weights: bool = field(
        default=True,
        metadata={"help": "Free, on each rank, the weights of stages other ranks run (one slice per process)."},
    )
    predict_with_generate: bool = field(
        default=False,
        metadata={
            "help": "`evaluate()` and `predict()` return generated token ids as predictions (`model.generate` "
            "through the pipeline, as `Seq2SeqTrainer` does; a decoder-only model's include its prompt); "
            "`eval_loss` still comes from the teacher-forced forward."
        },
    )
    generation_max_length: int | None = field(
        default=None,
        metadata={
            "help": "With `predict_with_generate`: the longest generated sequence, decoder start token included "
            "(generate's `max_length`). PipeTrainer's default: an encoder-decoder's traced label length + 1, else "
            "the model's generation config; PipeSeq2SeqTrainer's, "
            "as Seq2SeqTrainer's: evaluate/predict's `max_length`, else this, else the model's generation config. "
            "A pipeline traced with fixed shapes generates at most its label length."
        },
    )
    plan_max_length: int | None = field(
        default=None,
        metadata={
            "help": "The longest sequence (every input's second dimension: input_ids, labels...) the pipeline is "
            "planned for: its cost and memory. Batches may be any length up to it. Default: the longest row of "
            "the training and evaluation datasets as the data collator pads it, else the first batch's length."
        },
    )
    token_slices: list[int] | str | None = field(
        default=None,
        metadata={
            "help": f"Causal LMs, schedules {', '.join(map(repr, SLICING_SCHEDULES))}: cut each sequence into "
            "token slices that flow through the "
            "pipeline like micro-batches (TeraPipe). Slice lengths for the planned (longest) sequence length, "
            "e.g. '512,512,1024' (a list in Python): a shorter batch keeps the leading slices that fit and cuts "
            "the last to what is left; or 'auto': chosen by TeraPipe's dynamic program from the cost model, "
            "re-planned for each length. Default: whole sequences."
        },
    )
    pipeline_timeout_s: float = field(
        default=300.0,
        metadata={"help": "Longest wait for any transfer between ranks before the whole job stops with an error."},
    )

    def __post_init__(self) -> None:
        if not self.use_cpu and use_cpu_for_launch():
            # Else transformers makes every rank process 0 of 1, and every rank writes (trainer/launch.py).
            self.use_cpu = True
        super().__post_init__()
        self.check_pipeline_fields()

    def check_pipeline_fields(self) -> None:
        """Check (and normalize) the pipeline's fields and the `Trainer` fields a pipeline constrains: at
        construction, and again once a ``hyperparameter_search`` trial has set some
        (`hf_ftpipe.trainer.model_init`)."""
        traits = self.schedule_traits
        partitioners = _available_partitioners()
        if self.partitioner not in partitioners:
            raise ValueError(f"`partitioner={self.partitioner!r}` is not available; choose one of {partitioners}")
        if not 0.0 <= self.partition_memory_headroom < 1.0:
            raise ValueError(
                f"`partition_memory_headroom` is the fraction of GPU memory kept free and must be in [0, 1), "
                f"got {self.partition_memory_headroom}; e.g. 0.1 keeps 10% free"
            )
        if not self.partition_time_budget_s >= 0:  # NaN too
            raise ValueError(
                f"`partition_time_budget_s` is the planning time after which `auto` starts no further partitioner "
                f"and must be at least 0, got {self.partition_time_budget_s}; 0 runs only the first (uniform)"
            )
        if self.cost_table not in (None, "measured") and not os.path.isfile(self.cost_table):
            raise ValueError(
                f"`cost_table` is neither 'measured' nor a file: {self.cost_table!r} does not exist; write one with "
                "`hf-ftpipe profile MODEL --seq-len ... --batch-size ... --out FILE`, or pass 'measured'"
            )
        if self.async_update_interval < 1:
            raise ValueError(f"`async_update_interval` must be at least 1, got {self.async_update_interval}")
        if self.async_update_interval > 1 and self.pipeline_schedule != "async":
            raise ValueError(
                f"`async_update_interval={self.async_update_interval}` only applies to pipeline_schedule='async' "
                f"(got {self.pipeline_schedule!r}); the other schedules update once per mini-batch"
            )
        if self.async_weight_prediction and self.pipeline_schedule != "async":
            raise ValueError(
                f"`async_weight_prediction=True` only applies to pipeline_schedule='async' (got "
                f"{self.pipeline_schedule!r}), whose gradients are stale; drop it or switch the schedule"
            )
        self.token_slices = _parse_token_slices(self.token_slices)
        if self.token_slices is not None and not traits.token_slices:
            raise ValueError(
                f"`token_slices={self.token_slices!r}` with pipeline_schedule={self.pipeline_schedule!r}: this "
                f"schedule versions its weights per sequence and cannot pipeline the slices of one; use one of "
                f"{SLICING_SCHEDULES}, or drop `token_slices`"
            )
        if self.num_microbatches < 1:
            raise ValueError(f"`num_microbatches` must be at least 1, got {self.num_microbatches}")
        self.data_parallel_size = parse_data_parallel_size(self.data_parallel_size)
        check_data_parallel_size(self.data_parallel_size, traits, launched_world_size())
        if self.data_parallel_size == "auto":
            check_auto_replicas(self)
        # Training splits each mini-batch into equal micro-batches, the shares its loss weights assume.
        # Evaluation takes eval batches of any size: a batch of fewer rows than num_microbatches runs as
        # that many micro-batches of one row, others as unequal ones (`microbatch_rows`), as a short last
        # batch always did, so per_device_eval_batch_size is free, as in Trainer.
        size = self.per_device_train_batch_size
        if size % self.num_microbatches:
            raise ValueError(
                f"`per_device_train_batch_size={size}` is not a multiple of `num_microbatches="
                f"{self.num_microbatches}`; use e.g. per_device_train_batch_size="
                f"{max(1, size // self.num_microbatches) * self.num_microbatches} (`per_device_eval_batch_size` "
                "may be any size)"
            )
        if self.gradient_accumulation_steps > 1 and not traits.flushes:
            raise ValueError(
                f"`gradient_accumulation_steps={self.gradient_accumulation_steps}` with pipeline_schedule="
                f"{self.pipeline_schedule!r}: this schedule updates each stage inside the pipeline as its "
                "micro-batches stream through, with no optimizer step of Trainer's to accumulate for; raise "
                "`per_device_train_batch_size` and `num_microbatches` instead"
                + (
                    ", or set `async_update_interval` (micro-batches per update)"
                    if self.pipeline_schedule == "async"
                    else ""
                )
                + ", or use pipeline_schedule='gpipe' or '1f1b', which accumulate over G batches in one flush"
            )
        # Every rank reads the same batch: there are no data-parallel replicas whose tokens Trainer would
        # gather (a collective) and then multiply the loss by their number for.
        self.average_tokens_across_devices = False
        full_eval = "fp16_full_eval" if self.fp16_full_eval else "bf16_full_eval" if self.bf16_full_eval else None
        if full_eval:
            raise ValueError(
                f"`{full_eval}=True` would cast the pipeline's stages to half precision in place, weights and "
                "all, for evaluation; use `bf16=True` or `fp16=True` instead: evaluation runs under the same "
                "autocast as training, and the weights stay float32"
            )
        unsupported = _unsupported_trainer_features(self)
        if unsupported:
            listed = "\n".join(f"  - {problem}" for problem in unsupported)
            raise ValueError(f"PipeTrainer cannot honour these arguments:\n{listed}")
        if self.fp16 and not traits.flushes:
            raise ValueError(
                f"`fp16=True` with pipeline_schedule={self.pipeline_schedule!r}: float16 loss scaling skips a step "
                "on every stage when any stage overflows, but this schedule updates each stage on its own inside "
                "the pipeline; use `bf16=True` (no loss scaling), or fp16 with pipeline_schedule='gpipe' or '1f1b'"
            )
        if self.generation_max_length is not None and self.generation_max_length < 2:
            raise ValueError(
                f"`generation_max_length={self.generation_max_length}` leaves no room for a generated token "
                "after the decoder start token; use 2 or more"
            )
        if self.push_partition_to_hub and not self.partition_repo:
            raise ValueError(
                "`push_partition_to_hub=True` needs `partition_repo`, the Hub dataset repo to push to, "
                "e.g. partition_repo='my-org/ftpipe-partitions'"
            )
        if self.push_partition_to_hub and self.pipeline_schedule not in SCHEDULES:
            raise ValueError(
                f"`push_partition_to_hub=True` with the schedule file {self.pipeline_schedule!r}: a plan's key names "
                "its schedule, here a path on this machine that says nothing to whoever pulls it; push plans made "
                "for a named schedule, or keep this one in a `partition_file`"
            )
        if self.partition_revision and not self.partition_repo:
            raise ValueError(
                f"`partition_revision={self.partition_revision!r}` needs `partition_repo`, the Hub dataset repo to "
                "pull from"
            )
        if self.partition_repo is not None and self.partition_repo.count("/") != 1:
            raise ValueError(
                f"`partition_repo={self.partition_repo!r}` is not a repo id; use 'namespace/name', "
                "e.g. 'my-org/ftpipe-partitions'"
            )
        if self.pipeline_timeout_s <= 0:
            raise ValueError(f"`pipeline_timeout_s` must be positive, got {self.pipeline_timeout_s}")

    @property
    def schedule_traits(self) -> ScheduleTraits:
        """What ``pipeline_schedule`` does, a name or a file alike; `ValueError` saying what to give
        otherwise (`hf_ftpipe.trainer.schedule_choice.check_schedule_argument`)."""
        return check_schedule_argument(self.pipeline_schedule, self.num_microbatches, self.gradient_accumulation_steps)

    @property
    def microbatches_per_step(self) -> int:
        """The micro-batches of one optimizer update, which gpipe and 1f1b run as one flush (and plan for)."""
        return self.num_microbatches * self.gradient_accumulation_steps


def _parse_token_slices(value: object) -> list[int] | str | None:
    """``token_slices`` as ``None``, ``"auto"`` or a list of positive lengths; the command line
    gives a string, e.g. ``"512,512,1024"``."""
    if value is None or value == "auto":
        return value
    if isinstance(value, str):
        try:
            value = [int(part) for part in value.split(",")]
        except ValueError:
            raise ValueError(
                f"`token_slices={value!r}` is neither 'auto' nor comma-separated slice lengths; "
                "use e.g. token_slices='512,512,1024'"
            ) from None
    if not isinstance(value, list | tuple) or not value:
        raise ValueError(
            f"`token_slices={value!r}` must be 'auto' or a non-empty list of slice lengths, e.g. [512, 512, 1024]"
        )
    wrong = [length for length in value if isinstance(length, bool) or not isinstance(length, int) or length < 1]
    if wrong:
        raise ValueError(
            f"`token_slices={list(value)}` holds lengths that are not positive integers ({wrong}); each slice "
            "is a number of tokens, and together they add up to the sequence length"
        )
    return list(value)


def _unsupported_trainer_features(args: PipeTrainingArguments) -> list[str]:
    """`Trainer` features that would be silently lost or break the pipeline, each with what to do."""
    problems = []
    other_split = "splits the model another way than pipeline stages and cannot be combined with them; remove it"
    if args.deepspeed:
        problems.append(f"`deepspeed` {other_split}")
    if args.fsdp:
        problems.append(f"`fsdp={args.fsdp!r}` {other_split}")
    if args.parallelism_config is not None:
        problems.append(f"`parallelism_config` {other_split}")
    if args.neftune_noise_alpha is not None:
        problems.append(
            f"`neftune_noise_alpha={args.neftune_noise_alpha}` adds noise through a hook on the model's input "
            "embeddings, which the traced stages do not run; remove it"
        )
    if args.use_liger_kernel:
        problems.append(
            "`use_liger_kernel=True` patches the model's modules after the pipeline traced them, so the stages "
            "would not use the kernels; remove it"
        )
    return problems


def _available_partitioners() -> list[str]:
    """Every registered partitioner name; importing the package registers the built-in ones."""
    import hf_ftpipe.partitioners  # noqa: F401
    from hf_ftpipe.partitioners.registry import available_partitioners

    return available_partitioners()
