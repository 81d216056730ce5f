"""Hub downloads, remote headers and the model store, with the real huggingface_hub client against
tests/hub_server.FakeHub (a local HTTP server; the real Hub is never contacted)."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest
from hub_server import DRAFT_FILE, DRAFT_REPO, GATED_REPO, OTHER_FILE, OTHER_REPO, TARGET_FILE, TARGET_REPO, FakeHub
from hub_server import catalog_hub, hub, hub_ggufs  # noqa: F401  (fixtures used by name)

from app.cli import main
from models import hub as hubmod
from models.compat import check_pair
from models.errors import ModelError
from models.gguf_info import validate_gguf
from models.remote_header import read_remote_header
from models.resolve import hub_models, resolve_model
from models.store import ModelStore, StoredModel


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _one_error_line(err: str) -> str:
    errors = [line for line in err.splitlines() if line.startswith("specchat: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


# --- pull -----------------------------------------------------------------------------------------------------------

def test_pull_one_model_into_the_hf_cache(catalog_hub: FakeHub, capsys, tmp_path: Path) -> None:
    rc, out, err = _cli(capsys, "models", "pull", "qwen2.5-7b-instruct")
    assert rc == 0, err
    path = Path(out.strip().split(": ", 1)[1])
    assert path.is_relative_to(tmp_path / "hf" / "hub" / "models--bartowski--Qwen2.5-7B-Instruct-GGUF")
    assert _sha(path) == catalog_hub.sha256(TARGET_REPO, TARGET_FILE)
    assert "100.0%" in err.splitlines()[-1]
    assert catalog_hub.gets(DRAFT_FILE) == []  # one model, not the pair
    assert resolve_model("qwen2.5-7b-instruct") == path  # usable by alias


def test_pull_a_pair_then_generate_by_alias(catalog_hub: FakeHub, capsys) -> None:
    rc, out, err = _cli(capsys, "models", "pull", "qwen2.5")
    assert rc == 0, err
    for repo, name in ((TARGET_REPO, TARGET_FILE), (DRAFT_REPO, DRAFT_FILE)):
        assert catalog_hub.served[name] == len(catalog_hub.repos[repo][name])
        local = next(p for p in hubmod.cached_ggufs(repo) if p.filename == name)
        assert _sha(local.path) == catalog_hub.sha256(repo, name)
    assert "compatible: qwen2.5-0.5b-instruct can speculate for qwen2.5-7b-instruct" in out
    rc, out, err = _cli(capsys, "run", "the cat", "-m", "qwen2.5-7b-instruct", "-md", "qwen2.5-0.5b-instruct",
                        "-n", "8", "-t", "1", "--json", "--temp", "0")
    assert rc == 0, err
    assert json.loads(out.splitlines()[-1])["stats"]["generated_tokens"] == 8


def test_progress_reaches_100_percent(catalog_hub: FakeHub) -> None:
    seen: list[hubmod.Progress] = []
    (model,) = hub_models("qwen2.5-7b-instruct")
    stored = hubmod.pull(model, progress=seen.append)
    size = len(catalog_hub.repos[TARGET_REPO][TARGET_FILE])
    assert len(seen) > 10  # 64 KB chunks of a 6.6 MB file
    assert [p.done for p in seen] == sorted(p.done for p in seen)
    assert seen[-1].done == seen[-1].total == size and seen[-1].fraction == 1.0
    assert stored.path.stat().st_size == size and stored.file == TARGET_FILE and stored.quant == "Q4_K_M"


def test_dropped_connection_resumes_with_a_range_request(catalog_hub: FakeHub, capsys) -> None:
    size = len(catalog_hub.repos[TARGET_REPO][TARGET_FILE])
    catalog_hub.cut[TARGET_FILE] = size // 2
    rc, out, err = _cli(capsys, "models", "pull", "qwen2.5-7b-instruct")
    assert rc == 0, err
    first, second = catalog_hub.gets(TARGET_FILE)
    assert first.range is None
    offset = int(second.range.removeprefix("bytes=").rstrip("-"))
    assert 0 < offset <= size // 2
    assert catalog_hub.served[TARGET_FILE] < size + size // 2  # the first half is not fetched twice
    assert _sha(resolve_model("qwen2.5-7b-instruct")) == catalog_hub.sha256(TARGET_REPO, TARGET_FILE)


def test_cancelled_download_keeps_its_part_and_the_next_pull_resumes(catalog_hub: FakeHub, capsys) -> None:
    size = len(catalog_hub.repos[TARGET_REPO][TARGET_FILE])
    cancel = threading.Event()

    def progress(p: hubmod.Progress) -> None:
        if p.done >= size // 3:
            cancel.set()

    (model,) = hub_models("qwen2.5-7b-instruct")
    with pytest.raises(hubmod.Cancelled, match="pull again to resume"):
        hubmod.pull(model, progress=progress, cancel=cancel)
    (part,) = (hubmod.cache_dir()).rglob("*.incomplete")
    kept = part.stat().st_size
    assert size // 3 <= kept < size
    assert hubmod.cached_ggufs(TARGET_REPO) == ()  # nothing half-done is visible as a model
    rc, out, err = _cli(capsys, "models", "pull", "qwen2.5-7b-instruct")
    assert rc == 0, err
    assert catalog_hub.gets(TARGET_FILE)[-1].range == f"bytes={kept}-"
    assert _sha(resolve_model("qwen2.5-7b-instruct")) == catalog_hub.sha256(TARGET_REPO, TARGET_FILE)
    assert not part.exists()


def test_pull_of_a_cached_file_downloads_nothing(catalog_hub: FakeHub, capsys) -> None:
    assert _cli(capsys, "models", "pull", "qwen2.5-0.5b-instruct")[0] == 0
    served = catalog_hub.served[DRAFT_FILE]
    rc, out, err = _cli(capsys, "models", "pull", "qwen2.5-0.5b-instruct")
    assert rc == 0 and catalog_hub.served[DRAFT_FILE] == served and "100.0%" in err


# --- remote headers: check before download --------------------------------------------------------------------------

def _assert_header_only(hub: FakeHub, *files: tuple[str, str]) -> None:
    for repo, name in files:
        assert 0 < hub.served[name] < len(hub.repos[repo][name]) / 4, name
    hub.served.clear()


def test_remote_check_reads_only_the_header_and_agrees_with_the_local_check(catalog_hub: FakeHub, capsys) -> None:
    rc, out, err = _cli(capsys, "models", "check", "qwen2.5-7b-instruct", "qwen2.5-0.5b-instruct")
    assert rc == 0, err
    assert "compatible: qwen2.5-0.5b-instruct can speculate for qwen2.5-7b-instruct" in out
    _assert_header_only(catalog_hub, (TARGET_REPO, TARGET_FILE), (DRAFT_REPO, DRAFT_FILE))
    rc, out_bad, err = _cli(capsys, "models", "check", "qwen2.5-7b-instruct", f"hf:{OTHER_REPO}")
    assert rc == 1, err
    _assert_header_only(catalog_hub, (TARGET_REPO, TARGET_FILE), (OTHER_REPO, OTHER_FILE))
    assert hubmod.cached_ggufs() == ()  # nothing was downloaded
    # The same verdicts from the whole files:
    assert _cli(capsys, "models", "pull", "qwen2.5")[0] == 0
    assert _cli(capsys, "models", "pull", f"hf:{OTHER_REPO}")[0] == 0
    target, draft = validate_gguf(resolve_model("qwen2.5-7b-instruct")), validate_gguf(resolve_model("qwen2.5-0.5b-instruct"))
    other = validate_gguf(resolve_model(f"hf:{OTHER_REPO}"))
    assert check_pair(target, draft).ok
    local_problems = check_pair(target, other).problems
    assert local_problems and all(f"  - {p}" in out_bad for p in local_problems)
    rc, out_local, _ = _cli(capsys, "models", "check", "qwen2.5-7b-instruct", f"hf:{OTHER_REPO}")
    assert rc == 1 and out_local.count("tokens; local)") == 2
    assert out_local.splitlines()[-len(local_problems):] == out_bad.splitlines()[-len(local_problems):]


def test_remote_header_grows_its_range_until_the_header_fits(catalog_hub: FakeHub, hub_ggufs) -> None:
    remote = read_remote_header(TARGET_REPO, TARGET_FILE, first_bytes=256)
    ranges = [r.range for r in catalog_hub.gets(TARGET_FILE)]
    assert ranges[0] == "bytes=0-255" and len(ranges) > 3
    starts = [int(r.removeprefix("bytes=").split("-")[0]) for r in ranges]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)  # each request continues the last
    local = validate_gguf(hub_ggufs.target)
    assert remote.size == local.size_bytes and remote.bytes_read < 4 * 9120 + 256
    assert remote.info.tokens == local.tokens
    assert {k: v for k, v in remote.info.summary().items() if k != "path"} == \
        {k: v for k, v in local.summary().items() if k != "path"}


# --- errors: one line, exit 1 ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("ref, expected", [
    ("hf:nobody/nothing-GGUF", "nobody/nothing-GGUF: no such repo on the Hugging Face Hub"),
    (f"hf:{GATED_REPO}", f"{GATED_REPO} is a gated repo: accept its terms on the Hub, then log in with `hf auth login`"),
    ("qwen2.5-7b-instruct:Q2_K", f"{TARGET_REPO}: no file matches Qwen2.5-7B-Instruct-Q2_K.gguf; its GGUF files are: "
                                  f"{TARGET_FILE}, Qwen2.5-7B-Instruct-Q8_0.gguf"),
    (f"hf:{TARGET_REPO}:IQ1_S", f"no file matches *IQ1_S*.gguf; its GGUF files are: {TARGET_FILE}"),
    ("no-such-alias", "not a catalog pair or model"),
])
def test_pull_errors_are_one_clear_line(catalog_hub: FakeHub, capsys, ref: str, expected: str) -> None:
    rc, out, err = _cli(capsys, "models", "pull", ref)
    assert rc == 1 and expected in _one_error_line(err)


def test_missing_file_on_the_hub(catalog_hub: FakeHub) -> None:
    with pytest.raises(ModelError, match=f"^{TARGET_REPO}: the repo has no file nope.gguf$"):
        hubmod.download(TARGET_REPO, "nope.gguf")


def test_server_error(catalog_hub: FakeHub, capsys) -> None:
    catalog_hub.fail_status = 500
    rc, out, err = _cli(capsys, "models", "pull", "qwen2.5-7b-instruct")
    assert rc == 1 and "answered 500 (server error); try again later" in _one_error_line(err)
    rc, out, err = _cli(capsys, "models", "check", "qwen2.5-7b-instruct", "qwen2.5-0.5b-instruct")
    assert rc == 1 and "server error" in _one_error_line(err)


def test_no_network(catalog_hub: FakeHub, capsys) -> None:
    catalog_hub.stop()
    rc, out, err = _cli(capsys, "models", "info", "qwen2.5-7b-instruct")
    assert rc == 1 and "cannot reach the Hugging Face Hub" in _one_error_line(err)


def test_disk_full_keeps_the_partial_download(catalog_hub: FakeHub, monkeypatch) -> None:
    import errno

    limit = 1 << 20
    real_http_get = hubmod.http_get

    class FullDisk:
        """The cache's file system fills up after `limit` bytes."""

        def __init__(self, f) -> None:
            self.f = f

        def write(self, data: bytes) -> int:
            if self.f.tell() + len(data) > limit:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def __getattr__(self, name: str):
            return getattr(self.f, name)

    monkeypatch.setattr(hubmod, "http_get", lambda url, f, **kw: real_http_get(url, FullDisk(f), **kw))
    with pytest.raises(ModelError, match=r"disk full while downloading .* \(the partial download is kept and resumes\)$"):
        hubmod.download(TARGET_REPO, TARGET_FILE)
    (part,) = hubmod.cache_dir().rglob("*.incomplete")
    assert 0 < part.stat().st_size <= limit


# --- offline ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["flag", "env"])
def test_offline_uses_the_cache_only(catalog_hub: FakeHub, capsys, monkeypatch, how: str) -> None:
    from huggingface_hub import constants

    assert _cli(capsys, "models", "pull", "qwen2.5-7b-instruct")[0] == 0
    path = resolve_model("qwen2.5-7b-instruct")
    catalog_hub.fail_status = 500  # any request would fail now
    before = len(catalog_hub.requests)
    flag = ["--offline"] if how == "flag" else []
    if how == "env":
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    rc, out, err = _cli(capsys, "models", "pull", "qwen2.5-7b-instruct", *flag)
    assert rc == 0 and out.strip() == f"qwen2.5-7b-instruct: {path}", err
    rc, out, err = _cli(capsys, "models", "pull", "qwen2.5-0.5b-instruct", *flag)
    assert rc == 1 and "is not in the Hugging Face cache" in _one_error_line(err) and "offline" in err
    assert len(catalog_hub.requests) == before


def test_not_pulled_alias_suggests_pull(catalog_hub: FakeHub, capsys, hub_ggufs) -> None:
    rc, out, err = _cli(capsys, "run", "hi", "-m", "qwen3-8b", "-s", "ar")
    assert rc == 1 and "qwen3-8b is not downloaded yet: run `specchat models pull qwen3-8b`" in _one_error_line(err)
    rc, out, err = _cli(capsys, "run", "hi", "-m", f"hf:{OTHER_REPO}", "-s", "ar")
    assert rc == 1 and f"run `specchat models pull hf:{OTHER_REPO}`" in _one_error_line(err)
    assert catalog_hub.requests == []  # resolving is offline-safe: the cache only


# --- the store ------------------------------------------------------------------------------------------------------

def test_store_writes_atomically_and_resolves_aliases(tmp_path: Path, monkeypatch, hub_ggufs) -> None:
    monkeypatch.setenv("SPECCHAT_DATA_DIR", str(tmp_path))
    store = ModelStore()
    store.add(StoredModel("mine", hub_ggufs.small, quant="F32"))
    store.add(StoredModel("theirs", hub_ggufs.target, repo="a/b", file="t.gguf"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models.json"]  # no temporary file left behind
    data = json.loads((tmp_path / "models.json").read_text())
    assert data["models"]["mine"]["path"] == str(hub_ggufs.small)
    assert resolve_model("mine") == hub_ggufs.small and resolve_model("theirs") == hub_ggufs.target
    assert ModelStore().get("theirs") == StoredModel("theirs", hub_ggufs.target, repo="a/b", file="t.gguf")
    assert store.remove("mine") and ModelStore().get("mine") is None


def test_store_survives_a_corrupt_file(tmp_path: Path, monkeypatch, hub_ggufs) -> None:
    monkeypatch.setenv("SPECCHAT_DATA_DIR", str(tmp_path))
    (tmp_path / "models.json").write_text('{"models": {"x": ')
    store = ModelStore()
    assert store.all() == {} and "corrupt" in store.warning
    store.add(StoredModel("mine", hub_ggufs.small))
    assert (tmp_path / "models.json.corrupt").read_text() == '{"models": {"x": '
    assert ModelStore().get("mine").path == hub_ggufs.small and store.warning is None


def test_pick_file_lists_what_is_there() -> None:
    names = ["README.md", "m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "m-q8_0.gguf"]
    assert hubmod.pick_file("o/r", names, "M-Q8_0.GGUF") == "m-q8_0.gguf"  # case-insensitive
    with pytest.raises(ModelError, match=r"names several files \(m-Q4_K_M.gguf, m-Q4_K_S.gguf\)"):
        hubmod.pick_file("o/r", names, "*Q4_K*.gguf")
    with pytest.raises(ModelError, match=r"its GGUF files are: m-Q4_K_M.gguf, m-Q4_K_S.gguf, m-q8_0.gguf$"):
        hubmod.pick_file("o/r", names, "*Q2_K*.gguf")
