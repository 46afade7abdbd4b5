"""The exceptions hf_ftpipe raises: one small hierarchy, each subclassing the matching built-in."""


class FtpipeError(Exception):
    """Base class of every error hf_ftpipe raises on purpose."""


class TraceError(FtpipeError, RuntimeError):
    """The model could not be captured as a graph (names the model class, the op and what to try)."""


class ProfileError(FtpipeError, ValueError):
    """A GPU profile is unknown, malformed or cannot be detected."""


class PartitionError(FtpipeError, ValueError):
    """No valid partition exists for the request, or a plan breaks an invariant."""


class PartitionFormatError(PartitionError):
    """A partition file is corrupt, truncated, foreign or made for another model or setup."""


class PipelineError(FtpipeError, RuntimeError):
    """A pipeline rank failed; the message begins ``[rank r, stage s]``."""


class CheckpointError(FtpipeError, ValueError):
    """A checkpoint cannot be resumed: incomplete, written for another model, or by another optimizer."""


class HubError(FtpipeError, ConnectionError):
    """The Hub (or the server in ``HF_ENDPOINT``) cannot be reached, refused a request, or failed."""
