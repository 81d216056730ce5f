"""What `specchat models info` and `models check` say about drafters a file carries or is (models.drafters),
on the tiny MTP target (tests/drafter_factory.py) and EAGLE-3 pair (tests/eagle3_factory.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.cli import main
from drafter_factory import write_mtp_target
from eagle3_factory import write_eagle3_pair
from gguf_factory import write_llama_gguf
from models.drafters import describe_drafters, mtp_heads
from models.gguf_info import validate_gguf


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("drafters")
    write_eagle3_pair(d / "eagle3-target.gguf", d / "eagle3-draft.gguf")
    return {"mtp": write_mtp_target(d / "mtp-target.gguf"), "plain": write_llama_gguf(d / "plain.gguf"),
            "eagle3_target": d / "eagle3-target.gguf", "eagle3_draft": d / "eagle3-draft.gguf"}


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    rc = main(list(args))
    return rc, capsys.readouterr().out


def test_info_counts_the_mtp_heads(files, capsys) -> None:
    rc, out = _cli(capsys, "models", "info", str(files["mtp"]), "--json")
    data = json.loads(out)
    assert rc == 0 and data["mtp_heads"] == 1 and data["drafters"].startswith("MTP heads: 1")
    rc, out = _cli(capsys, "models", "info", str(files["plain"]))
    assert rc == 0 and "drafters: none" in out and "mtp_heads: 0" in out


def test_info_describes_an_eagle3_draft(files, capsys) -> None:
    rc, out = _cli(capsys, "models", "info", str(files["eagle3_draft"]), "--json")
    data = json.loads(out)
    assert rc == 0 and data["architecture"] == "eagle3"
    assert data["eagle3_target_layers"] == [1, 2, 3] and data["eagle3_target_hidden_size"] == 64
    assert data["drafters"].startswith("EAGLE-3 draft for target layers [1, 2, 3], hidden size 64")


def test_check_takes_an_eagle3_draft_for_its_target_and_refuses_it_for_another(files, capsys) -> None:
    rc, out = _cli(capsys, "models", "check", str(files["eagle3_target"]), str(files["eagle3_draft"]))
    assert rc == 0 and out.splitlines()[-1].startswith("compatible:")
    # The MTP target's trunk has 2 layers: a draft that reads layer 3 cannot run on it.
    rc, out = _cli(capsys, "models", "check", str(files["mtp"]), str(files["eagle3_draft"]))
    assert rc == 1 and "it reads layers [3], the target has 2" in out


def test_heads_of_an_architecture_llama_cpp_cannot_run_are_not_offered(files, tmp_path: Path) -> None:
    """GLM-4 files keep NextN tensors that llama.cpp 0.3.36 loads but never runs: said, and not drafted with."""
    import dataclasses

    info = dataclasses.replace(validate_gguf(files["mtp"]), architecture="glm4")
    assert mtp_heads(info) == 0
    assert "does not run" in describe_drafters(info)
