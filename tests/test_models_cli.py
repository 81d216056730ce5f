"""`specchat models list | pairs | info | check | derive` output, against FakeHub and local tiny GGUFs."""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path

import pytest
from hub_server import OTHER_REPO, FakeHub
from hub_server import catalog_hub, hub, hub_ggufs  # noqa: F401  (fixtures used by name)

from app.cli import main
from backends.llama import LlamaModel
from models.catalog import RUNTIME_OVERHEAD_GB
from models.compat import check_pair
from models.gguf_info import validate_gguf
from models.resolve import resolve_model
from models.store import ModelStore


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def test_pairs_lists_the_packaged_catalog_with_sizes_and_ram(capsys) -> None:
    raw = json.loads(resources.files("models").joinpath("catalog.json").read_text())
    rc, out, err = _cli(capsys, "models", "pairs")
    assert rc == 0, err
    assert len(raw["pairs"]) == 8
    for pair in raw["pairs"]:
        roles = [(raw["models"][pair[role]], pair[role]) for role in ("target", "draft") if pair.get(role)]
        ram = sum(m["sizes_gb"][m["default_quant"]] + m["kv_gb"] for m, _alias in roles)
        assert f"{pair['name']}: ~{ram + RUNTIME_OVERHEAD_GB:.1f} GB RAM" in out
        for m, alias in roles:
            line = next(line for line in out.splitlines()
                        if line.startswith(("  target ", "  draft ")) and f" {alias} " in line)
            assert m["repo"] in line and m["default_quant"] in line
            assert f"{m['sizes_gb'][m['default_quant']]:.2f} GB" in line
        if len(roles) == 2:
            (t, _), (d, _) = roles
            assert t["sizes_gb"][t["default_quant"]] > d["sizes_gb"][d["default_quant"]]  # drafts are the small ones


def test_list_shows_local_models_and_which_pair(catalog_hub: FakeHub, capsys, hub_ggufs) -> None:
    rc, out, err = _cli(capsys, "models", "list")
    assert rc == 0 and "no local models yet" in out
    assert _cli(capsys, "models", "pull", "qwen2.5")[0] == 0
    assert _cli(capsys, "models", "pull", f"hf:{OTHER_REPO}")[0] == 0
    rc, out, err = _cli(capsys, "models", "list")
    assert rc == 0, err
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:4]}
    assert set(rows) == {"qwen2.5-7b-instruct", "qwen2.5-0.5b-instruct", f"hf:{OTHER_REPO}"}
    for name, source in (("qwen2.5-7b-instruct", hub_ggufs.target), ("qwen2.5-0.5b-instruct", hub_ggufs.draft)):
        size_mb = f"{source.stat().st_size / 1e6:.2f}"
        assert rows[name][1:5] == [size_mb, "MB", "llama", "F32"]
    pairs = out.split("pairs (target <- drafts that can speculate for it):")[1].split()
    assert pairs == ["qwen2.5-7b-instruct", "<-", "qwen2.5-0.5b-instruct"]  # the other vocabulary pairs with none


def test_info_reads_a_remote_header_then_the_local_file(catalog_hub: FakeHub, capsys, hub_ggufs) -> None:
    expected = validate_gguf(hub_ggufs.target)
    rc, out, err = _cli(capsys, "models", "info", "qwen2.5-7b-instruct")
    assert rc == 0, err
    fields = dict(line.split(": ", 1) for line in out.splitlines())
    assert fields["architecture"] == "llama" and fields["quantization"] == "F32"
    assert fields["vocab_size"] == str(expected.vocab_size) and fields["n_params"] == str(expected.n_params)
    read, total = map(int, re.fullmatch(r"remote header: read (\d+) of (\d+) bytes", fields["source"]).groups())
    assert total == hub_ggufs.target.stat().st_size and read < total / 4
    assert _cli(capsys, "models", "pull", "qwen2.5-7b-instruct")[0] == 0
    rc, out, err = _cli(capsys, "models", "info", "qwen2.5-7b-instruct", "--json")
    data = json.loads(out)
    assert data["source"] == "local" and data["path"] == str(resolve_model("qwen2.5-7b-instruct").resolve())
    assert {k: v for k, v in data.items() if k not in ("source", "path", "drafters")} == \
        {k: v for k, v in expected.summary().items() if k != "path"}
    assert data["drafters"] == "none"


def test_check_local_files(tmp_path: Path, monkeypatch, capsys, hub_ggufs) -> None:
    monkeypatch.setenv("SPECCHAT_DATA_DIR", str(tmp_path))  # an empty store, not the user's
    rc, out, err = _cli(capsys, "models", "check", str(hub_ggufs.target), str(hub_ggufs.draft))
    assert rc == 0 and out.splitlines()[-1].startswith("compatible:")
    rc, out, err = _cli(capsys, "models", "check", str(hub_ggufs.target), str(hub_ggufs.other))
    assert rc == 1 and "incompatible:" in out and "  - token 259 differs" in out


def test_pull_progress_on_a_pipe_is_a_few_lines(catalog_hub: FakeHub, capsys) -> None:
    rc, out, err = _cli(capsys, "models", "pull", "qwen2.5-7b-instruct")
    lines = err.splitlines()
    assert rc == 0 and lines[0].startswith("pulling qwen2.5-7b-instruct from ")
    percents = [float(re.search(r"([\d.]+)%$", line)[1]) for line in lines[1:]]
    assert 3 <= len(percents) <= 11 and percents == sorted(percents) and percents[-1] == 100.0


def test_derive_a_self_draft_from_a_tiny_model(tmp_path: Path, monkeypatch, capsys, hub_ggufs) -> None:
    monkeypatch.setenv("SPECCHAT_DATA_DIR", str(tmp_path))
    rc, out, err = _cli(capsys, "models", "derive", str(hub_ggufs.target), "Q8_0")
    assert rc == 0, err
    out_path = tmp_path / "derived" / "target-Q8_0.gguf"
    source, derived = validate_gguf(hub_ggufs.target), validate_gguf(out_path)
    assert derived.quantization == "Q8_0" and derived.size_bytes < source.size_bytes / 3
    assert check_pair(source, derived).ok and "compatible: target-q8_0 can speculate for" in out
    assert ModelStore().get("target-q8_0").derived_from == str(hub_ggufs.target)
    assert resolve_model("target-q8_0") == out_path.resolve()
    model = LlamaModel(out_path)
    assert model.tokenize("the cat sat") == LlamaModel(hub_ggufs.target).tokenize("the cat sat")
    rc, out, err = _cli(capsys, "models", "derive", str(hub_ggufs.target), "Q9_X")
    assert rc == 1 and "unknown quantization 'Q9_X'" in err


@pytest.mark.demo
def test_derive_demo_q4_0_loads_and_pairs_with_its_source(demo_pair, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr("models.store.data_dir", lambda: tmp_path)  # `demo` stays the real pair; the store is a copy
    out_path = tmp_path / "demo-Q4_0.gguf"
    rc, out, err = _cli(capsys, "models", "derive", "demo", "Q4_0", "-o", str(out_path))
    assert rc == 0, err
    source, derived = validate_gguf(demo_pair.target), validate_gguf(out_path)
    assert derived.quantization == "Q4_0" and derived.size_bytes < source.size_bytes / 4
    assert check_pair(source, derived).ok and "compatible: demo-q4_0 can speculate for demo" in out
    assert ModelStore().get("demo-q4_0").path == out_path.resolve()
    assert LlamaModel(out_path).tokenize("Once upon a time") == LlamaModel(demo_pair.draft).tokenize("Once upon a time")
