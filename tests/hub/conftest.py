"""A loopback Hub (tests/helpers/hub_server.py) on port 0, with a temporary HF_HOME and HF_ENDPOINT pointing at it."""

from __future__ import annotations

from pathlib import Path

import pytest

from hub_server import HubServer

TOKEN = "hf_loopback_token"


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    server = HubServer(token=TOKEN).start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    for name in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_HUB_ETAG_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    yield server
    server.stop()
