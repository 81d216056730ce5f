"""GGUF files on the Hugging Face Hub: list a repo, pick a file, download it into
the standard HF cache with progress, cancellation and resume, and register it.

Built on huggingface_hub 2.x (https://huggingface.co/docs/huggingface_hub):
`HfApi.model_info`, `get_hf_file_metadata` (the HEAD call on
`/{repo}/resolve/{revision}/{file}` that gives the ETag, commit and size),
`http_get` (the library's own streaming GET, which retries a dropped connection
with a Range request) and `hf_hub_download` (the cache layout:
blobs/<etag>, snapshots/<commit>/<file> -> blob, refs/main).

Why not `hf_hub_download` alone: since huggingface_hub 1.x it downloads into a
per-call unique temporary file and deletes it on any failure, so a cancelled
or killed multi-GB download starts over. Here the bytes go to
blobs/<etag>.incomplete (the name older versions resumed from), appended to
with a Range request on the next pull; once whole, the blob is renamed into
place and `hf_hub_download` only links it into the snapshot.

Endpoint, cache dir and offline mode are read from `huggingface_hub.constants`
at call time (HF_ENDPOINT, HF_HUB_CACHE / HF_HOME, HF_HUB_OFFLINE).
"""

from __future__ import annotations

import errno
import fnmatch
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence
from urllib.parse import urlsplit

import httpx2
from huggingface_hub import HfApi, constants, get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import http_get, repo_folder_name
from huggingface_hub.utils import WeakFileLock, build_hf_headers

from models.errors import ModelError
from models.gguf_info import validate_gguf
from models.store import ModelStore, StoredModel

LOGIN_HINT = "log in with `hf auth login` or set HF_TOKEN"


class Cancelled(ModelError):
    """The caller's cancel event was set during a download; the partial file stays for the next pull."""


@dataclass(frozen=True)
class Progress:
    """Bytes of one file so far; what a CLI bar or a TUI ProgressBar shows."""

    filename: str
    done: int
    total: int | None

    @property
    def fraction(self) -> float | None:
        return None if not self.total else min(1.0, self.done / self.total)


ProgressCallback = Callable[[Progress], None]


@dataclass(frozen=True)
class HubModel:
    """One GGUF to fetch: a repo and a glob for its file (None: the repo's only GGUF)."""

    alias: str  # the name it is stored under once pulled
    repo: str
    pattern: str | None
    quant: str | None


@dataclass(frozen=True)
class HubFile:
    repo: str
    filename: str
    size: int | None = None
    path: Path | None = None  # set for files in the local cache


def is_offline(offline: bool | None = None) -> bool:
    return constants.is_offline_mode() if offline is None else offline


def cache_dir() -> Path:
    return Path(constants.HF_HUB_CACHE)


def _first_line(error: object) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


@contextmanager
def hub_errors(repo: str, filename: str | None = None) -> Iterator[None]:
    """Turn huggingface_hub / network / disk exceptions into one-line ModelErrors."""
    what = repo if filename is None else f"{repo}/{filename}"
    try:
        yield
    except ModelError:
        raise
    except GatedRepoError:  # before RepositoryNotFoundError: it is a subclass
        raise ModelError(f"{repo} is a gated repo: accept its terms on the Hub, then {LOGIN_HINT}") from None
    except RepositoryNotFoundError:
        raise ModelError(f"{repo}: no such repo on the Hugging Face Hub (if it is private, {LOGIN_HINT})") from None
    except RevisionNotFoundError:
        raise ModelError(f"{repo}: no such revision on the Hugging Face Hub") from None
    except RemoteEntryNotFoundError:
        raise ModelError(f"{repo}: the repo has no file {filename}") from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status is not None and status >= 500:
            raise ModelError(f"{what}: the Hugging Face Hub answered {status} (server error); try again later") from None
        if status in (401, 403):
            raise ModelError(f"{what}: access denied (HTTP {status}); {LOGIN_HINT}") from None
        raise ModelError(f"{what}: the Hugging Face Hub answered HTTP {status}") from None
    except (httpx2.TransportError, OfflineModeIsEnabled, LocalEntryNotFoundError) as e:
        raise ModelError(
            f"cannot reach the Hugging Face Hub at {constants.ENDPOINT} ({type(e).__name__}); check the network, "
            "or use --offline for models already pulled"
        ) from None
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise ModelError(
                f"disk full while downloading {what} into {cache_dir()}: free some space and pull again "
                "(the partial download is kept and resumes)"
            ) from None
        raise ModelError(f"{what}: {_first_line(e.strerror or e)}") from None


# --- listing and choosing files -------------------------------------------------------------------------------------

def _snapshots(repo_folder: Path) -> list[Path]:
    """The repo's snapshot folders in the cache, the one refs/main points to first."""
    snaps = repo_folder / "snapshots"
    if not snaps.is_dir():
        return []
    found = sorted(p for p in snaps.iterdir() if p.is_dir())
    ref = repo_folder / "refs" / "main"
    if ref.is_file():
        main = snaps / ref.read_text().strip()
        found.sort(key=lambda p: p != main)
    return found


def cached_ggufs(repo: str | None = None) -> tuple[HubFile, ...]:
    """GGUF files in the local HF cache (one repo, or all); reads no network."""
    root = cache_dir()
    folders = [root / repo_folder_name(repo_id=repo, repo_type="model")] if repo else sorted(root.glob("models--*"))
    out: list[HubFile] = []
    for folder in folders:
        repo_id = folder.name.removeprefix("models--").replace("--", "/")  # the Hub forbids '--' in names
        seen: set[str] = set()
        for snap in _snapshots(folder):
            for p in sorted(snap.rglob("*.gguf")):
                name = p.relative_to(snap).as_posix()
                if name not in seen and p.exists():  # exists(): skip links to blobs that were deleted
                    seen.add(name)
                    out.append(HubFile(repo_id, name, p.stat().st_size, p))
    return tuple(out)


def list_ggufs(repo: str, offline: bool | None = None) -> tuple[HubFile, ...]:
    """The repo's GGUF files: from the Hub, or from the cache when offline."""
    if is_offline(offline):
        return cached_ggufs(repo)
    with hub_errors(repo):
        # model_info(files_metadata=True): one request with every file's size. (list_repo_tree would do too, but
        # it retries a failing server with backoff for ~25 s before giving up; a user should hear at once.)
        info = HfApi(endpoint=constants.ENDPOINT).model_info(repo, files_metadata=True)
    return tuple(HubFile(repo, s.rfilename, s.size) for s in info.siblings or () if s.rfilename.lower().endswith(".gguf"))


def match_files(names: Sequence[str], pattern: str | None) -> list[str]:
    """File names matching a glob, case-insensitively (Qwen's official repos spell quants in lower case)."""
    ggufs = [n for n in names if n.lower().endswith(".gguf")]
    if pattern is None:
        return ggufs
    return [n for n in ggufs if fnmatch.fnmatch(n.lower(), pattern.lower())]


def pick_file(repo: str, names: Sequence[str], pattern: str | None) -> str:
    """The one file `pattern` names in the repo; the error lists the GGUF files that are there."""
    matches = match_files(names, pattern)
    if len(matches) == 1:
        return matches[0]
    there = ", ".join(sorted(match_files(names, None))) or "none"
    if not matches:
        wanted = f"no file matches {pattern}" if pattern else "no .gguf file"
        raise ModelError(f"{repo}: {wanted}; its GGUF files are: {there}")
    raise ModelError(
        f"{repo}: {pattern or 'the repo'} names several files ({', '.join(sorted(matches))}); "
        f"pick one with hf:{repo}:QUANT or hf:{repo}:FILE.gguf"
    )


# --- downloading ----------------------------------------------------------------------------------------------------

class _Reporter:
    """Stands in for tqdm in huggingface_hub's http_get (called with total=, initial=, desc=, ...):
    reports bytes and checks the cancel event once per chunk, before the chunk is written."""

    def __init__(self, filename: str, report: ProgressCallback, cancel: threading.Event | None,
                 total: int | None = None, initial: int = 0, **_tqdm_options: Any) -> None:
        self.filename, self.report, self.cancel = filename, report, cancel
        self.total, self.n = total, initial
        report(Progress(filename, initial, total))

    def update(self, n: int = 1) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled(f"download of {self.filename} cancelled after {self.n} bytes; pull again to resume")
        self.n += n
        self.report(Progress(self.filename, self.n, self.total))

    def __enter__(self) -> "_Reporter":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def close(self) -> None:
        return None


def _fetch_blob(repo: str, filename: str, url: str, size: int | None, blob: Path,
                report: ProgressCallback, cancel: threading.Event | None) -> None:
    partial_path = blob.with_name(blob.name + ".incomplete")
    headers = build_hf_headers()
    if urlsplit(url).netloc != urlsplit(constants.ENDPOINT).netloc:
        headers.pop("authorization", None)  # a signed CDN URL: the token must not leave the Hub
    with partial_path.open("ab") as f:
        resume = f.tell()
        if size is not None and resume > size:  # not a prefix of this blob: start over
            f.truncate(0)
            resume = 0
        http_get(url, f, resume_size=resume, headers=headers, expected_size=size, displayed_filename=filename,
                 tqdm_class=partial(_Reporter, filename, report, cancel))  # type: ignore[arg-type]
    os.replace(partial_path, blob)


def download(repo: str, filename: str, *, progress: ProgressCallback | None = None,
             cancel: threading.Event | None = None, offline: bool | None = None) -> Path:
    """Download one file into the HF cache (resuming a partial one) and return its snapshot path.

    `progress` gets byte counts as the file arrives; setting `cancel` stops the
    transfer at the next chunk with `Cancelled`. Offline, only the cache is used.
    """
    report = progress or (lambda _p: None)
    if is_offline(offline):
        cached = {f.filename: f for f in cached_ggufs(repo)}.get(filename)
        if cached is None or cached.path is None:
            raise ModelError(f"{repo}/{filename} is not in the Hugging Face cache ({cache_dir()}) and offline mode is on")
        report(Progress(filename, cached.size or 0, cached.size))
        return cached.path
    if cancel is not None and cancel.is_set():
        raise Cancelled(f"download of {filename} cancelled before it started")
    with hub_errors(repo, filename):
        meta = get_hf_file_metadata(hf_hub_url(repo, filename, endpoint=constants.ENDPOINT), endpoint=constants.ENDPOINT)
        if meta.etag is None or meta.commit_hash is None:
            raise ModelError(f"{constants.ENDPOINT} did not answer like the Hugging Face Hub (no ETag or commit)")
        folder = cache_dir() / repo_folder_name(repo_id=repo, repo_type="model")
        blob = folder / "blobs" / meta.etag
        blob.parent.mkdir(parents=True, exist_ok=True)
        lock = cache_dir() / ".locks" / folder.name / f"{meta.etag}.lock"  # the lock hf_hub_download takes
        lock.parent.mkdir(parents=True, exist_ok=True)
        with WeakFileLock(str(lock)):  # two pulls of one file must not append to one .incomplete
            if blob.exists():
                report(Progress(filename, meta.size or blob.stat().st_size, meta.size))
            else:
                _fetch_blob(repo, filename, meta.location, meta.size, blob, report, cancel)
        # The blob is whole: this only links it into snapshots/<commit>/ and writes refs/main.
        return Path(hf_hub_download(repo, filename, cache_dir=cache_dir(), endpoint=constants.ENDPOINT))


def pull(model: HubModel, *, progress: ProgressCallback | None = None, cancel: threading.Event | None = None,
         offline: bool | None = None) -> StoredModel:
    """Find the model's file, download it, check it is a usable GGUF, and store it under its alias."""
    files = list_ggufs(model.repo, offline)
    if not files and is_offline(offline):
        raise ModelError(f"{model.repo} is not in the Hugging Face cache ({cache_dir()}) and offline mode is on")
    filename = pick_file(model.repo, [f.filename for f in files], model.pattern)
    path = download(model.repo, filename, progress=progress, cancel=cancel, offline=offline)
    info = validate_gguf(path)
    stored = StoredModel(model.alias, path, model.repo, filename, model.quant or info.quantization)
    ModelStore().add(stored)
    return stored
