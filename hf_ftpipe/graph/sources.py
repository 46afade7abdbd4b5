"""Models to plan for, built on the meta device from a name, a folder or a config file.

Planning needs the model's structure, never its weights, so everything here builds the model on
the meta device (no memory, no download of weights) from its config alone. A model spec is one of:

- a short name shipped with hf_ftpipe, usable offline: ``t5-3b``, ``gpt2-xl``, ``bert-large``
  (the paper's models; public config facts, see ``hf_ftpipe/model_configs/``);
- a local folder holding a ``config.json`` (what ``save_pretrained`` writes);
- a path to a config JSON file;
- a Hugging Face Hub model id (``AutoConfig.from_pretrained``: needs the network or the cache).

Which model class: the first name in the config's ``architectures`` (the shipped BERT-large
config names ``BertForQuestionAnswering``, for FTPipe's SQuAD task), else ``task``, else by the
config: a sequence-to-sequence LM for an encoder-decoder, a causal LM when the model type has one,
a masked LM otherwise.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from typing import Any, Literal, get_args

import torch
from torch import nn

from hf_ftpipe._json_depth import check_json_depth
from hf_ftpipe.errors import TraceError

__all__ = ["Task", "load_config", "load_model_for_planning", "sample_inputs_for", "shipped_models"]

Task = Literal["seq2seq-lm", "causal-lm", "masked-lm", "question-answering", "sequence-classification"]

_AUTO_CLASSES: dict[str, str] = {
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "question-answering": "AutoModelForQuestionAnswering",
    "sequence-classification": "AutoModelForSequenceClassification",
}


def shipped_models() -> list[str]:
    """Short names whose configs ship with hf_ftpipe (they work offline)."""
    folder = resources.files("hf_ftpipe.model_configs")
    return sorted(entry.name.removesuffix(".json") for entry in folder.iterdir() if entry.name.endswith(".json"))


def load_config(spec: str) -> Any:
    """The `PretrainedConfig` of ``spec`` (short name, folder, config JSON or Hub id; see the module)."""
    from transformers import AutoConfig  # late: importing transformers takes seconds

    if spec in shipped_models():
        text = (resources.files("hf_ftpipe.model_configs") / f"{spec}.json").read_text(encoding="utf-8")
        return _config_from_dict(json.loads(text), f"shipped config {spec!r}")
    if os.path.isdir(spec):
        path = os.path.join(spec, "config.json")
        if not os.path.isfile(path):
            raise TraceError(f"folder {spec!r} has no config.json; pass a folder written by save_pretrained")
        return _config_from_file(path)
    if spec.endswith(".json") or os.path.isfile(spec):
        if not os.path.isfile(spec):
            raise TraceError(f"no such config file {spec!r}; {_choices()}")
        return _config_from_file(spec)
    import huggingface_hub.constants as hub

    offline = hub.is_offline_mode()
    try:
        # The cache first: fast, and what works offline; then the Hub when we may.
        return AutoConfig.from_pretrained(spec, local_files_only=True)
    except (OSError, ValueError) as cached_error:
        if offline:
            raise TraceError(
                f"cannot find model {spec!r} offline (HF_HUB_OFFLINE is set and it is not in the cache); {_choices()}"
            ) from cached_error
    try:
        return AutoConfig.from_pretrained(spec)
    except (OSError, ValueError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise TraceError(f"cannot load the config of {spec!r} from the Hub ({first}); {_choices()}") from error


def load_model_for_planning(spec: str, task: Task | None = None) -> nn.Module:
    """Build the model ``spec`` names on the meta device (no weights), ready for `trace_model`.

    Args:
        spec (`str`): a shipped short name (``t5-3b``, ``gpt2-xl``, ``bert-large``), a local
            folder with a ``config.json``, a config JSON path, or a Hub model id.
        task (`str`, *optional*): the head to put on the model, overriding the config's
            ``architectures``: one of ``seq2seq-lm``, ``causal-lm``, ``masked-lm``,
            ``question-answering``, ``sequence-classification``.

    Raises:
        `TraceError`: unknown model, unreachable Hub, or no model class for the config.
    """
    import transformers

    if task is not None and task not in _AUTO_CLASSES:
        raise TraceError(f"unknown task {task!r}; use one of {list(get_args(Task))}")
    config = load_config(spec)
    architectures = getattr(config, "architectures", None) or []
    model_class = getattr(transformers, architectures[0], None) if architectures and task is None else None
    with torch.device("meta"):
        if model_class is not None:
            return model_class(config)
        for name in _candidate_tasks(config, task):
            auto_class = getattr(transformers, _AUTO_CLASSES[name])
            try:
                return auto_class.from_config(config)
            except ValueError:  # the model type has no such head
                continue
    raise TraceError(
        f"no model class for {spec!r} (model_type {getattr(config, 'model_type', None)!r}"
        + (f", task {task!r}" if task else "")
        + f"); pass another `task`, one of {list(get_args(Task))}"
    )


def sample_inputs_for(
    model: nn.Module,
    batch_size: int,
    seq_len: int,
    target_len: int | None = None,
    *,
    attention_mask: bool = False,
) -> dict[str, torch.Tensor]:
    """One micro-batch of meta tensors for ``model``, labels included, for `trace_model`.

    Encoder-decoder: ``input_ids`` [B, S] and ``labels`` [B, T] (T = ``target_len``, default S).
    Question answering: ``input_ids`` and ``start_positions``/``end_positions`` [B].
    Sequence classification: ``input_ids`` and ``labels`` [B]. Anything else (causal LM, masked
    LM, token classification): ``input_ids`` and ``labels`` [B, S]. With ``attention_mask``, an
    ``attention_mask`` [B, S] too (the graph, and so the plan, differs with and without one).
    """
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("target_len", target_len)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise TraceError(f"`{name}` must be a positive integer, got {value!r}")
    config = getattr(model, "config", None)
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if isinstance(limit, int) and seq_len > limit:
        raise TraceError(f"`seq_len` {seq_len} is longer than {type(model).__name__} allows ({limit} positions)")

    def ids(*shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=torch.long, device="meta")

    inputs = {"input_ids": ids(batch_size, seq_len)}
    if attention_mask:
        inputs["attention_mask"] = ids(batch_size, seq_len)
    name = type(model).__name__
    if getattr(config, "is_encoder_decoder", False):
        inputs["labels"] = ids(batch_size, target_len or seq_len)
    elif name.endswith("ForQuestionAnswering"):
        inputs["start_positions"] = ids(batch_size)
        inputs["end_positions"] = ids(batch_size)
    elif name.endswith("ForSequenceClassification"):
        inputs["labels"] = ids(batch_size)
    else:
        inputs["labels"] = ids(batch_size, seq_len)
    return inputs


def _candidate_tasks(config: Any, task: str | None) -> list[str]:
    if task is not None:
        return [task]
    if getattr(config, "is_encoder_decoder", False):
        return ["seq2seq-lm"]
    return ["causal-lm", "masked-lm"]


def _config_from_file(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        check_json_depth(text, f"config {path!r}", TraceError)
        data = json.loads(text)
    except (OSError, json.JSONDecodeError) as error:
        raise TraceError(f"cannot read config {path!r}: {error}") from error
    return _config_from_dict(data, path)


def _config_from_dict(data: Any, source: str) -> Any:
    from transformers import AutoConfig

    if not isinstance(data, dict) or "model_type" not in data:
        raise TraceError(
            f"{source} is not a model config: expected a JSON object with a 'model_type' (as save_pretrained writes it)"
        )
    settings = dict(data)
    model_type = settings.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **settings)
    except ValueError as error:
        raise TraceError(f"{source}: unknown model_type {model_type!r} for this transformers") from error


def _choices() -> str:
    return (
        f"pass a shipped short name ({', '.join(shipped_models())}; they work offline), a local folder "
        "with a config.json, a config JSON path, or a Hub model id (needs the network)"
    )
