"""A loopback Hub (tests/helpers/hub_server.py) on port 0, with a temporary HF_HOME and HF_ENDPOINT pointing at it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from hub_server import HubServer

TOKEN = "hf_loopback_token"


@contextmanager
def loopback_hub(hf_home: Path) -> Iterator[HubServer]:
    """A started loopback Hub, with the environment set to use it (and ``hf_home``) until the end."""
    server = HubServer(token=TOKEN).start()
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_HOME", str(hf_home))
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        for name in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_HUB_ETAG_TIMEOUT"):
            monkeypatch.delenv(name, raising=False)
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[HubServer]:
    with loopback_hub(tmp_path / "hf_home") as server:
        yield server


@pytest.fixture(scope="module")
def module_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    """`hub` for a module's shared launches: one server for all its tests."""
    with loopback_hub(tmp_path_factory.mktemp("hf_home")) as server:
        yield server
