"""The GGUF header of a file on the Hugging Face Hub, read with HTTP Range requests.

A GGUF file starts with its metadata (vocabulary included) and tensor table;
the weights follow (GGUF spec: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md).
So `check_pair` can run on a 5 GB model after reading a few megabytes:
first 1 MB, then the file's next bytes doubling what is held each time
models.gguf_header says it needs more (Gemma 3's 262k-token vocabulary takes
about 6 MB), up to a cap. Requests go through huggingface_hub's session and
headers (token, user agent) to `hf_hub_url`; the Hub redirects to its CDN and
the session follows (httpx drops the Authorization header across origins).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import constants, hf_hub_url
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

from models.errors import ModelError
from models.gguf_header import HeaderError, NeedMoreData, parse_header
from models.gguf_info import GGUFInfo, info_from_header
from models.hub import HubModel, hub_errors, is_offline, list_ggufs, pick_file

FIRST_BYTES = 1 << 20
MAX_BYTES = 64 << 20


@dataclass(frozen=True)
class RemoteHeader:
    info: GGUFInfo
    bytes_read: int  # what was transferred, for the caller to show (and tests to count)
    size: int  # the whole file


def _read_range(url: str, headers: dict[str, str], start: int, end: int) -> tuple[bytes, int]:
    """Bytes start..end (inclusive) of the file and the file's total size."""
    with get_session().stream("GET", url, headers={**headers, "Range": f"bytes={start}-{end}"}) as r:
        if r.status_code >= 400:
            r.read()  # the error's body, for hf_raise_for_status's message
            hf_raise_for_status(r)
        if r.status_code == 206:
            total = int(r.headers["Content-Range"].rsplit("/", 1)[1])
            return r.read(), total
        # 200: the server ignored the Range; read only as far as needed, never the whole file.
        got = bytearray()
        for chunk in r.iter_bytes():
            got += chunk
            if len(got) > end:
                break
        total = int(r.headers.get("Content-Length", len(got)))
        return bytes(got[start : end + 1]), total


def read_remote_header(repo: str, filename: str, *, revision: str | None = None,
                       first_bytes: int = FIRST_BYTES, max_bytes: int = MAX_BYTES) -> RemoteHeader:
    """Parse the header of `filename` in `repo` without downloading the weights."""
    where = f"hf:{repo}/{filename}"
    url = hf_hub_url(repo, filename, revision=revision, endpoint=constants.ENDPOINT)
    headers = build_hf_headers()
    held = bytearray()
    want = first_bytes
    with hub_errors(repo, filename):
        while True:
            chunk, size = _read_range(url, headers, len(held), want - 1)
            held += chunk
            try:
                header = parse_header(held)
                break
            except NeedMoreData:
                if len(held) >= size:
                    raise ModelError(f"{where}: truncated GGUF (the file ends inside its header)") from None
                if want >= max_bytes:
                    raise ModelError(f"{where}: GGUF header larger than {max_bytes >> 20} MB") from None
                want = min(want * 2, max_bytes)
            except HeaderError as e:
                raise ModelError(f"{where}: {e}") from None
    # A Path keeps GGUFInfo's type; its name is the file name, as in messages about local files.
    return RemoteHeader(info_from_header(Path(where), header, size), len(held), size)


def remote_model_header(model: HubModel, offline: bool | None = None) -> RemoteHeader:
    """The header of a catalog or hf: model that is not downloaded: list the repo, pick the file, read its start."""
    if is_offline(offline):
        raise ModelError(f"{model.alias} is not downloaded and offline mode is on: cannot read its header")
    filename = pick_file(model.repo, [f.filename for f in list_ggufs(model.repo, offline=False)], model.pattern)
    return read_remote_header(model.repo, filename)
