"""A Hub-compatible HTTP server on 127.0.0.1 for tests: just enough of the Hub for huggingface_hub 2.4.

The real ``huggingface_hub`` client talks to it unchanged; no Hub, no network. It keeps repos in
memory as git-like histories: every commit has a 40-hex id, branches point at commits, and a
revision is resolved as a branch name or a commit id, so pinned revisions behave as on the Hub.
Files are stored "regular" (no LFS, no Xet), with their git blob id as ETag.

Endpoints (what ``create_repo``, ``upload_file``/``create_commit``, ``hf_hub_download``,
``get_hf_file_metadata``, ``repo_info`` and ``list_repo_tree``/``list_repo_files`` call)::

    POST /api/repos/create                                  409 (with "url") when it exists
    GET  /api/{type}s/{ns}/{name}/revision/{rev}            repo_info
    GET  /api/{type}s/{ns}/{name}/tree/{rev}[/{path}]       ?recursive=true
    POST /api/{type}s/{ns}/{name}/preupload/{rev}           uploadMode "regular"
    POST /api/{type}s/{ns}/{name}/commit/{rev}              NDJSON: header, file, deletedFile lines
    HEAD/GET /[{type}s/]{ns}/{name}/resolve/{rev}/{path}    X-Repo-Commit, ETag, Content-Length

Writes need ``Authorization: Bearer <token>`` when the server is started with a ``token``, so a
test can check that the client sent ``HF_TOKEN``. Faults for the fallback tests: ``fail_with(500)``
answers every request with that status, ``delay_s`` sleeps before answering (a client with a
shorter timeout gives up), ``omit_head_length`` leaves Content-Length off HEAD answers.
``requests`` records ``(method, path)`` of every request, so a test can assert that none was made.

huggingface_hub reads ``HF_ENDPOINT``, ``HF_HOME`` and ``HF_HUB_OFFLINE`` into
``huggingface_hub.constants`` when it is imported, so setting the environment afterwards does not
move the client. ``hf_ftpipe.hub.PartitionStore`` reads those variables itself when it is made and passes
``endpoint=``, ``cache_dir=`` and ``local_files_only=`` explicitly: a test sets them with
``monkeypatch.setenv`` (see ``tests/hub/conftest.py``), and a subprocess simply inherits them.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["HubServer"]

REPO_TYPES = ("model", "dataset", "space")


def blob_id(content: bytes) -> str:
    """Git's blob id: what the Hub reports as a regular file's oid and ETag."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


@dataclass
class Commit:
    oid: str
    files: dict[str, bytes]
    title: str
    description: str
    parent: str | None


@dataclass
class Repo:
    repo_type: str
    repo_id: str
    commits: dict[str, Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)

    def resolve(self, revision: str) -> Commit | None:
        oid = self.branches.get(revision, revision)
        return self.commits.get(oid)

    def commit(self, branch: str, files: dict[str, bytes], title: str, description: str) -> Commit:
        parent = self.branches.get(branch)
        seed = f"{self.repo_id}\n{parent}\n{title}\n{len(self.commits)}\n{time.time_ns()}".encode()
        commit = Commit(hashlib.sha1(seed).hexdigest(), files, title, description, parent)
        self.commits[commit.oid] = commit
        self.branches[branch] = commit.oid
        return commit


class HubServer:
    """The server and its in-memory repos; ``start()`` it on a free port, ``stop()`` it after."""

    def __init__(self, token: str | None = None) -> None:
        self.token = token
        self.repos: dict[tuple[str, str], Repo] = {}
        self.requests: list[tuple[str, str]] = []
        self.fail_status: int | None = None
        self.delay_s = 0.0
        self.omit_head_length = False
        self.lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        assert self._httpd is not None, "start() the server first"
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubServer:
        server = self

        class Handler(_Handler):
            hub = server

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._httpd.block_on_close = False  # a handler still sleeping in delay_s must not hold up stop()
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hub-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def fail_with(self, status: int | None) -> None:
        """Answer every request with ``status`` (None: serve normally again)."""
        self.fail_status = status

    def repo(self, repo_id: str, repo_type: str = "dataset") -> Repo:
        return self.repos[(repo_type, repo_id)]


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (quiet test output)
        pass

    def do_GET(self) -> None:
        self._serve("GET")

    def do_HEAD(self) -> None:
        self._serve("HEAD")

    def do_POST(self) -> None:
        self._serve("POST")

    # -- dispatch ---------------------------------------------------------------------------------

    def _serve(self, method: str) -> None:
        url = urlsplit(self.path)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) if method == "POST" else b""
        hub = self.hub
        with hub.lock:
            hub.requests.append((method, url.path))
        if hub.delay_s:
            time.sleep(hub.delay_s)
        try:
            if hub.fail_status is not None:
                return self._error(hub.fail_status, "simulated server failure")
            parts = [unquote(p) for p in url.path.split("/")[1:]]
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            if method == "POST" and self.hub.token and self.headers.get("Authorization") != f"Bearer {hub.token}":
                return self._error(401, "Invalid credentials in Authorization header")
            with hub.lock:
                self._route(method, parts, query, body)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout tests)
            pass

    def _route(self, method: str, parts: list[str], query: dict[str, str], body: bytes) -> None:
        if method == "POST" and parts == ["api", "repos", "create"]:
            return self._create_repo(json.loads(body or b"{}"))
        if method == "POST" and parts == ["api", "validate-yaml"]:
            # A card's metadata is checked before it is pushed (Trainer's model card, the partitions
            # card); the Hub answers 200 when the YAML is acceptable. Any YAML is, here.
            return self._json({"errors": [], "warnings": []})
        if len(parts) >= 6 and parts[0] == "api" and parts[1].rstrip("s") in REPO_TYPES:
            repo_type, repo_id, action, rest = parts[1][:-1], f"{parts[2]}/{parts[3]}", parts[4], parts[5:]
            repo = self.hub.repos.get((repo_type, repo_id))
            if repo is None:
                return self._error(404, f"Repository {repo_id} not found", "RepoNotFound")
            revision, path = rest[0], "/".join(rest[1:])
            if method == "GET" and action == "revision":
                return self._repo_info(repo, revision)
            if method == "GET" and action == "tree":
                return self._tree(repo, revision, path, query.get("recursive") in ("true", "True", "1"))
            if method == "POST" and action == "preupload":
                return self._preupload(repo, revision, json.loads(body))
            if method == "POST" and action == "commit":
                return self._commit(repo, revision, body)
        if method in ("GET", "HEAD"):
            repo_type = "model"
            if parts and parts[0] in ("datasets", "spaces"):
                repo_type, parts = parts[0][:-1], parts[1:]
            if len(parts) >= 5 and parts[2] == "resolve":
                repo = self.hub.repos.get((repo_type, f"{parts[0]}/{parts[1]}"))
                if repo is None:
                    return self._error(404, "Repository not found", "RepoNotFound")
                return self._resolve(method, repo, parts[3], "/".join(parts[4:]))
        return self._error(404, f"no route for {method} {self.path}")

    # -- endpoints --------------------------------------------------------------------------------

    def _create_repo(self, payload: dict[str, Any]) -> None:
        repo_type = payload.get("type") or "model"
        repo_id = f"{payload.get('organization') or 'user'}/{payload['name']}"
        prefix = "" if repo_type == "model" else f"{repo_type}s/"
        url = f"{self.hub.url}/{prefix}{repo_id}"
        if (repo_type, repo_id) in self.hub.repos:
            return self._json({"error": "You already created this repo", "url": url}, status=409)
        repo = Repo(repo_type, repo_id)
        repo.commit("main", {}, "initial commit", "")
        self.hub.repos[(repo_type, repo_id)] = repo
        return self._json({"url": url, "name": repo_id, "id": repo_id})

    def _repo_info(self, repo: Repo, revision: str) -> None:
        commit = repo.resolve(revision)
        if commit is None:
            return self._error(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        siblings = [{"rfilename": path} for path in sorted(commit.files)]
        return self._json({"id": repo.repo_id, "sha": commit.oid, "private": False, "siblings": siblings})

    def _tree(self, repo: Repo, revision: str, path: str, recursive: bool) -> None:
        commit = repo.resolve(revision)
        if commit is None:
            return self._error(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        prefix = f"{path.strip('/')}/" if path.strip("/") else ""
        entries: dict[str, dict[str, Any]] = {}
        for file_path, content in commit.files.items():
            if not file_path.startswith(prefix):
                continue
            rest = file_path[len(prefix) :].split("/")
            for depth in range(1, len(rest)):  # the folders on the way
                folder = prefix + "/".join(rest[:depth])
                entries.setdefault(folder, {"type": "directory", "path": folder, "oid": blob_id(folder.encode())})
                if not recursive:
                    break
            if recursive or len(rest) == 1:
                entries[file_path] = {"type": "file", "path": file_path, "size": len(content), "oid": blob_id(content)}
        if prefix and not entries:
            return self._error(404, f"{path} does not exist at {revision}", "EntryNotFound")
        return self._json(sorted(entries.values(), key=lambda e: e["path"]))

    def _preupload(self, repo: Repo, revision: str, payload: dict[str, Any]) -> None:
        commit = repo.resolve(revision)
        if commit is None:
            return self._error(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        files = []
        for entry in payload["files"]:
            existing = commit.files.get(entry["path"])
            oid = blob_id(existing) if existing is not None else None
            files.append({"path": entry["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": oid})
        return self._json({"files": files, "commitOid": commit.oid})

    def _commit(self, repo: Repo, revision: str, body: bytes) -> None:
        if revision not in repo.branches:
            return self._error(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        files = dict(repo.resolve(revision).files)
        header: dict[str, Any] = {}
        for line in body.splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            value = item["value"]
            if item["key"] == "header":
                header = value
            elif item["key"] == "file":
                if value.get("encoding") != "base64":
                    return self._error(400, f"unsupported encoding {value.get('encoding')!r}")
                files[value["path"]] = base64.b64decode(value["content"])
            elif item["key"] == "deletedFile":
                files.pop(value["path"], None)
            else:
                return self._error(400, f"this test server does not support {item['key']!r} operations")
        commit = repo.commit(revision, files, header.get("summary", ""), header.get("description", ""))
        prefix = "" if repo.repo_type == "model" else f"{repo.repo_type}s/"
        url = f"{self.hub.url}/{prefix}{repo.repo_id}/commit/{commit.oid}"
        return self._json({"commitOid": commit.oid, "commitUrl": url, "pullRequestUrl": None})

    def _resolve(self, method: str, repo: Repo, revision: str, path: str) -> None:
        commit = repo.resolve(revision)
        if commit is None:
            return self._error(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        content = commit.files.get(path)
        if content is None:
            return self._error(404, f"{path} does not exist", "EntryNotFound", commit=commit.oid)
        self.send_response(200)
        self.send_header("X-Repo-Commit", commit.oid)
        self.send_header("ETag", f'"{blob_id(content)}"')
        self.send_header("Content-Type", "application/octet-stream")
        if method == "HEAD":
            if not self.hub.omit_head_length:
                self.send_header("Content-Length", str(len(content)))
            else:  # keep-alive needs a framing: close instead of announcing a length
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            return
        self.send_header("Content-Length", str(len(content)))
        self.end_headers()
        self.wfile.write(content)

    # -- answers ----------------------------------------------------------------------------------

    def _json(self, data: Any, status: int = 200) -> None:
        payload = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _error(self, status: int, message: str, code: str | None = None, commit: str | None = None) -> None:
        payload = json.dumps({"error": message}).encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)
