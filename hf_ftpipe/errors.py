"""The exceptions hf_ftpipe raises: one small hierarchy, each subclassing the matching built-in."""

from __future__ import annotations

from typing import Literal, Protocol

Caller = Literal["python", "trainer", "cli"]
"""Who reads a fix: the partition API (keyword arguments), PipeTrainer (`PipeTrainingArguments`
fields), or the ``hf-ftpipe`` command (flags)."""


class Advice(Protocol):
    """What would fit and what to change (``partitioners.fit.FitAdvice``), worded for its reader.

    A protocol, so that the errors every package raises depend on no package.
    """

    def text(self, caller: Caller) -> str: ...


class FtpipeError(Exception):
    """Base class of every error hf_ftpipe raises on purpose."""


class TraceError(FtpipeError, RuntimeError):
    """The model could not be captured as a graph (names the model class, the op and what to try)."""


class ProfileError(FtpipeError, ValueError):
    """A GPU profile is unknown, malformed or cannot be detected."""


class PartitionError(FtpipeError, ValueError):
    """No valid partition exists for the request, or a plan breaks an invariant."""


class PlanDoesNotFitError(PartitionError):
    """No plan fits the GPUs' memory.

    ``reason`` says what the partitioners found; ``advice`` says what would fit and what to change,
    in the words of whoever reads it (``message``): a fix is `memory=MemoryOptions(recompute=True)`
    to a caller of the partition API, `activation_checkpointing=True` to PipeTrainer's, and
    `--recompute` on the command line. ``str()`` words it for ``caller``.
    """

    def __init__(self, reason: str, advice: Advice | None = None, caller: Caller = "python") -> None:
        super().__init__(reason)
        self.reason, self.advice, self.caller = reason, advice, caller

    def __str__(self) -> str:
        return self.message(self.caller)

    def message(self, caller: Caller) -> str:
        """The reason, then what would fit and the fixes as ``caller`` names them."""
        return self.reason if self.advice is None else f"{self.reason}\n{self.advice.text(caller)}"

    def worded_for(self, caller: Caller) -> PlanDoesNotFitError:
        """The same error, its ``str()`` in ``caller``'s words (to re-raise where that caller reads it)."""
        return PlanDoesNotFitError(self.reason, self.advice, caller)


class PartitionFormatError(PartitionError):
    """A partition file is corrupt, truncated, foreign or made for another model or setup."""


class LatencyFormatError(FtpipeError, ValueError):
    """A slice-latency file is corrupt, foreign, or was fitted for another model, shape or device."""


class CostTableError(FtpipeError, ValueError):
    """A measured cost table is corrupt, foreign, or was measured for another model, shape, dtype or device."""


class PipelineError(FtpipeError, RuntimeError):
    """A pipeline rank failed; the message begins ``[rank r, stage s]``."""


class CheckpointError(FtpipeError, ValueError):
    """A checkpoint cannot be resumed: incomplete, written for another model, or by another optimizer."""


class HubError(FtpipeError, ConnectionError):
    """The Hub (or the server in ``HF_ENDPOINT``) cannot be reached, refused a request, or failed."""
