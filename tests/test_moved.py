"""Import paths of hf_ftpipe 0.1 (`hf_ftpipe._moved`) still work for this release: they give the
objects of the new homes, with a FutureWarning naming those homes."""

from __future__ import annotations

import importlib
import re
import sys

import pytest

from hf_ftpipe._moved import MOVED


def _forget(monkeypatch: pytest.MonkeyPatch, old: str) -> None:
    """Drop ``old`` and its children from ``sys.modules`` for this test (restored after), so the
    import runs, and warns, again."""
    for name in [name for name in sys.modules if name == old or name.startswith(old + ".")]:
        monkeypatch.delitem(sys.modules, name)


def test_from_the_old_partition_package_import_partition(monkeypatch: pytest.MonkeyPatch) -> None:
    _forget(monkeypatch, "hf_ftpipe.partition")
    with pytest.warns(FutureWarning, match=r"hf_ftpipe\.partition moved to .*hf_ftpipe\.plan"):
        from hf_ftpipe.partition import Partition
    from hf_ftpipe.plan import Partition as new

    assert Partition is new


@pytest.mark.parametrize(
    ("old", "name", "new"),
    [
        ("hf_ftpipe.profile", "get_profile", "hf_ftpipe.costmodel"),
        ("hf_ftpipe.profile.gpu", "GPUProfile", "hf_ftpipe.costmodel.profiles"),
        ("hf_ftpipe.partition", "partition_seq_greedy", "hf_ftpipe.partitioners"),
        ("hf_ftpipe.partition.validate", "validate_partition", "hf_ftpipe.plan.validate"),
        ("hf_ftpipe.partition.registry", "get_partitioner", "hf_ftpipe.partitioners.registry"),
        ("hf_ftpipe.training_args", "PipeTrainingArguments", "hf_ftpipe.trainer.arguments"),
    ],
)
def test_an_old_path_gives_the_new_homes_object_and_a_warning_naming_it(
    monkeypatch: pytest.MonkeyPatch, old: str, name: str, new: str
) -> None:
    _forget(monkeypatch, old)
    with pytest.warns(FutureWarning, match=rf"{re.escape(old)} moved to .*{re.escape(new)}\b"):
        forwarded = getattr(importlib.import_module(old), name)
    assert forwarded is getattr(importlib.import_module(new), name)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_every_old_path_names_each_of_its_homes_and_when_it_goes_away(
    monkeypatch: pytest.MonkeyPatch, old: str
) -> None:
    _forget(monkeypatch, old)
    with pytest.warns(FutureWarning) as warned:
        importlib.import_module(old)
    message = next(str(w.message) for w in warned if str(w.message).startswith(f"{old} moved to "))
    assert all(home in message for home in MOVED[old]), message
    assert message.endswith("the old path goes away in the next release"), message


def test_a_name_the_new_homes_lack_is_an_attribute_error_naming_the_old_path(monkeypatch: pytest.MonkeyPatch) -> None:
    _forget(monkeypatch, "hf_ftpipe.profile")
    with pytest.warns(FutureWarning):
        old = importlib.import_module("hf_ftpipe.profile")
    with pytest.raises(AttributeError, match="module 'hf_ftpipe.profile' has no attribute 'no_such_name'"):
        old.no_such_name  # noqa: B018
