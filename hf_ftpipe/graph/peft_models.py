"""`peft` models (LoRA adapters): which module to export, and what is supported.

A ``PeftModel`` wraps the Hugging Face model it injected its adapters into. For LoRA, its
``forward`` only calls that model's ``forward`` (``peft_model.get_base_model()``), whose signature
names ``use_cache`` and the other inputs, as the exporter needs (the wrapper's own ``forward`` is
often ``(*args, **kwargs)``). So the capture exports the inner model and names every tensor as
the wrapper does (``base_model.model.…``): plans, checkpoints and `save_model()` see the
``PeftModel``'s own names, and its ``lora_A``/``lora_B`` weights are ops in the scope of the layer
they adapt, placed with it like any other weight of that layer.

Only LoRA is tested through the pipeline; other methods are refused with the reason. ``peft`` is
imported only when a model comes from it (it is an optional dependency, ``hf_ftpipe[peft]``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from hf_ftpipe.errors import TraceError

__all__ = [
    "TESTED_PEFT",
    "apply_lora",
    "check_peft_model",
    "export_target",
    "is_peft_model",
    "naming_untested_peft",
    "peft_version_note",
]

TESTED_PEFT = ((0, 21, 2), (1, 0, 0))
"""The ``peft`` releases the suite runs against: at least the first, below the second (pyproject's ``[peft]``)."""


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (without importing peft: a model made by it means it is loaded)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def check_peft_model(model: nn.Module) -> None:
    """Refuse what is not tested through the pipeline, with the reason and what to do instead.

    Raises:
        `TraceError`: a PEFT method other than LoRA, several adapters active, or DoRA.
    """
    name = type(model).__name__
    active = list(getattr(model, "active_adapters", None) or [])
    if len(active) != 1:
        raise TraceError(
            f"{name} has {len(active)} active adapters {active}; the pipeline trains one: "
            "call `model.set_adapter(name)` before passing it to PipeTrainer"
        )
    config = model.peft_config[active[0]]
    method = getattr(config.peft_type, "value", str(config.peft_type))
    if method != "LORA":
        reason = (
            "its virtual tokens change the model's inputs, which the traced graph fixes"
            if getattr(config, "is_prompt_learning", False)
            else "it is not tested through the pipeline"
        )
        raise TraceError(
            f"{name} uses the PEFT method {method}: PipeTrainer trains LoRA adapters only ({reason}); "
            "use `peft.LoraConfig`, or train this model with plain `Trainer`"
        )
    if getattr(config, "use_dora", False):
        raise TraceError(
            f"{name} uses DoRA (`LoraConfig(use_dora=True)`), which is not tested through the pipeline; "
            "use plain LoRA (`use_dora=False`), or train this model with plain `Trainer`"
        )


def export_target(model: nn.Module) -> nn.Module:
    """The module to export for ``model``: for a LoRA ``PeftModel``, the model holding its adapters
    (see the module docstring); any other model is exported as it is."""
    if not is_peft_model(model):
        return model
    check_peft_model(model)
    return model.get_base_model()


def apply_lora(model: nn.Module, r: int, target_modules: list[str] | None = None) -> nn.Module:
    """``model`` (on the meta device is enough) with LoRA adapters of rank ``r``, for planning.

    The ``PeftModel`` subclass follows the model's head (a causal LM: ``PeftModelForCausalLM``, as
    ``task_type="CAUSAL_LM"`` makes it), so that a plan made here fits a script that passes that task.

    Args:
        model (`nn.Module`): a Hugging Face model, e.g. from `load_model_for_planning`.
        r (`int`): the adapters' rank.
        target_modules (`list[str]`, *optional*): the names of the modules to adapt (peft's
            ``LoraConfig.target_modules``); default: peft's own for the model type (T5: ``q``, ``v``;
            GPT-2: ``c_attn``).

    Raises:
        `TraceError`: peft is not installed, ``r`` is not a positive integer, or peft refuses the targets.
    """
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise TraceError(f"the LoRA rank must be a positive integer, got {r!r}")
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as error:
        raise TraceError("planning a LoRA model needs peft: `pip install 'hf_ftpipe[peft]'`") from error
    config = LoraConfig(
        r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=target_modules, task_type=_task_type(model)
    )
    try:
        return get_peft_model(model, config)
    except ValueError as error:  # peft's own message names the targets it could not find
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise TraceError(
            f"cannot put LoRA adapters on {type(model).__name__}: {first}; name the modules to adapt "
            "(`--lora-targets`, peft's `target_modules`)" + peft_version_note()
        ) from error


def _task_type(model: nn.Module) -> str | None:
    """peft's ``task_type`` for ``model``'s head, so that the planned model is the ``PeftModel`` subclass
    a training script makes (its class is part of the plan's key): ``None`` where peft has none."""
    name = type(model).__name__
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return "SEQ_2_SEQ_LM"
    for suffix, task in (
        ("ForCausalLM", "CAUSAL_LM"),
        ("LMHeadModel", "CAUSAL_LM"),
        ("ForSequenceClassification", "SEQ_CLS"),
        ("ForTokenClassification", "TOKEN_CLS"),
        ("ForQuestionAnswering", "QUESTION_ANS"),
    ):
        if name.endswith(suffix):
            return task
    return None


def peft_version_note() -> str:
    """A sentence to add to a failure of a ``peft`` model when its release is outside the tested range
    (empty inside it)."""
    peft = sys.modules.get("peft")
    version = getattr(peft, "__version__", "")
    try:
        found = tuple(int(part) for part in version.split("+")[0].split(".")[:3])
    except ValueError:
        found = ()
    low, high = TESTED_PEFT
    if found and low <= found < high:
        return ""
    tested = f">={'.'.join(map(str, low))},<{'.'.join(map(str, high[:1]))}"
    return (
        f" (peft {version or 'of unknown version'} is outside the releases hf_ftpipe is tested with, "
        f"peft{tested}: install one of those, `pip install 'hf_ftpipe[peft]'`)"
    )


@contextmanager
def naming_untested_peft(model: nn.Module) -> Iterator[None]:
    """A `TraceError` of a ``peft`` model whose release is outside the tested range says so (`peft_version_note`)."""
    try:
        yield
    except TraceError as error:
        note = peft_version_note() if is_peft_model(model) else ""
        if not note:
            raise
        raise TraceError(f"{error}{note}") from error
