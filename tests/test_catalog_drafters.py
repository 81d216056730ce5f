"""Catalog models that carry their own drafter: an MTP head inside the target, an EAGLE-3 or a DFlash draft beside it.

The parsing (models.catalog) on small catalogs, malformed entries refused in
one line; the packaged entries; `models pairs` showing how each pair drafts;
`models pull` / resolve of a pair whose target drafts with its own MTP head
fetching and naming the target alone (against the local FakeHub, with a tiny
qwen35 file that carries one head, tests/qwen35_factory.py); and of a DFlash
pair fetching both files and checking that the draft fits its target (tiny
files from tests/dflash_factory.py under the catalog's names).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

import pytest
from hub_server import FakeHub, HubGGUFs
from dflash_factory import DFlashPair, write_dflash_pair
from hub_server import hub, hub_ggufs  # noqa: F401  (fixtures used by name)
from qwen35_factory import write_qwen35_mtp_target

from app.cli import main
from models.catalog import DFLASH, DRAFT, EAGLE3, MTP, CatalogError, Drafter, load_catalog, parse_catalog
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
        "flash": _model("o/big", file="big-DFlash.{quant}.gguf", drafter="dflash"),
        "flash-obj": _model("o/flash", drafter={"kind": "dflash"}),
    },
    "pairs": [
        {"name": "plain", "target": "big", "draft": "small"},
        {"name": "own-head", "target": "headed", "notes": "no draft"},
        {"name": "own-head-said", "target": "headed1", "drafter": "mtp"},
        {"name": "eagle-pair", "target": "big", "draft": "eagle"},
        {"name": "eagle-said", "target": "big", "draft": "small", "drafter": "eagle3"},
        {"name": "head-and-draft", "target": "headed", "draft": "small"},
        {"name": "flash-pair", "target": "big", "draft": "flash"},
        {"name": "flash-said", "target": "big", "draft": "small", "drafter": "dflash"},
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
    assert catalog.by_repo("o/big") is m["big"]  # the model, not the EAGLE-3 or DFlash draft in the same repo


def test_a_dflash_draft_is_a_drafter_kind_of_its_own() -> None:
    """A DFlash draft is a file beside its target like an EAGLE-3 one, and its pair says so."""
    catalog = parse_catalog(BASE)
    m = {x.alias: x for x in catalog.models}
    assert m["flash"].drafter == m["flash-obj"].drafter == Drafter(DFLASH)
    assert m["flash"].is_draft_file and not m["flash"].is_eagle3 and m["flash"].mtp_heads == 0
    assert m["eagle"].is_draft_file and not m["headed"].is_draft_file and not m["big"].is_draft_file
    p = {x.name: x for x in catalog.pairs}
    assert p["flash-pair"].drafter == p["flash-said"].drafter == DFLASH
    assert p["flash-pair"].models == (m["big"], m["flash"])
    assert p["flash-pair"].drafter_label == "DFlash draft"
    assert p["flash-pair"].drafter_note.startswith("DFlash draft (a -md file")
    assert p["flash-pair"].ram_gb() == pytest.approx(4.0 + 0.1 + 1.0 + 0.1 + 0.5)


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
    (lambda d: d["pairs"].append({"name": "x", "target": "big", "draft": "small", "drafter": "medusa"}),
     "catalog pair x: drafter is \"mtp\", \"eagle3\" or \"dflash\", not \"medusa\""),
    (lambda d: d["models"]["flash"].update(drafter={"kind": "dflash", "heads": 1}),
     "catalog model flash: a DFlash draft has no heads"),
    (lambda d: d["pairs"].append({"name": "x", "target": "flash", "draft": "small"}),
     "catalog pair x: its target flash is a DFlash draft, which runs only beside a target"),
    (lambda d: d["pairs"].append({"name": "x", "target": "headed", "drafter": "dflash"}),
     "catalog pair x: a DFlash pair names its draft"),
    (lambda d: d["pairs"].append({"name": "x", "target": "big", "draft": "eagle", "drafter": "dflash"}),
     "catalog pair x: its draft eagle is an EAGLE-3 draft, not a DFlash draft"),
    (lambda d: d["pairs"].append({"name": "x", "target": "big", "draft": "flash", "drafter": "eagle3"}),
     "catalog pair x: its draft flash is a DFlash draft, not an EAGLE-3 draft"),
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
    assert mtp.target.mtp_heads == 1 and mtp.target.thinking.tags == ("<think>", "</think>")
    assert eagle is not None and eagle.drafter == EAGLE3 and eagle.draft is not None and eagle.draft.is_eagle3
    assert eagle.draft.pattern() == "eagle3-gpt-oss-20b-Q8_0.gguf"
    assert eagle.target.pattern() == "gpt-oss-20b-MXFP4.gguf"
    assert catalog.by_repo("ggml-org/gpt-oss-20b-GGUF") is eagle.target


def test_the_packaged_catalog_has_a_dflash_pair() -> None:
    """Qwen3-8B (the catalog's own target) with the DFlash draft published for it as a GGUF (repository and file
    name as public pages give them: AtomicChat/Qwen3-8B-DFlash-GGUF, Qwen3-8B-DFlash.Q8_0.gguf)."""
    catalog = load_catalog()
    pair = catalog.pair("qwen3-dflash")
    assert pair is not None and pair.drafter == DFLASH and pair.draft is not None and pair.draft.is_draft_file
    assert pair.target is catalog.model("qwen3-8b") and pair.draft is catalog.model("qwen3-8b-dflash")
    assert (pair.draft.repo, pair.draft.pattern()) == ("AtomicChat/Qwen3-8B-DFlash-GGUF", "Qwen3-8B-DFlash.Q8_0.gguf")
    assert (pair.target.repo, pair.target.pattern()) == ("Qwen/Qwen3-8B-GGUF", "Qwen3-8B-Q4_K_M.gguf")
    assert catalog.by_repo("AtomicChat/Qwen3-8B-DFlash-GGUF") is pair.draft
    t, d = hub_models("qwen3-dflash")
    assert (t.pattern, d.pattern) == ("Qwen3-8B-Q4_K_M.gguf", "Qwen3-8B-DFlash.Q8_0.gguf")


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
    assert "drafts with: DFlash draft (a -md file" in blocks["qwen3-dflash"]
    assert "  draft  qwen3-8b-dflash " in blocks["qwen3-dflash"]


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


DFLASH_TARGET = ("Qwen/Qwen3-8B-GGUF", "Qwen3-8B-Q4_K_M.gguf")
DFLASH_DRAFT = ("AtomicChat/Qwen3-8B-DFlash-GGUF", "Qwen3-8B-DFlash.Q8_0.gguf")


@pytest.fixture(scope="module")
def dflash_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny llama target and its DFlash draft, and a target of another hidden size that the draft does not fit."""
    d = tmp_path_factory.mktemp("dflash")
    write_dflash_pair(d / "target.gguf", d / "draft.gguf")
    write_dflash_pair(d / "wide-target.gguf", d / "wide-draft.gguf", model=DFlashPair(n_embd=128))
    return {"target": d / "target.gguf", "draft": d / "draft.gguf", "wide": d / "wide-target.gguf"}


def test_pulling_a_dflash_pair_fetches_both_and_checks_the_draft(hub: FakeHub,  # noqa: F811
                                                                 dflash_files: dict[str, Path],
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    hub.add_file(*DFLASH_TARGET, dflash_files["target"])
    hub.add_file(*DFLASH_DRAFT, dflash_files["draft"])
    assert main(["models", "pull", "qwen3-dflash"]) == 0
    assert "compatible: qwen3-8b-dflash can speculate for qwen3-8b" in capsys.readouterr().out
    assert [r.path.rsplit("/", 1)[1] for r in hub.requests if r.method == "GET" and "/resolve/" in r.path] \
        == [DFLASH_TARGET[1], DFLASH_DRAFT[1]]
    assert resolve_model("qwen3-8b-dflash").read_bytes() == dflash_files["draft"].read_bytes()


def test_a_dflash_pair_whose_draft_does_not_fit_its_target_is_refused(hub: FakeHub,  # noqa: F811
                                                                      dflash_files: dict[str, Path],
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    hub.add_file(*DFLASH_TARGET, dflash_files["wide"])  # hidden size 128 under the catalog's name; the draft's is 64
    hub.add_file(*DFLASH_DRAFT, dflash_files["draft"])
    assert main(["models", "pull", "qwen3-dflash"]) == 1
    out = capsys.readouterr().out
    assert "incompatible: qwen3-8b-dflash cannot speculate for qwen3-8b" in out and "hidden size is 64" in out
