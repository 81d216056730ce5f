"""Malformed and incompatible files give one clear error, never a llama.cpp abort."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from gguf_factory import Vocab, spm_vocab, write_llama_gguf
from models.compat import check_pair
from models.errors import ModelError
from models.gguf_header import parse_header
from models.gguf_info import validate_gguf


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "app", *args, "-t", "1"], capture_output=True, text=True, input=stdin, timeout=300)


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory: pytest.TempPathFactory, tiny) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bad")
    good = tiny.target.read_bytes()
    files = {}
    files["not_gguf"] = d / "notes.gguf"
    files["not_gguf"].write_text("this is not a model\n")
    files["empty"] = d / "empty.gguf"
    files["empty"].write_bytes(b"")
    files["truncated_header"] = d / "truncated_header.gguf"
    files["truncated_header"].write_bytes(good[:200])
    files["truncated_data"] = d / "truncated_data.gguf"
    files["truncated_data"].write_bytes(good[: len(good) - 1000])
    v = spm_vocab()
    dup = Vocab(v.tokens[:-1] + (v.tokens[-2],), v.scores, v.types)
    files["duplicate_vocab"] = write_llama_gguf(d / "dup.gguf", vocab=dup)
    files["unknown_arch"] = write_llama_gguf(d / "arch.gguf", architecture="no-such-arch")
    # A token that differs from another only after a NUL byte: llama.cpp reads both as the same C string and
    # its vocabulary loader aborts the process (GGML_ASSERT id_to_token.size() == token_to_id.size()).
    nul = Vocab(v.tokens[:-1] + (v.tokens[-2] + "\0\0\x01ble",), v.scores, v.types)
    files["nul_in_token"] = write_llama_gguf(d / "nul.gguf", vocab=nul)
    return files


EXPECTED_MESSAGES = {
    "not_gguf": "not a GGUF file",
    "empty": "empty file",
    "truncated_header": "truncated GGUF",
    "truncated_data": "truncated GGUF: tensor",
    "duplicate_vocab": "appears twice",
    "unknown_arch": "unknown model architecture 'no-such-arch'",
    "nul_in_token": "llama.cpp reads a token only up to a NUL byte",
}


@pytest.mark.parametrize("kind", sorted(EXPECTED_MESSAGES))
def test_validate_rejects(bad_files: dict[str, Path], kind: str) -> None:
    with pytest.raises(ModelError, match=EXPECTED_MESSAGES[kind]):
        validate_gguf(bad_files[kind])


@pytest.mark.parametrize("kind", sorted(EXPECTED_MESSAGES))
def test_cli_bad_model_exits_1_with_one_line(bad_files: dict[str, Path], kind: str) -> None:
    r = _cli("run", "hello", "-m", str(bad_files[kind]), "-s", "ar")
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specchat: error:") and EXPECTED_MESSAGES[kind] in lines[0]
    assert r.stdout == ""


def test_cli_missing_file(tmp_path: Path) -> None:
    r = _cli("run", "hi", "-m", str(tmp_path / "nope.gguf"), "-s", "ar")
    assert r.returncode == 1 and "no such file" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_incompatible_pair_is_refused(tiny) -> None:
    result = check_pair(validate_gguf(tiny.target), validate_gguf(tiny.other_vocab))
    assert not result.ok and any("token 259 differs" in p for p in result.problems)
    r = _cli("run", "hi", "-m", str(tiny.target), "-md", str(tiny.other_vocab))
    assert r.returncode == 1
    assert len(r.stderr.strip().splitlines()) == 1 and "cannot speculate" in r.stderr and "token 259 differs" in r.stderr


def test_compatible_pair_passes(tiny) -> None:
    assert check_pair(validate_gguf(tiny.target), validate_gguf(tiny.draft)).ok


def test_header_reader_agrees_with_gguf_package(tiny) -> None:
    """Our fast header parser reads the same metadata and tensor table as gguf.GGUFReader."""
    ours = parse_header(tiny.target.read_bytes())
    ref = gguf.GGUFReader(tiny.target)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        assert ours.metadata[key] == field.contents(), key
    assert [(t.name, t.offset + ours.data_offset, t.n_bytes) for t in ours.tensors] == [
        (t.name, t.data_offset, t.n_bytes) for t in ref.tensors
    ]


def test_info_reports_metadata(tiny) -> None:
    info = validate_gguf(tiny.target)
    assert info.architecture == "llama" and info.quantization == "F32"
    assert info.vocab_size == len(spm_vocab().tokens) and info.bos_id == 1 and info.eos_id == 2
