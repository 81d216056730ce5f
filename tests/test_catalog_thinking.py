"""How a catalog model thinks (models.catalog.Thinking): between tags, or in harmony's analysis channel (gpt-oss).

The loader on small catalogs: a harmony entry accepted, tag entries with or
without `"format": "tags"`, every malformed `thinking` refused in one line
naming the model; the packaged gpt-oss-20b marked harmony, its note naming
flags that `specchat run --help` really has; and what `models pairs` and
`models info gpt-oss-20b` (a remote header from the local FakeHub) say of it.
"""

from __future__ import annotations

from typing import Any

import pytest
from hub_server import FakeHub
from hub_server import hub, hub_ggufs  # noqa: F401  (fixtures used by name)

from app.cli import main
from app.settings import REASONING_EFFORTS
from models.catalog import HARMONY, TAGS, CatalogError, Thinking, load_catalog, parse_catalog

GPT_OSS_REPO, GPT_OSS_FILE = "ggml-org/gpt-oss-20b-GGUF", "gpt-oss-20b-MXFP4.gguf"


def _catalog(thinking: Any) -> dict[str, Any]:
    model = {"repo": "o/m", "file": "m-{quant}.gguf", "default_quant": "Q8_0", "sizes_gb": {"Q8_0": 1.0},
             "kv_gb": 0.1, "thinking": thinking}
    return {"models": {"m": model, "d": {**model, "repo": "o/d", "thinking": None}},
            "pairs": [{"name": "p", "target": "m", "draft": "d"}]}


def _thinking(raw: Any) -> Thinking | None:
    return parse_catalog(_catalog(raw)).model("m").thinking


@pytest.mark.parametrize(("raw", "expected"), [
    ({"format": "harmony"}, Thinking(HARMONY)),
    ({"format": "harmony", "can_disable": False}, Thinking(HARMONY)),
    ({"tags": ["<think>", "</think>"], "can_disable": True}, Thinking(TAGS, ("<think>", "</think>"), True)),
    ({"format": "tags", "tags": ["[THINK]", "[/THINK]"]}, Thinking(TAGS, ("[THINK]", "[/THINK]"), False)),
    (None, None),
])
def test_the_loader_accepts_harmony_and_tags(raw: Any, expected: Thinking | None) -> None:
    assert _thinking(raw) == expected


@pytest.mark.parametrize(("raw", "said"), [
    ({"format": "channels"}, 'thinking format is "tags" or "harmony", not "channels"'),
    ({"format": "harmony", "tags": ["<|channel|>analysis<|message|>", "<|end|>"]}, "harmony thinking has no tags"),
    ({"format": "harmony", "can_disable": True}, "harmony thinking cannot be turned off"),
    ({"format": "tags"}, "thinking tags are a start and an end tag"),
    ({"tags": ["<think>"]}, "thinking tags are a start and an end tag"),
    ({"tags": ["<think>", "<think>"]}, "thinking tags are a start and an end tag"),
    ({"tags": ["<think>", 7]}, "thinking tags are a start and an end tag"),
    ({"tags": "<think></think>"}, "thinking is {"),
    ({"tags": ["<think>", "</think>"], "can_disable": "yes"}, "thinking is {"),
    (["<think>", "</think>"], "thinking is {"),
    ({"format": "harmony", "effort": "high"}, "unknown thinking field(s) effort"),
])
def test_the_loader_refuses_a_malformed_thinking_in_one_line(raw: Any, said: str) -> None:
    with pytest.raises(CatalogError) as e:
        _thinking(raw)
    assert str(e.value).startswith(f"catalog model m: {said}") and "\n" not in str(e.value)


def test_gpt_oss_thinks_in_harmony_bounded_by_flags_run_has(capsys: pytest.CaptureFixture[str]) -> None:
    model = load_catalog().model("gpt-oss-20b")
    assert model is not None and model.thinking == Thinking(HARMONY)
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"--reasoning-effort {{{','.join(REASONING_EFFORTS)}}}" in help_text and "--reasoning-budget N" in help_text
    assert model.thinking_note == ("thinks before answering (in harmony's analysis channel; it cannot be turned off; "
                                   f"bound it with --reasoning-effort {'|'.join(REASONING_EFFORTS)} or "
                                   "--reasoning-budget N)")


def test_models_pairs_says_the_gpt_oss_target_thinks_in_harmony(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "pairs"]) == 0
    block = capsys.readouterr().out.split("gpt-oss-eagle3: ")[1].split("\n\n")[0]
    assert f"  the target {load_catalog().model('gpt-oss-20b').thinking_note}" in block.splitlines()


def test_models_info_of_gpt_oss_says_harmony(hub: FakeHub, hub_ggufs, capsys: pytest.CaptureFixture[str]) -> None:
    hub.add_file(GPT_OSS_REPO, GPT_OSS_FILE, hub_ggufs.small)  # a tiny file under the catalog's name: its header
    assert main(["models", "info", "gpt-oss-20b"]) == 0
    fields = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines())
    assert fields["thinking"] == load_catalog().model("gpt-oss-20b").thinking_note
    assert "harmony's analysis channel" in fields["thinking"] and fields["source"].startswith("remote header")
