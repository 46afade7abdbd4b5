"""The runtime does not run token slices yet: a sliced order is refused before any message is sent."""

from types import SimpleNamespace

import pytest

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.runtime.engine import PipelineEngine
from hf_ftpipe.schedules import make_schedule


def test_the_engine_refuses_a_sliced_order_with_a_clear_message() -> None:
    order = make_schedule("gpipe", [0, 1], 1, num_slices=2).global_order()
    engine = SimpleNamespace(rank=0, _lowering=None)  # refused before the lowering is used
    with pytest.raises(PipelineError, match=r"\[rank 0\] token slices are planned but not executed yet"):
        PipelineEngine._program(engine, order)  # type: ignore[arg-type]
