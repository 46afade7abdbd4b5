"""What a `Trainer` user sees around the loop stays the same under PipeTrainer: callbacks on every
rank, one progress bar, one tensorboard log, and throughput, FLOP and token counts of one model,
not of one model per rank; a trainer made with ``model_init`` trains a new model at each ``train()``,
and ``hyperparameter_search`` runs each trial as `Trainer` does, planned for the trial's batch size,
pruned on every rank alike.
Also the launch mistakes a user makes get an error that says what to do.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import HfArgumentParser

from hf_ftpipe import PipeTrainingArguments, get_profile
from hf_ftpipe.graph.trace import capture_model
from hf_ftpipe.partitioners.registry import get_partitioner
from hf_ftpipe.runtime.compiled_stages import CompileOptions
from hf_ftpipe.trainer.compilation import stage_compile_options

import auto_batch_runs
from distributed import REPO, accelerate_launch, run_job
from model_init_runs import masked_lm_twice, search, train_twice
from models import SEQ, tiny_batch, tiny_model

JOB = str(REPO / "tests" / "trainer" / "surface_job.py")
STEPS, BATCH = 4, 4  # as in surface_job.py


@pytest.fixture(scope="module")
def surface(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    output = tmp_path_factory.mktemp("surface")
    result = accelerate_launch(JOB, str(output))
    (output / "launch.log").write_text(result.stdout + result.stderr)
    return output, [json.loads((output / f"surface_rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.distributed
@pytest.mark.slow
def test_every_rank_runs_the_callbacks_and_only_one_shows_a_progress_bar(surface: tuple[Path, list[dict]]) -> None:
    _, ranks = surface
    for rank in ranks:
        assert rank["events"]["on_step_end"] == STEPS
        assert rank["events"]["on_evaluate"] == STEPS // 2
        assert rank["events"]["on_train_begin"] == rank["events"]["on_train_end"] == 1
    assert [all(r["progress_bar_open"]) for r in ranks] == [True, False]
    assert not any(ranks[1]["progress_bar_open"])


@pytest.mark.distributed
@pytest.mark.slow
def test_counts_are_of_one_model_not_one_per_rank(surface: tuple[Path, list[dict]]) -> None:
    _, ranks = surface
    data = tiny_batch("gpt2", BATCH * STEPS, seed=1)
    model = tiny_model("gpt2")
    # What plain Trainer reports on one process: 6 × tokens × non-embedding parameters.
    expected_flos = 6 * BATCH * SEQ * STEPS * model.num_parameters(exclude_embeddings=True)
    for rank in ranks:
        assert rank["total_flos"] == pytest.approx(expected_flos)
        assert rank["num_input_tokens_seen"] == int(data["attention_mask"].sum())
    metrics = ranks[0]["metrics"]
    samples_per_s = STEPS * BATCH / metrics["train_runtime"]
    assert metrics["train_samples_per_second"] == pytest.approx(samples_per_s, rel=0.05, abs=0.01)
    assert metrics["train_steps_per_second"] == pytest.approx(STEPS / metrics["train_runtime"], rel=0.05, abs=0.01)


@pytest.mark.distributed
@pytest.mark.slow
def test_each_train_of_a_model_init_trainer_starts_from_a_new_model_as_trainers_does(
    surface: tuple[Path, list[dict]], tmp_path: Path
) -> None:
    reference = train_twice(str(tmp_path), pipe=False)  # plain Trainer, one process
    first, second = reference["losses"]
    assert first == second, "Trainer trains a new model at each train()"
    for rank in surface[1]:
        pipe_first, pipe_second = rank["model_init"]["losses"]
        assert pipe_first == pytest.approx(first, abs=1e-5)
        assert pipe_second == pytest.approx(second, abs=1e-5)
        # One model at __init__ and one per train(), as Trainer: the pipeline's model is the one Trainer trains.
        assert rank["model_init"]["models_made"] == reference["models_made"] == 3
        first_files, second_files = rank["model_init"]["open_files"]
        assert second_files == first_files, "the first train()'s pipeline is closed, its sockets with it"


@pytest.mark.distributed
@pytest.mark.slow
def test_each_train_under_model_init_masks_from_where_making_the_model_left_the_generators(
    surface: tuple[Path, list[dict]], tmp_path: Path
) -> None:
    first, second = masked_lm_twice(str(tmp_path), pipe=False)  # plain Trainer, one process
    assert first == second
    for rank in surface[1]:
        pipe_first, pipe_second = rank["model_init_masked_lm"]
        assert pipe_first == pytest.approx(first, abs=1e-5)
        assert pipe_second == pytest.approx(second, abs=1e-5)


@pytest.mark.distributed
@pytest.mark.slow
def test_hyperparameter_search_trials_run_as_under_trainer_each_at_its_own_batch_size(
    surface: tuple[Path, list[dict]], tmp_path: Path
) -> None:
    reference = search(str(tmp_path), pipe=False, settings=[0, 1])  # plain Trainer, one process
    losses = reference["eval_losses"]
    # The first trial is pruned at its first evaluation; the second evaluates after each of its 2 steps.
    assert len(losses) == 3 and losses[0] != pytest.approx(losses[1], abs=1e-3)
    assert reference["best"]["objective"] == losses[2]
    for rank in surface[1]:
        # Rank 0 runs the study, rank 1 is handed each trial's parameters; both plan each trial's pipeline
        # for its batch size (2 rows, then 4: the grid's order), which a pipeline planned for 2 rows could
        # not run at 4; both stop the pruned trial after its first evaluation and go on to the next.
        assert rank["search"]["models_made"] == reference["models_made"] == 3
        assert rank["search"]["eval_losses"] == pytest.approx(losses, abs=1e-5)
    assert surface[1][0]["search"]["best"] == pytest.approx(reference["best"], abs=1e-5)
    assert surface[1][1]["search"]["best"] is None  # the study is process 0's
    for rank in surface[1]:
        assert rank["search_refused"] == {
            "error": "a hyperparameter_search trial set arguments PipeTrainer cannot run: "
            "`per_device_train_batch_size=3` is not a multiple of `num_microbatches=2`; use e.g. "
            "per_device_train_batch_size=2 (`per_device_eval_batch_size` may be any size); keep `hp_space` to "
            "values the pipeline's other arguments allow"
        }


@pytest.mark.distributed
@pytest.mark.slow
def test_tensorboard_gets_one_log_with_every_step(surface: tuple[Path, list[dict]]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    output, ranks = surface
    event_files = list(output.rglob("events.out.tfevents.*"))
    assert len(event_files) == 1, event_files  # rank 0 only
    events = EventAccumulator(str(event_files[0].parent))
    events.Reload()
    logged = [scalar.value for scalar in events.Scalars("train/loss")]
    expected = [entry["loss"] for entry in ranks[0]["log_history"] if "loss" in entry]
    assert len(logged) == STEPS
    assert logged == pytest.approx(expected, rel=1e-5)
    assert len(events.Scalars("eval/loss")) == STEPS // 2


@pytest.mark.distributed
@pytest.mark.slow
def test_at_the_default_log_level_neither_trainer_nor_the_plan_logs_info(surface: tuple[Path, list[dict]]) -> None:
    # At log_level="info" both show, once (test_launch.py).
    log = (surface[0] / "launch.log").read_text()
    assert "Running training" not in log and "pipeline plan:" not in log


def test_arguments_parse_from_the_command_line(tmp_path: Path) -> None:
    parser = HfArgumentParser(PipeTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "--report_to", "none"]
        + ["--pipeline_schedule", "1f1b", "--num_microbatches", "4", "--per_device_train_batch_size", "8"]
        + ["--partitioner", "seq-dp", "--activation_checkpointing"]
    )
    assert (args.pipeline_schedule, args.num_microbatches, args.partitioner) == ("1f1b", 4, "seq-dp")
    assert args.activation_checkpointing


def test_command_line_rejects_an_unknown_schedule_and_names_both_choices(tmp_path: Path) -> None:
    parser = HfArgumentParser(PipeTrainingArguments)  # as a script parses its command line (sys.argv's words)
    with pytest.raises(ValueError) as error:
        parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--pipeline_schedule", "zero-bubble"])
    assert "unknown pipeline schedule 'zero-bubble'; choose one of ['gpipe', '1f1b', 'async', '2bw'" in str(error.value)
    assert "or give the path of a schedule file" in str(error.value)


def test_help_lists_the_schedules_and_schedule_files() -> None:
    from hf_ftpipe.schedules import SCHEDULE_NAMES

    text = " ".join(HfArgumentParser(PipeTrainingArguments).format_help().split())
    described = text[text.index("--pipeline_schedule PIPELINE_SCHEDULE, ") :]
    assert all(f"'{name}': " in described for name in SCHEDULE_NAMES), described[:2000]
    assert "Or the path of a schedule file" in described


@pytest.mark.slow
def test_a_single_process_is_told_how_to_launch(tmp_path: Path) -> None:
    result = run_job(JOB, str(tmp_path), timeout_s=240, check=False)
    assert result.returncode != 0
    assert "accelerate launch --multi_gpu --num_processes N" in result.stderr[-3000:]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_plan_for_another_number_of_gpus_names_the_launch_that_fits(tmp_path: Path) -> None:
    batch = {k: v[:2] for k, v in tiny_batch("gpt2", 2, seed=1).items()}  # one micro-batch of the job
    graph = capture_model(tiny_model("gpt2"), batch).cost_graph
    plan = get_partitioner("seq-greedy")(graph, get_profile("auto", count=3), num_microbatches=2, microbatch_size=2)
    plan.to_json(tmp_path / "plan.json")
    result = accelerate_launch(JOB, str(tmp_path), str(tmp_path / "plan.json"), check=False)
    assert result.returncode != 0
    assert "num_gpus: file has 3, expected 2" in result.stderr
    assert "`accelerate launch --num_processes 3 ...`" in result.stderr


@pytest.mark.parametrize("schedule", ["async", "2bw"])
def test_fp16_with_a_streaming_schedule_is_refused_with_the_alternatives(tmp_path: Path, schedule: str) -> None:
    with pytest.raises(ValueError, match=rf"`fp16=True` with pipeline_schedule='{schedule}'.*use `bf16=True`.*'gpipe'"):
        PipeTrainingArguments(
            output_dir=str(tmp_path), fp16=True, pipeline_schedule=schedule, use_cpu=True, report_to="none"
        )


@pytest.mark.parametrize("flag", ["fp16_full_eval", "bf16_full_eval"])
def test_half_precision_full_eval_is_refused_with_the_autocast_alternative(tmp_path: Path, flag: str) -> None:
    with pytest.raises(ValueError, match=rf"`{flag}=True` would cast the pipeline's stages .* use `bf16=True` or"):
        PipeTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **{flag: True})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"neftune_noise_alpha": 5.0}, "`neftune_noise_alpha=5.0` adds noise through a hook"),
        ({"fsdp": "full_shard"}, "splits the model another way than pipeline stages"),
    ],
    ids=["neftune", "fsdp"],
)
def test_trainer_features_the_pipeline_would_lose_are_refused(tmp_path: Path, overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=rf"PipeTrainer cannot honour these arguments:\n  - .*{message}"):
        PipeTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **overrides)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"torch_compile": True}, CompileOptions(backend="inductor", mode=None)),  # TrainingArguments' default backend
        ({"torch_compile_backend": "aot_eager"}, CompileOptions(backend="aot_eager", mode=None)),  # implies compile
        ({"torch_compile_mode": "max-autotune"}, CompileOptions(backend="inductor", mode="max-autotune")),
        ({}, None),
    ],
    ids=["flag", "backend", "mode", "off"],
)
def test_torch_compile_compiles_the_stages_with_the_users_backend_and_mode(
    tmp_path: Path, overrides: dict, expected: CompileOptions | None
) -> None:
    args = PipeTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **overrides)
    assert stage_compile_options(args) == expected


SCRIPT_ARGUMENTS = {
    # the ModelArguments / DataTrainingArguments fields of transformers' examples/pytorch scripts (run_glue,
    # run_clm, run_mlm, run_qa, run_summarization, run_translation), parsed beside the training arguments
    "model_name_or_path", "config_name", "tokenizer_name", "cache_dir", "use_fast_tokenizer", "model_revision",
    "token", "trust_remote_code", "torch_dtype", "low_cpu_mem_usage", "task_name", "dataset_name",
    "dataset_config_name", "max_seq_length", "overwrite_cache", "pad_to_max_length", "max_train_samples",
    "max_eval_samples", "max_predict_samples", "train_file", "validation_file", "test_file", "doc_stride",
    "n_best_size", "max_answer_length", "version_2_with_negative", "null_score_diff_threshold", "block_size",
    "mlm_probability", "line_by_line", "preprocessing_num_workers", "validation_split_percentage", "streaming",
    "max_source_length", "max_target_length", "val_max_target_length", "num_beams", "ignore_pad_token_for_loss",
    "source_prefix", "text_column", "summary_column", "source_lang", "target_lang", "forced_bos_token",
}  # fmt: skip


def test_no_pipeline_argument_clashes_with_an_example_script_argument() -> None:
    """HfArgumentParser refuses two fields of one name: a clash would break the one-line swap."""
    from dataclasses import fields

    from transformers import TrainingArguments

    ours = {f.name for f in fields(PipeTrainingArguments)} - {f.name for f in fields(TrainingArguments)}
    assert ours, "PipeTrainingArguments adds fields of its own"
    assert not ours & SCRIPT_ARGUMENTS, sorted(ours & SCRIPT_ARGUMENTS)


@pytest.mark.parametrize("backend", ["ray", "wandb"])
def test_hyperparameter_search_refuses_a_backend_that_runs_trials_in_its_own_processes(
    tmp_path: Path, backend: str
) -> None:
    from hf_ftpipe import PipeTrainer
    from hf_ftpipe.errors import PipelineError

    args = PipeTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    trainer = PipeTrainer(model_init=lambda: tiny_model("gpt2"), args=args)
    with pytest.raises(
        PipelineError, match=rf"backend='{backend}'\) runs each trial in processes of its own.*'optuna'"
    ):
        trainer.hyperparameter_search(backend=backend, n_trials=1)


@pytest.mark.distributed
@pytest.mark.slow
def test_auto_find_batch_size_trains_at_the_largest_batch_whose_plan_fits(
    surface: tuple[Path, list[dict]], tmp_path: Path
) -> None:
    reference = auto_batch_runs.train(str(tmp_path), pipe=False)  # plain Trainer at the batch that fits
    assert len(reference["losses"]) == auto_batch_runs.STEPS
    for rank in surface[1]:
        assert rank["auto_batch"]["batch_size"] == auto_batch_runs.FOUND
        assert rank["auto_batch"]["losses"] == pytest.approx(reference["losses"], abs=1e-5)
    log = (surface[0] / "launch.log").read_text()
    assert "auto_find_batch_size: per_device_train_batch_size=8 does not fit the GPUs' memory; training with 4" in log


def test_auto_find_batch_size_stops_at_an_out_of_memory_error_instead_of_retrying_on_one_rank(tmp_path: Path) -> None:
    from hf_ftpipe import PipeTrainer
    from hf_ftpipe.errors import PipelineError

    args = PipeTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", auto_find_batch_size=True)
    trainer = PipeTrainer(model=tiny_model("gpt2"), args=args)
    trainer._update_auto_batch_size(trainer._train_batch_size)  # the planned batch: the loop's first run
    with pytest.raises(PipelineError, match=r"out of memory at per_device_train_batch_size=8 .* does not retry"):
        trainer._update_auto_batch_size(int(trainer._train_batch_size * 0.9))  # accelerate's retry


@pytest.mark.parametrize(("data_parallel_size", "per_device"), [(1, 8), (2, 4)])
def test_auto_find_batch_size_resumes_at_the_batch_its_checkpoint_records(
    tmp_path: Path, data_parallel_size: int, per_device: int
) -> None:
    from transformers.trainer_callback import TrainerState

    from hf_ftpipe import PipeTrainer

    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    TrainerState(train_batch_size=8).save_to_json(str(checkpoint / "trainer_state.json"))  # the global batch
    args = PipeTrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        auto_find_batch_size=True,
        data_parallel_size=data_parallel_size,
        per_device_train_batch_size=16,
    )
    trainer = PipeTrainer(model=tiny_model("gpt2"), args=args)
    trainer._resume_from = str(checkpoint)
    assert trainer._resumed_batch_size() == per_device
