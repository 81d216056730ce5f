"""Shared fixtures: tiny GGUF files written per session, engines over them, and the real demo pair."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# Measured device costs stay out of the user's data dir (and out of other tests): each engine measures its own.
os.environ["SPECCHAT_COST_CACHE"] = ""
# The speculation memory too: tests that need one give it a folder of their own.
os.environ["SPECCHAT_MEMORY_DIR"] = ""
# And the KV cells the chat app keeps on disk (backends.kv_store): tests that need them give them a folder.
os.environ["SPECCHAT_KV_DIR"] = ""

from gguf_factory import TinyModel, spm_vocab, write_llama_gguf  # noqa: E402

from backends.engine import Engine, EngineConfig  # noqa: E402

# Words for a second, different vocabulary: same size, other text.
OTHER_WORDS = tuple(f"w{i}" for i in range(32))
# A 12-word vocabulary without byte tokens, for statistical tests on exact distributions.
TINY_VOCAB_WORDS = ("a", "b", "c", "d", "e", "f")
# Enough sequence ids for every lookahead setting the tests use (W + G + 1).
N_SEQ_MAX = 32


@dataclass(frozen=True)
class TinyFiles:
    target: Path
    draft: Path  # target + noise: partial acceptance
    same_draft: Path  # identical weights: acceptance 1 at temperature 0
    other_vocab: Path  # incompatible vocabulary
    small_target: Path  # tiny vocabulary, peaky enough for chi-square tests
    small_draft: Path
    json_target: Path  # a vocabulary that spells a space as SentencePiece models do: for grammars
    json_draft: Path


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyFiles:
    d = tmp_path_factory.mktemp("tiny")
    small_vocab = spm_vocab(TINY_VOCAB_WORDS, with_bytes=False)
    small_model = TinyModel(logit_scale=0.35)
    return TinyFiles(
        target=write_llama_gguf(d / "target.gguf"),
        draft=write_llama_gguf(d / "draft.gguf", noise=0.3),
        same_draft=write_llama_gguf(d / "same.gguf", noise=0.0),
        other_vocab=write_llama_gguf(d / "other.gguf", vocab=spm_vocab(OTHER_WORDS)),
        small_target=write_llama_gguf(d / "small_target.gguf", vocab=small_vocab, model=small_model),
        small_draft=write_llama_gguf(d / "small_draft.gguf", vocab=small_vocab, model=small_model, noise=0.5),
        json_target=write_llama_gguf(d / "json_target.gguf", vocab=spm_vocab(space=True)),
        json_draft=write_llama_gguf(d / "json_draft.gguf", vocab=spm_vocab(space=True), noise=0.3),
    )


@pytest.fixture(scope="session")
def tiny_engine(tiny: TinyFiles) -> Engine:
    engine = Engine(EngineConfig(target=tiny.target, draft=tiny.draft, n_ctx=1024, threads=1, n_seq_max=N_SEQ_MAX))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def json_engine(tiny: TinyFiles) -> Engine:
    engine = Engine(EngineConfig(target=tiny.json_target, draft=tiny.json_draft, n_ctx=1024, threads=1,
                                 n_seq_max=N_SEQ_MAX))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def small_engine(tiny: TinyFiles) -> Engine:
    engine = Engine(EngineConfig(target=tiny.small_target, draft=tiny.small_draft, n_ctx=256, threads=1,
                                 n_seq_max=N_SEQ_MAX))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def demo_pair():
    """The real Gemma 3 270M pair (F32 target, Q3_K_M draft), built once into the data dir."""
    from app.loading import quantize
    from models.demo import ensure_demo_pair

    return ensure_demo_pair(lambda msg: print(msg, file=sys.stderr), quantize)


@pytest.fixture(scope="session")
def instruct_pair():
    """The real SmolLM2-135M-Instruct pair (F32 target, Q2_K draft, ChatML template), built once into the data dir."""
    from app.loading import quantize
    from models.demo import SMOLLM2, ensure_demo_pair

    return ensure_demo_pair(lambda msg: print(msg, file=sys.stderr), quantize, SMOLLM2)


@pytest.fixture(scope="session")
def instruct_engine(instruct_pair) -> Engine:
    engine = Engine(EngineConfig(target=instruct_pair.target, draft=instruct_pair.draft, n_ctx=2048,
                                 threads=os.cpu_count(), n_seq_max=N_SEQ_MAX))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def demo_engine(demo_pair) -> Engine:
    engine = Engine(EngineConfig(target=demo_pair.target, draft=demo_pair.draft, n_ctx=1024, threads=os.cpu_count(),
                                 n_seq_max=N_SEQ_MAX))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def server(tiny: TinyFiles, tmp_path_factory: pytest.TempPathFactory):
    """`specchat serve` on the tiny pair with serve_helpers.API_KEY, one per test module (each module's
    counters start from a server of its own); stopped with Ctrl-C at the end, which must exit cleanly."""
    from serve_helpers import API_KEY, start_server, stop_server  # httpx and openai only where a server runs

    served = start_server(["-m", str(tiny.target), "-md", str(tiny.draft), "--api-key", API_KEY],
                          tmp_path_factory.mktemp("serve") / "server.log")
    yield served
    stop_server(served)


@dataclass(frozen=True)
class ThinkingFiles:
    qwq: Path  # SmolLM2-Instruct with QwQ's original template: the generation prompt opens the <think> block
    qwen3: Path  # with Qwen3's template: the model opens the block itself; enable_thinking turns it off
    draft: Path  # the SmolLM2 draft (its template is not read)


def repack_with_template(src: Path, dst: Path, template: str) -> Path:
    """A copy of a GGUF with its chat template replaced (gguf's own gguf_new_metadata does the copying)."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE]
    writer = gguf.GGUFWriter(dst, arch=bytes(arch.parts[arch.data[0]]).decode(), endianess=reader.endianess)
    copy_with_new_metadata(reader, writer, {gguf.Keys.Tokenizer.CHAT_TEMPLATE: MetadataDetails(
        gguf.GGUFValueType.STRING, template)}, [])
    return dst


@pytest.fixture(scope="session")
def thinking_models(instruct_pair, tmp_path_factory: pytest.TempPathFactory) -> ThinkingFiles:
    """The SmolLM2 instruct model re-packed with thinking templates from llama.cpp's models/templates
    (tests/data/templates). llama.cpp's copy of QwQ's template takes enable_thinking; QwQ's own does not: its
    lines that read it are dropped, which gives the original (it always opens the block)."""
    d = tmp_path_factory.mktemp("thinking")
    templates = Path(__file__).parent / "data" / "templates"
    qwq = "".join(line for line in (templates / "Qwen-QwQ-32B.jinja").read_text().splitlines(keepends=True)
                  if "enable_thinking" not in line)
    assert "'<|im_start|>assistant\\n<think>\\n'" in qwq and "enable_thinking" not in qwq
    qwen3 = (templates / "Qwen-Qwen3-0.6B.jinja").read_text()
    return ThinkingFiles(qwq=repack_with_template(instruct_pair.target, d / "smollm2-qwq.gguf", qwq),
                         qwen3=repack_with_template(instruct_pair.target, d / "smollm2-qwen3.gguf", qwen3),
                         draft=instruct_pair.draft)
