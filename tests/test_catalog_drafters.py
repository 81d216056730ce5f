"""Catalog models that carry their own drafter: an MTP head inside the target, an EAGLE-3 draft beside it.

The parsing (models.catalog) on small catalogs, malformed entries refused in
one line; the packaged entries; `models pairs` showing how each pair drafts;
and `models pull` / resolve of a pair whose target drafts with its own MTP
head fetching and naming the target alone (against the local FakeHub, with a
tiny qwen35 file that carries one head, tests/qwen35_factory.py).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

import pytest
from hub_server import FakeHub, HubGGUFs
from hub_server import hub, hub_ggufs  # noqa: F401  (fixtures used by name)
from qwen35_factory import write_qwen35_mtp_target

from app.cli import main
from models.catalog import DRAFT, EAGLE3, MTP, CatalogError, Drafter, load_catalog, parse_catalog
from models.errors import ModelError
from models.resolve import hub_models, resolve_model, single_hub_model


def _model(repo: str, **extra: Any) -> dict[str, Any]:
    return {"repo": repo, "file": "m-{quant}.gguf", "default_quant": "Q8_0", "sizes_gb": {"Q8_0": 1.0},
            "kv_gb": 0.1, **extra}


BASE: dict[str, Any] = {
    "models": {
        "big": _model("o/big", sizes_gb={"Q8_0": 4.0}),
        "small": _model("o/small"),
        "headed": _model("o/headed", drafter={"kind": "mtp", "heads": 2}),
        "headed1": _model("o/headed1", drafter="mtp"),
        "eagle": _model("o/big", file="eagle3-big-{quant}.gguf", drafter="eagle3"),
        "eagle-obj": _model("o/eagle", drafter={"kind": "eagle3"}),
    },
    "pairs": [
        {"name": "plain", "target": "big", "draft": "small"},
        {"name": "own-head", "target": "headed", "notes": "no draft"},
        {"name": "own-head-said", "target": "headed1", "drafter": "mtp"},
        {"name": "eagle-pair", "target": "big", "draft": "eagle"},
        {"name": "eagle-said", "target": "big", "draft": "small", "drafter": "eagle3"},
        {"name": "head-and-draft", "target": "headed", "draft": "small"},
    ],
}


def test_the_new_shapes_parse() -> None:
    catalog = parse_catalog(BASE)
    m = {x.alias: x for x in catalog.models}
    assert m["headed"].drafter == Drafter(MTP, 2) and m["headed"].mtp_heads == 2
    assert m["headed1"].drafter == Drafter(MTP, 1)
    assert m["eagle"].is_eagle3 and m["eagle-obj"].is_eagle3 and m["eagle"].mtp_heads == 0
    assert m["big"].drafter is None
    p = {x.name: x for x in catalog.pairs}
    assert (p["plain"].drafter, p["plain"].drafter_label) == (DRAFT, "")
    assert p["own-head"].draft is None and p["own-head"].models == (m["headed"],)
    assert p["own-head"].drafter == p["own-head-said"].drafter == MTP
    assert "MTP head inside the target (2 layers" in p["own-head"].drafter_note
    assert p["own-head"].ram_gb() == pytest.approx(1.0 + 0.1 + 0.5)  # the target alone, plus the overhead
    assert p["eagle-pair"].drafter == p["eagle-said"].drafter == EAGLE3
    assert p["eagle-pair"].drafter_label == "EAGLE-3 draft"
    assert p["head-and-draft"].drafter == DRAFT and p["head-and-draft"].models == (m["headed"], m["small"])
    assert catalog.by_repo("o/big") is m["big"]  # the model, not the EAGLE-3 draft in the same repo


def _edit(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    data = copy.deepcopy(BASE)
    change(data)
    return data


MALFORMED: list[tuple[Callable[[dict[str, Any]], None], str]] = [
    (lambda d: d["models"]["headed"].update(drafter="medusa"), "catalog model headed: drafter is \"eagle3\""),
    (lambda d: d["models"]["headed"].update(drafter={"kind": "mtp", "heads": 0}),
     "catalog model headed: an MTP drafter's heads is a whole number from 1, not 0"),
    (lambda d: d["models"]["headed"].update(drafter={"kind": "mtp", "heads": "2"}), "heads is a whole number"),
    (lambda d: d["models"]["eagle"].update(drafter={"kind": "eagle3", "heads": 1}),
     "catalog model eagle: an EAGLE-3 draft has no heads"),
    (lambda d: d["models"]["headed"].update(drafter={"kind": "mtp", "layers": 1}), "unknown drafter field(s) layers"),
    (lambda d: d["models"]["big"].pop("repo"), "catalog model big: missing repo"),
    (lambda d: d["models"]["big"].update(sizes_gb={"Q8_0": "4 GB"}), "catalog model big: sizes_gb maps"),
    (lambda d: d["pairs"].append({"name": "orphan", "target": "big"}),
     "catalog pair orphan: no draft, and its target big carries no MTP head"),
    (lambda d: d["pairs"].append({"name": "x", "target": "headed", "draft": "small", "drafter": "mtp"}),
     "catalog pair x: it drafts with the target's MTP head, so it names no draft"),
    (lambda d: d["pairs"].append({"name": "x", "target": "headed", "drafter": "eagle3"}),
     "catalog pair x: an EAGLE-3 pair names its draft"),
    (lambda d: d["pairs"].append({"name": "x", "target": "big", "draft": "headed", "drafter": "eagle3"}),
     "catalog pair x: its draft headed carries an MTP head, not an EAGLE-3 draft"),
    (lambda d: d["pairs"].append({"name": "x", "target": "eagle", "draft": "small"}),
     "catalog pair x: its target eagle is an EAGLE-3 draft"),
    (lambda d: d["pairs"].append({"name": "x", "target": "big", "draft": "nope"}),
     "catalog pair x: its draft 'nope' is not a catalog model"),
    (lambda d: d["pairs"].append({"name": "x", "target": "nope", "draft": "small"}),
     "catalog pair x: its target 'nope' is not a catalog model"),
    (lambda d: d["pairs"].append({"name": "x", "draft": "small"}), "catalog pair x: needs a target"),
    (lambda d: d["pairs"].append({"name": "x", "target": "big", "draft": "small", "drafter": "dflash"}),
     "catalog pair x: drafter is \"mtp\" or \"eagle3\", not \"dflash\""),
    (lambda d: d["pairs"].append({"target": "big"}), "needs a name"),
    (lambda d: d["pairs"].append({"name": "plain", "target": "headed"}), "catalog pair names used twice: ['plain']"),
    (lambda d: d.pop("pairs"), "the catalog is an object with \"models\""),
]


@pytest.mark.parametrize(("change", "expected"), MALFORMED)
def test_a_malformed_entry_is_refused_in_one_clear_line(change: Callable[[dict[str, Any]], None],
                                                         expected: str) -> None:
    with pytest.raises(CatalogError) as e:
        parse_catalog(_edit(change))
    message = str(e.value)
    assert expected in message and "\n" not in message


def test_the_packaged_catalog_has_an_mtp_pair_and_an_eagle3_pair() -> None:
    catalog = load_catalog()
    mtp, eagle = catalog.pair("qwen3.5-mtp"), catalog.pair("gpt-oss-eagle3")
    assert mtp is not None and mtp.drafter == MTP and mtp.draft is None
    assert mtp.target.repo == "unsloth/Qwen3.5-4B-MTP-GGUF" and mtp.target.pattern() == "Qwen3.5-4B-Q4_K_M.gguf"
    assert mtp.target.mtp_heads == 1 and mtp.target.thinking == ("<think>", "</think>")
    assert eagle is not None and eagle.drafter == EAGLE3 and eagle.draft is not None and eagle.draft.is_eagle3
    assert eagle.draft.pattern() == "eagle3-gpt-oss-20b-Q8_0.gguf"
    assert eagle.target.pattern() == "gpt-oss-20b-MXFP4.gguf"
    assert catalog.by_repo("ggml-org/gpt-oss-20b-GGUF") is eagle.target


def test_an_mtp_pair_names_its_target_alone_and_an_eagle3_pair_both() -> None:
    (target,) = hub_models("qwen3.5-mtp")
    assert (target.alias, target.repo, target.pattern) == \
        ("qwen3.5-4b-mtp", "unsloth/Qwen3.5-4B-MTP-GGUF", "Qwen3.5-4B-Q4_K_M.gguf")
    assert single_hub_model("qwen3.5-mtp") == target  # so `-m qwen3.5-mtp` resolves to the target's file
    t, d = hub_models("gpt-oss-eagle3")
    assert (t.pattern, d.pattern) == ("gpt-oss-20b-MXFP4.gguf", "eagle3-gpt-oss-20b-Q8_0.gguf")
    with pytest.raises(ModelError, match="is a pair"):
        single_hub_model("gpt-oss-eagle3")


def test_models_pairs_says_how_each_pair_drafts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "pairs"]) == 0
    blocks = {b.split(":")[0]: b for b in capsys.readouterr().out.split("\n\n")}
    assert "drafts with: MTP head inside the target (1 layer; no draft file)" in blocks["qwen3.5-mtp"]
    assert "  draft " not in blocks["qwen3.5-mtp"]  # nothing else to pull
    assert "drafts with: EAGLE-3 draft" in blocks["gpt-oss-eagle3"]
    assert "  draft  gpt-oss-20b-eagle3 " in blocks["gpt-oss-eagle3"]
    assert "drafts with: draft model" in blocks["qwen2.5"]


MTP_REPO, MTP_FILE = "unsloth/Qwen3.5-4B-MTP-GGUF", "Qwen3.5-4B-Q4_K_M.gguf"


@pytest.fixture(scope="module")
def headed_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen35_mtp_target(tmp_path_factory.mktemp("qwen35") / "headed.gguf")


def test_pulling_an_mtp_pair_fetches_the_target_alone(hub: FakeHub, headed_file: Path,  # noqa: F811
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    hub.add_file(MTP_REPO, MTP_FILE, headed_file)
    hub.add(MTP_REPO, "Qwen3.5-4B-UD-Q5_K_XL.gguf", b"not fetched")
    assert main(["models", "pull", "qwen3.5-mtp"]) == 0
    out = capsys.readouterr().out
    assert "compatible: qwen3.5-4b-mtp drafts with its own MTP head (1 layer)" in out
    assert [r.path.rsplit("/", 1)[1] for r in hub.requests if r.method == "GET" and "/resolve/" in r.path] \
        == [MTP_FILE]
    assert resolve_model("qwen3.5-mtp") == resolve_model("qwen3.5-4b-mtp")
    assert resolve_model("qwen3.5-mtp").read_bytes() == headed_file.read_bytes()


def test_an_mtp_pair_whose_file_has_no_head_is_refused(hub: FakeHub, hub_ggufs: HubGGUFs,  # noqa: F811
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    hub.add_file(MTP_REPO, MTP_FILE, hub_ggufs.target)  # a llama file with no NextN layers, under the catalog's name
    assert main(["models", "pull", "qwen3.5-mtp"]) == 1
    assert "incompatible: qwen3.5-4b-mtp carries no MTP head" in capsys.readouterr().out
