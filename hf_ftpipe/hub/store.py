"""PartitionStore: plans keyed by what they were planned for, in a local cache and a Hub dataset repo.

Layout, the same in the repo and in the cache (``$HF_HOME/hf_ftpipe/partitions/``)::

    plans/v{format_version}/{model_class}/{model_fingerprint}/{gpu_profile}x{num_gpus}/
        {schedule}-mb{num_microbatches}-{dtype}-{key_digest}.json

``key_digest`` (``PartitionKey.digest``) covers every key field, input shapes included, so one key
is one path. Files from the Hub are data only: JSON of at most ``MAX_HUB_FILE_BYTES`` (checked
from the HEAD answer before downloading, and on disk after), validated field by field by
``Partition.from_dict``, and checked against the expected key. Never pickle, never code.

Settings come from the environment when the store is made, as huggingface_hub reads them:
``HF_ENDPOINT`` (server), ``HF_TOKEN`` (auth), ``HF_HOME``/``HF_HUB_CACHE`` (caches),
``HF_HUB_OFFLINE`` (no network: pulls read huggingface_hub's download cache, pushes fail) and
``HF_HUB_ETAG_TIMEOUT`` (seconds before a silent server counts as unreachable; a push or a listing,
several requests, gets three times that in all). They are passed to huggingface_hub explicitly, so
changing the environment after import takes effect.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from hf_ftpipe._cache import cache_root
from hf_ftpipe.errors import HubError, PartitionFormatError
from hf_ftpipe.plan.partition import FORMAT_VERSION, Partition, PartitionKey

__all__ = ["MAX_HUB_FILE_BYTES", "PartitionStore", "PlanEntry", "PulledPlan", "path_for", "parse_path"]

MAX_HUB_FILE_BYTES = 8 * 2**20
"""Largest plan file taken from the Hub: a T5-3B plan is ~100 KiB."""
REPO_TYPE = "dataset"
T = TypeVar("T")
logger = logging.getLogger(__name__)
_PATH = re.compile(
    r"^plans/v(?P<format_version>\d+)/(?P<model_class>[^/]+)/(?P<model_fingerprint>[^/]+)/"
    r"(?P<gpu_profile>[^/]+)x(?P<num_gpus>\d+)/(?P<schedule>[^-/]+)-mb(?P<num_microbatches>\d+)-"
    r"(?P<dtype>[^-/]+)-(?P<key_digest>[0-9a-f]{16})\.json$"
)


def _safe(part: str) -> str:
    """A path component: letters, digits, ``.``, ``_``, ``-`` (never ``..`` or a separator)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", part).strip(".") or "_"


def path_for(key: PartitionKey, format_version: int = FORMAT_VERSION) -> str:
    """Where the plan for ``key`` lives in a repo (and under the cache folder)."""
    return (
        f"plans/v{format_version}/{_safe(key.model_class)}/{_safe(key.model_fingerprint)}/"
        f"{_safe(key.gpu_profile)}x{key.num_gpus}/{_safe(key.schedule).replace('-', '_')}-"
        f"mb{key.num_microbatches}-{_safe(key.dtype).replace('-', '_')}-{key.digest()}.json"
    )


@dataclass(frozen=True)
class PlanEntry:
    """One plan file of a repo, as its path tells (no download)."""

    path: str
    format_version: int
    model_class: str
    model_fingerprint: str
    gpu_profile: str
    num_gpus: int
    schedule: str
    num_microbatches: int
    dtype: str
    key_digest: str
    size_bytes: int | None = None

    def matches(
        self,
        *,
        model: str | None = None,
        gpu_profile: str | None = None,
        num_gpus: int | None = None,
        schedule: str | None = None,
        num_microbatches: int | None = None,
        key: str | None = None,
    ) -> bool:
        """``model``: a class name (any case) or a fingerprint prefix; ``key``: a digest prefix."""
        if model and model.lower() != self.model_class.lower() and not self.model_fingerprint.startswith(model):
            return False
        if gpu_profile and _safe(gpu_profile).lower() != self.gpu_profile.lower():
            return False
        if key and not self.key_digest.startswith(key):
            return False
        wanted = {"num_gpus": num_gpus, "schedule": schedule, "num_microbatches": num_microbatches}
        return all(value is None or getattr(self, name) == value for name, value in wanted.items())


def parse_path(path: str, size_bytes: int | None = None) -> PlanEntry | None:
    """The entry of a path written by ``path_for``; None for any other file."""
    match = _PATH.match(path)
    if match is None:
        return None
    fields = match.groupdict()
    for name in ("format_version", "num_gpus", "num_microbatches"):
        fields[name] = int(fields[name])
    return PlanEntry(path=path, size_bytes=size_bytes, **fields)


@dataclass(frozen=True)
class PulledPlan:
    partition: Partition
    path: str
    """Path in the repo."""
    commit: str | None
    """Commit the file was read at (None when read offline by branch name)."""
    location: str
    """``hf://datasets/{repo}@{revision}/{path}``: for messages."""


def _is_true(value: str | None) -> bool:
    return (value or "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _network_errors() -> tuple[type[BaseException], ...]:
    try:
        from httpx2 import HTTPError
    except ImportError:  # huggingface_hub < 2 uses requests/httpx; their errors are OSErrors or HfHubHTTPError
        from huggingface_hub.errors import HfHubHTTPError as HTTPError
    return (OSError, HTTPError)


class PartitionStore:
    """Plans in the local cache and, with ``repo_id``, in a Hub dataset repo.

    Args:
        repo_id (`str`, *optional*): ``"namespace/name"`` of a dataset repo.
        revision (`str`, *optional*): branch or commit id to pull and list at (default: ``main``).
        token, endpoint, timeout_s: default to ``HF_TOKEN``, ``HF_ENDPOINT``, ``HF_HUB_ETAG_TIMEOUT`` (10 s);
            a push or a listing may take three times ``timeout_s`` in all.
        offline (`bool`, *optional*): default ``HF_HUB_OFFLINE``.
        max_file_bytes (`int`): largest file taken from the Hub.
    """

    def __init__(
        self,
        repo_id: str | None = None,
        *,
        revision: str | None = None,
        token: str | None = None,
        endpoint: str | None = None,
        offline: bool | None = None,
        timeout_s: float | None = None,
        max_file_bytes: int = MAX_HUB_FILE_BYTES,
    ) -> None:
        from huggingface_hub import constants

        self.repo_id = repo_id
        self.revision = revision
        self.token = token or os.environ.get("HF_TOKEN") or None
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
        self.offline = (
            offline if offline is not None else (_is_true(os.environ.get("HF_HUB_OFFLINE")) or constants.HF_HUB_OFFLINE)
        )
        self.timeout_s = timeout_s or float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or constants.DEFAULT_ETAG_TIMEOUT)
        home = os.environ.get("HF_HOME")
        self.hf_home = cache_root().parent
        self.hub_cache = os.environ.get("HF_HUB_CACHE") or (
            str(self.hf_home / "hub") if home else constants.HF_HUB_CACHE
        )
        self.cache_dir = self.hf_home / "hf_ftpipe" / "partitions"
        self.max_file_bytes = max_file_bytes

    # -- local cache --------------------------------------------------------------------------------

    def cache_path(self, key: PartitionKey) -> Path:
        return self.cache_dir / path_for(key)

    def load_cached(self, key: PartitionKey) -> Partition | None:
        """The cached plan for ``key``; None if there is none. A bad file raises `PartitionFormatError`."""
        path = self.cache_path(key)
        if not path.is_file():
            return None
        return Partition.from_json(path, expected_key=key)

    def save_cached(self, partition: Partition) -> Path:
        path = self.cache_path(partition.key)
        path.parent.mkdir(parents=True, exist_ok=True)
        partition.to_json(path)
        return path

    # -- the Hub ----------------------------------------------------------------------------------

    def _repo(self) -> str:
        if not self.repo_id:
            raise HubError("no Hub repo: pass `repo_id` (a dataset repo, e.g. 'my-org/ftpipe-partitions')")
        return self.repo_id

    def location(self, path: str, revision: str | None = None) -> str:
        return f"hf://datasets/{self._repo()}@{revision or self.revision or 'main'}/{path}"

    def pull(self, key: PartitionKey, *, revision: str | None = None) -> PulledPlan | None:
        """The plan for ``key`` from the repo; None when the repo (or the file in it) does not exist."""
        from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError

        try:
            return self.pull_path(path_for(key), revision=revision, expected_key=key)
        except (EntryNotFoundError, RepositoryNotFoundError):
            return None

    def pull_path(
        self, path: str, *, revision: str | None = None, expected_key: PartitionKey | None = None
    ) -> PulledPlan:
        """Download, size-check and validate the plan at ``path``; refuse it if made for another key."""
        from huggingface_hub import get_hf_file_metadata, hf_hub_url
        from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

        repo, revision = self._repo(), revision or self.revision
        where = self.location(path, revision)
        commit = None
        try:
            if not self.offline:
                url = hf_hub_url(repo, path, repo_type=REPO_TYPE, revision=revision, endpoint=self.endpoint)
                meta = get_hf_file_metadata(url, token=self.token, timeout=self.timeout_s, endpoint=self.endpoint)
                commit = meta.commit_hash
                if meta.size is not None and meta.size > self.max_file_bytes:
                    raise PartitionFormatError(
                        f"{where}: the file is {meta.size} bytes, more than the {self.max_file_bytes} a partition "
                        "file from the Hub may have; refused without downloading it"
                    )
            local = self._within_deadline(
                f"downloading {where}", lambda: self._download(path, revision, local_only=self.offline)
            )
        except (EntryNotFoundError, RepositoryNotFoundError):
            raise  # "nothing there": pull() turns these into None
        except RevisionNotFoundError as e:
            raise HubError(f"{where}: revision {revision!r} does not exist in {repo}") from e
        except _network_errors() as e:
            error = HubError(f"{where}: cannot read it from {self.endpoint}: {type(e).__name__}: {e}")
            try:  # nothing is lost: a copy downloaded before still serves
                local = self._download(path, revision, local_only=True)
            except (EntryNotFoundError, *_network_errors()):
                raise error from e
            logger.warning("%s; using the copy downloaded before", error)
        size = os.path.getsize(local)
        if size > self.max_file_bytes:
            raise PartitionFormatError(
                f"{where}: the file is {size} bytes, more than the {self.max_file_bytes} a partition file from "
                "the Hub may have; refused"
            )
        partition = _read_plan(local, where)
        if expected_key is not None:
            partition.check_key(expected_key, source=where)
        return PulledPlan(partition=partition, path=path, commit=commit, location=where)

    def _download(self, path: str, revision: str | None, *, local_only: bool) -> str:
        from huggingface_hub import hf_hub_download

        return hf_hub_download(
            self._repo(),
            path,
            repo_type=REPO_TYPE,
            revision=revision,
            cache_dir=self.hub_cache,
            token=self.token,
            etag_timeout=self.timeout_s,
            local_files_only=local_only,
            endpoint=self.endpoint,
        )

    def push(
        self, partition: Partition, *, commit_message: str | None = None, branch: str | None = None
    ) -> tuple[str, str]:
        """Commit the plan to the repo (created if needed); returns (path in repo, commit id)."""
        from huggingface_hub import HfApi

        repo = self._repo()
        if self.offline:
            raise HubError(f"cannot push to {repo}: HF_HUB_OFFLINE is set; unset it to push")
        data = partition.to_text().encode("utf-8")
        if len(data) > self.max_file_bytes:
            raise PartitionFormatError(
                f"the plan is {len(data)} bytes of JSON, more than the {self.max_file_bytes} a Hub plan may have"
            )
        path = path_for(partition.key, partition.format_version)
        api = HfApi(endpoint=self.endpoint, token=self.token)

        def upload() -> Any:
            api.create_repo(repo, repo_type=REPO_TYPE, exist_ok=True)
            return api.upload_file(
                path_or_fileobj=data,
                path_in_repo=path,
                repo_id=repo,
                repo_type=REPO_TYPE,
                revision=branch,
                commit_message=commit_message or describe(partition),
                commit_description=json.dumps(partition.key.to_dict(), indent=1),
            )

        try:
            info = self._within_deadline(f"pushing to {repo}", upload)
        except _network_errors() as e:
            raise HubError(f"cannot push to {repo} at {self.endpoint}: {type(e).__name__}: {e}") from e
        return path, info.oid

    def list(self, *, revision: str | None = None, **filters: object) -> list[PlanEntry]:
        """The plans in the repo (offline: those in the download cache), filtered as ``PlanEntry.matches``."""
        self._repo()
        revision = revision or self.revision
        entries = self._list_cache(revision) if self.offline else self._list_remote(revision)
        return sorted((e for e in entries if e.matches(**filters)), key=lambda e: e.path)

    def _list_remote(self, revision: str | None) -> list[PlanEntry]:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError

        api = HfApi(endpoint=self.endpoint, token=self.token)
        try:
            files = self._within_deadline(
                f"listing {self.repo_id}",
                lambda: list(
                    api.list_repo_tree(self.repo_id, "plans", recursive=True, revision=revision, repo_type=REPO_TYPE)
                ),
            )
        except EntryNotFoundError:
            return []
        except RepositoryNotFoundError as e:
            raise HubError(f"dataset repo {self.repo_id} not found at {self.endpoint} (private? set HF_TOKEN)") from e
        except _network_errors() as e:
            raise HubError(f"cannot list {self.repo_id} at {self.endpoint}: {type(e).__name__}: {e}") from e
        parsed = (parse_path(f.path, getattr(f, "size", None)) for f in files)
        return [entry for entry in parsed if entry is not None]

    def _within_deadline(self, what: str, call: Callable[[], T]) -> T:
        """``call()``, given up after ``3 * timeout_s`` with a `HubError` (a `ConnectionError`, so
        callers treat it as the network failure it is): huggingface_hub's HTTP client itself waits
        for a silent server without limit, and a training run must not (rank 0 pulls or pushes while
        the other ranks wait for its plan). The call runs in a daemon thread, left behind if it hangs."""
        deadline_s = 3 * self.timeout_s
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["value"] = call()
            except BaseException as error:  # re-raised in the caller's thread below
                outcome["error"] = error

        thread = threading.Thread(target=run, name=f"hf_ftpipe: {what}", daemon=True)
        thread.start()
        thread.join(deadline_s)
        if thread.is_alive():
            raise HubError(
                f"{what} at {self.endpoint}: no answer within {deadline_s:g} s (3 × HF_HUB_ETAG_TIMEOUT); "
                "is the server up? Raise HF_HUB_ETAG_TIMEOUT for a slow link"
            )
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def _list_cache(self, revision: str | None) -> list[PlanEntry]:
        folder = Path(self.hub_cache) / f"datasets--{self._repo().replace('/', '--')}"
        revision = revision or "main"
        commit = revision
        if not re.fullmatch(r"[0-9a-f]{40}", revision):
            ref = folder / "refs" / revision
            if not ref.is_file():
                return []
            commit = ref.read_text().strip()
        snapshot = folder / "snapshots" / commit
        found = []
        for file in sorted(snapshot.rglob("*.json")) if snapshot.is_dir() else []:
            entry = parse_path(file.relative_to(snapshot).as_posix(), file.stat().st_size)
            if entry is not None:
                found.append(entry)
        return found


def describe(partition: Partition) -> str:
    """One line for a commit: model, GPUs, schedule and what the cost model predicts."""
    key = partition.key
    line = (
        f"{key.model_class} on {key.num_gpus} × {key.gpu_profile}, {key.schedule}, {key.num_microbatches} micro-batches"
    )
    predicted = partition.predicted
    if predicted is not None:
        line += f": {predicted.throughput_samples_per_s:.3g} samples/s predicted, worst/ideal {predicted.imbalance:.2f}"
    return f"{line}, {partition.partitioner}"


def _read_plan(local: str, where: str) -> Partition:
    from hf_ftpipe.plan._json import read_json

    try:
        data = read_json(local)
    except PartitionFormatError as e:
        raise PartitionFormatError(f"{where}: {str(e).removeprefix(f'{local}: ')}") from None
    return Partition.from_dict(data, source=where)
