"""A local stand-in for the Hugging Face Hub: the HTTP endpoints huggingface_hub 2.x calls, on 127.0.0.1.

Serves (as huggingface.co does, see huggingface_hub's hf_api.py / file_download.py / utils/_http.py):
  GET  /api/models/{repo}[/revision/{rev}]      model_info
  GET  /api/models/{repo}/tree/{rev}[/{path}]    list_repo_tree / list_repo_files (one page)
  HEAD /{repo}/resolve/{rev}/{file}              get_hf_file_metadata: ETag, X-Repo-Commit, Content-Length
  GET  /{repo}/resolve/{rev}/{file}              the bytes, with Range support (206 + Content-Range)
Errors carry the Hub's X-Error-Code header (RepoNotFound, EntryNotFound, GatedRepo), which is what
huggingface_hub's hf_raise_for_status turns into its typed exceptions. The server counts the bytes it
serves per file, records every request (method, path, Range header), can cut one transfer midway
(to test resume) and can answer 500 to everything. No xet headers are ever sent, so downloads take
the plain HTTP path.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import threading
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

COMMIT = "5b1bf75c0ffee0ddba11ab1e5eed5ca1ab1e0000"
REPO = r"(?P<repo>[^/]+/[^/]+)"
API_INFO = re.compile(rf"^/api/models/{REPO}(?:/revision/(?P<rev>[^/]+))?$")
API_TREE = re.compile(rf"^/api/models/{REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$")
RESOLVE = re.compile(rf"^/{REPO}/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    range: str | None


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.gated: set[str] = set()
        self.fail_status: int | None = None  # answer every request with this status
        self.cut: dict[str, int] = {}  # file name -> stop after this many body bytes, once
        # file name -> (body bytes to send, then wait for the event before the rest), once: a slow transfer
        self.hold: dict[str, tuple[int, threading.Event]] = {}
        self.served: Counter[str] = Counter()  # file name -> body bytes sent
        self.requests: list[Request] = []
        self._server: ThreadingHTTPServer | None = None

    def add(self, repo: str, filename: str, data: bytes) -> None:
        self.repos.setdefault(repo, {})[filename] = data

    def add_file(self, repo: str, filename: str, path: Path) -> None:
        self.add(repo, filename, path.read_bytes())

    def sha256(self, repo: str, filename: str) -> str:
        return hashlib.sha256(self.repos[repo][filename]).hexdigest()

    def gets(self, filename: str) -> list[Request]:
        return [r for r in self.requests if r.method == "GET" and r.path.endswith("/" + filename)]

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> str:
        hub = self

        class Handler(_Handler):
            fake = hub

        self._server = _QuietServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True).start()
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        """A client that hangs up mid-transfer (a cancelled download) is expected, not a server error."""
        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    fake: FakeHub

    def log_message(self, format: str, *args: object) -> None:  # keep pytest output clean
        return None

    def _send(self, status: int, headers: dict[str, str], body: bytes = b"") -> None:
        self.send_response(status)
        for k, v in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str | None, message: str, extra: dict[str, str] | None = None) -> None:
        headers = {"Content-Type": "application/json", "X-Error-Message": message, **(extra or {})}
        if code:
            headers["X-Error-Code"] = code
        self._send(status, headers, json.dumps({"error": message}).encode())

    def _json(self, data: object) -> None:
        self._send(200, {"Content-Type": "application/json"}, json.dumps(data).encode())

    def do_HEAD(self) -> None:
        self._route()

    def do_GET(self) -> None:
        self._route()

    def _route(self) -> None:
        fake = self.fake
        path = unquote(urlsplit(self.path).path)
        fake.requests.append(Request(self.command, path, self.headers.get("Range")))
        if fake.fail_status is not None:
            return self._error(fake.fail_status, None, "Internal Error - We're working hard to fix this")
        for pattern, handler in ((API_TREE, self._tree), (API_INFO, self._info), (RESOLVE, self._resolve)):
            m = pattern.match(path)
            if m:
                repo = m["repo"]
                if repo not in fake.repos:
                    return self._error(404, "RepoNotFound", "Repository not found")
                return handler(repo, m)
        self._error(404, None, "Not Found")

    def _info(self, repo: str, m: re.Match[str]) -> None:
        files = self.fake.repos[repo]
        self._json({
            "id": repo, "modelId": repo, "sha": COMMIT, "private": False,
            "gated": "manual" if repo in self.fake.gated else False,
            "siblings": [{"rfilename": name, "size": len(data), "blobId": hashlib.sha1(data).hexdigest()}
                         for name, data in sorted(files.items())],
        })

    def _tree(self, repo: str, m: re.Match[str]) -> None:
        entries = []
        for name, data in sorted(self.fake.repos[repo].items()):
            sha = hashlib.sha256(data).hexdigest()
            entries.append({"type": "file", "oid": hashlib.sha1(data).hexdigest(), "size": len(data), "path": name,
                            "lfs": {"oid": sha, "size": len(data), "pointerSize": 134}})
        self._json(entries)

    def _resolve(self, repo: str, m: re.Match[str]) -> None:
        fake = self.fake
        if repo in fake.gated:
            return self._error(403, "GatedRepo", f"Access to model {repo} is restricted and you are not in the authorized list.")
        data = fake.repos[repo].get(m["file"])
        if data is None:
            return self._error(404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": COMMIT})
        headers = {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Repo-Commit": COMMIT,
                   "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        start, end, status = 0, len(data) - 1, 200
        wanted = RANGE.match(self.headers.get("Range") or "")
        if wanted:
            start = int(wanted[1])
            end = min(int(wanted[2]), len(data) - 1) if wanted[2] else len(data) - 1
            if start >= len(data):
                return self._error(416, None, "Range Not Satisfiable", {"Content-Range": f"bytes */{len(data)}"})
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
        body = data[start : end + 1]
        if self.command == "HEAD":
            return self._send(status, headers, body)
        cut = fake.cut.pop(m["file"], None)
        self.send_response(status)
        for k, v in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(k, v)
        self.end_headers()
        sent = body if cut is None else body[: max(0, cut - start)]
        hold = fake.hold.pop(m["file"], None)
        if hold is not None:
            first, release = hold
            fake.served[m["file"]] += first
            self.wfile.write(sent[:first])
            self.wfile.flush()
            release.wait(30)
            sent = sent[first:]
        fake.served[m["file"]] += len(sent)  # counted first: the client may be done before write() returns
        self.wfile.write(sent)
        if cut is not None:  # the promised Content-Length never arrives: a dropped connection
            self.wfile.flush()
            self.close_connection = True


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeHub:
    """A FakeHub that huggingface_hub talks to, with a fresh HF cache and specchat data dir under tmp_path.

    huggingface_hub reads HF_ENDPOINT, HF_HUB_CACHE, HF_HUB_OFFLINE and HF_HUB_DISABLE_XET once, at import,
    into `huggingface_hub.constants`; so the fixture sets the environment (for subprocesses) and patches
    the constants (for this process), and drops the shared HTTP client so it is rebuilt with NO_PROXY.
    """
    from huggingface_hub import constants
    from huggingface_hub.utils import close_session

    fake = FakeHub()
    url = fake.start()
    cache = tmp_path / "hf" / "hub"
    for name, value in {
        "HF_ENDPOINT": url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(cache), "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1", "NO_PROXY": "127.0.0.1,localhost", "SPECCHAT_DATA_DIR": str(tmp_path / "data"),
    }.items():
        monkeypatch.setenv(name, value)
    for name in ("HF_HUB_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)  # several progress updates per test file
    close_session()
    yield fake
    close_session()
    fake.stop()


# --- a Hub holding two catalog repos (the `qwen2.5` pair, with tiny GGUFs under the real file names) --------------

TARGET_REPO, TARGET_FILE = "bartowski/Qwen2.5-7B-Instruct-GGUF", "Qwen2.5-7B-Instruct-Q4_K_M.gguf"
TARGET_Q8_FILE = "Qwen2.5-7B-Instruct-Q8_0.gguf"
DRAFT_REPO, DRAFT_FILE = "bartowski/Qwen2.5-0.5B-Instruct-GGUF", "Qwen2.5-0.5B-Instruct-Q8_0.gguf"
OTHER_REPO, OTHER_FILE = "test/other-vocab-GGUF", "other-F32.gguf"
GATED_REPO = "test/gated-GGUF"


@dataclass(frozen=True)
class HubGGUFs:
    target: Path  # several MB: a wide feed-forward pads the weights far past the header
    draft: Path  # smaller, same vocabulary
    other: Path  # same size of vocabulary, other token texts
    small: Path  # a plain tiny model


@pytest.fixture(scope="session")
def hub_ggufs(tmp_path_factory: pytest.TempPathFactory) -> HubGGUFs:
    from gguf_factory import TinyModel, spm_vocab, write_llama_gguf

    d = tmp_path_factory.mktemp("hub_ggufs")
    wide = TinyModel(n_ff=4096)
    return HubGGUFs(
        target=write_llama_gguf(d / "target.gguf", model=wide),
        draft=write_llama_gguf(d / "draft.gguf", model=TinyModel(n_ff=3072), noise=0.3),
        other=write_llama_gguf(d / "other.gguf", model=wide, vocab=spm_vocab(tuple(f"w{i}" for i in range(32)))),
        small=write_llama_gguf(d / "small.gguf", noise=0.1),
    )


@pytest.fixture
def catalog_hub(hub: FakeHub, hub_ggufs: HubGGUFs) -> FakeHub:
    hub.add_file(TARGET_REPO, TARGET_FILE, hub_ggufs.target)
    hub.add_file(TARGET_REPO, TARGET_Q8_FILE, hub_ggufs.small)
    hub.add(TARGET_REPO, "README.md", b"# not a model\n")
    hub.add_file(DRAFT_REPO, DRAFT_FILE, hub_ggufs.draft)
    hub.add_file(OTHER_REPO, OTHER_FILE, hub_ggufs.other)
    hub.add_file(GATED_REPO, "gated-Q4_K_M.gguf", hub_ggufs.small)
    hub.gated.add(GATED_REPO)
    return hub
