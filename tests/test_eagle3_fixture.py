"""The EAGLE-3 fixture (tests/eagle3_factory.py) as llama.cpp 0.3.36 reads it, so that it cannot rot unseen.

Loads the pair with llama-cpp-python's low-level API, reads the draft's
architecture and target layer ids (`llama_model_target_layer_ids`, exported
by libllama under its C++-mangled name only), and runs the EAGLE-3 protocol
of docs/eagle3-protocol.md once by hand: target decode with its layer inputs
extracted, the draft's encoder (fc, checked against numpy) and decoder over
the (t[k+1], g[k]) pairs, then a seed step whose greedy draft token must be
the target's own next token on the exactly-drafting pair (residual 0,
head_noise 0).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import gguf
import llama_cpp
import numpy as np
import pytest

from backends.llama_process import ensure_backend
from llama_cpp.llama_cpp_ext import llama_get_embeddings_nextn, llama_set_embeddings_nextn
from eagle3_factory import EAGLE3_ARCH, Eagle3Pair, write_eagle3_pair  # tests/ is on sys.path (conftest.py)

_lib = llama_cpp.llama_cpp._lib


def _ext(names: tuple[str, ...], argtypes: list, restype: object):
    """A function of src/llama-ext.h: C++ linkage, so its symbol is mangled (as llama_cpp_ext binds them)."""
    for name in names:
        f = getattr(_lib, name, None)
        if f is not None:
            f.argtypes, f.restype = argtypes, restype
            return f
    raise AttributeError(f"libllama exports none of {names}")


_model_p, _ctx_p = llama_cpp.llama_model_p_ctypes, llama_cpp.llama_context_p_ctypes
target_layer_ids = _ext(("llama_model_target_layer_ids", "_Z28llama_model_target_layer_idsPK11llama_model"),
                        [_model_p], ctypes.POINTER(ctypes.c_int32))
target_layer_ids_n = _ext(("llama_model_target_layer_ids_n", "_Z30llama_model_target_layer_ids_nPK11llama_model"),
                          [_model_p], ctypes.c_uint32)
set_embeddings_layer_inp = _ext(
    ("llama_set_embeddings_layer_inp", "_Z30llama_set_embeddings_layer_inpP13llama_contextjb"),
    [_ctx_p, ctypes.c_uint32, ctypes.c_bool], None)
get_embeddings_layer_inp = _ext(
    ("llama_get_embeddings_layer_inp", "_Z30llama_get_embeddings_layer_inpP13llama_contextj"),
    [_ctx_p, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float))


class _Models:
    def __init__(self, target: Path, draft: Path) -> None:
        ensure_backend()
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 0
        self.target = llama_cpp.llama_model_load_from_file(str(target).encode(), params)
        self.draft = llama_cpp.llama_model_load_from_file(str(draft).encode(), params)
        assert self.target and self.draft, "llama.cpp could not load the EAGLE-3 pair"
        self.ctxs: list = []

    def context(self, model, other=None):
        p = llama_cpp.llama_context_default_params()
        p.n_ctx = p.n_batch = p.n_ubatch = 128
        p.n_seq_max = 1
        p.n_threads = p.n_threads_batch = 2
        if other is not None:
            p.ctx_other = other
        ctx = llama_cpp.llama_init_from_model(model, p)
        assert ctx, "llama.cpp could not create the context"
        self.ctxs.append(ctx)
        return ctx

    def close(self) -> None:
        for ctx in reversed(self.ctxs):
            llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(self.draft)
        llama_cpp.llama_model_free(self.target)


def _meta(model, key: str) -> str:
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    assert n >= 0, f"no {key}"
    return buf.value.decode()


def _process(ctx, kind: int, rows: list[tuple[int | None, int, np.ndarray | None, bool]]) -> None:
    """One llama_process call on a llama_batch_ext of (token or None, pos, embedding row or None, output)."""
    batch = llama_cpp.llama_batch_ext_init(ctx)
    try:
        for tok, pos, embd, out in rows:
            view = None
            if embd is not None:
                embd = np.ascontiguousarray(embd, dtype=np.float32)
                view = llama_cpp.llama_embd(embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, embd.size)
            if tok is None:
                idx = llama_cpp.llama_batch_ext_add_embd(batch, 0, view)  # the embedding is copied
            else:
                idx = llama_cpp.llama_batch_ext_add_token(batch, 0, tok)
                if view is not None:
                    assert llama_cpp.llama_batch_ext_set_embd_token(batch, idx, view)
            assert idx >= 0, idx
            assert llama_cpp.llama_batch_ext_set_pos(batch, idx, (llama_cpp.llama_pos * 4)(pos, 0, 0, 0))
            if out:
                assert llama_cpp.llama_batch_ext_set_output_logits(batch, idx, True)
        rc = llama_cpp.llama_process(ctx, kind, batch)
        assert rc == 0, f"llama_process returned {rc}"
    finally:
        llama_cpp.llama_batch_ext_free(batch)


def _logits(ctx, row: int, n_vocab: int) -> np.ndarray:
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, row), shape=(n_vocab,)).copy()


@pytest.fixture
def pair(tmp_path: Path):
    def make(model: Eagle3Pair = Eagle3Pair()) -> tuple[_Models, Path]:
        target, draft = tmp_path / "eagle3-target.gguf", tmp_path / "eagle3-draft.gguf"
        write_eagle3_pair(target, draft, seed=0, model=model)
        models = _Models(target, draft)
        opened.append(models)
        return models, draft

    opened: list[_Models] = []
    yield make
    for m in opened:
        m.close()


def test_llama_cpp_reads_the_draft_as_eagle3(pair) -> None:
    m, draft_path = pair()
    assert _meta(m.target, "general.architecture") == "llama"
    assert _meta(m.draft, "general.architecture") == EAGLE3_ARCH
    assert _meta(m.draft, f"{EAGLE3_ARCH}.target_hidden_size") == str(Eagle3Pair().n_embd)
    n = target_layer_ids_n(m.draft)
    assert n == 3
    assert [target_layer_ids(m.draft)[i] for i in range(n)] == list(Eagle3Pair().target_layers)
    assert target_layer_ids_n(m.target) == 0
    assert all(i < llama_cpp.llama_model_n_layer(m.target) for i in Eagle3Pair().target_layers)
    assert llama_cpp.llama_model_has_encoder(m.draft) and not llama_cpp.llama_model_has_encoder(m.target)
    assert llama_cpp.llama_model_n_layer(m.draft) == 1
    # one tokenizer: llama.cpp's draft/target compatibility check compares the vocabularies
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(m.target))
    assert llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(m.draft)) == n_vocab
    # the reduced vocabulary: d2t holds absolute target ids, ascending, one per lm_head row
    tensors = {t.name: t for t in gguf.GGUFReader(draft_path).tensors}
    d2t = np.asarray(tensors["d2t"].data)
    assert tensors["d2t"].tensor_type == gguf.GGMLQuantizationType.I64
    assert d2t.shape == (Eagle3Pair().draft_vocab,)
    assert np.all(np.diff(d2t) > 0) and 0 <= d2t[0] and d2t[-1] < n_vocab
    assert tuple(tensors["output.weight"].shape) == (Eagle3Pair().n_embd, Eagle3Pair().draft_vocab)
    assert "token_embd.weight" not in tensors  # borrowed from the target through ctx_other


def _run_target(m: _Models, spec: Eagle3Pair, prompt: list[int]):
    """Target and draft contexts, the prompt decoded on the target with its layer inputs extracted.

    Returns (ctx_tgt, ctx_dft, features [n, 3 * n_embd], the target's greedy next token)."""
    n_vocab, d, n = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(m.target)), spec.n_embd, len(prompt)
    ctx_tgt = m.context(m.target)
    for lid in spec.target_layers:
        set_embeddings_layer_inp(ctx_tgt, lid, True)
    ctx_dft = m.context(m.draft, other=ctx_tgt)  # no own token_embd: the draft reads the target's
    llama_set_embeddings_nextn(ctx_dft, True, True)
    _process(ctx_tgt, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, [(t, i, None, i == n - 1) for i, t in enumerate(prompt)])
    t_next = int(np.argmax(_logits(ctx_tgt, n - 1, n_vocab)))
    # features[k] = inputs of the three target layers at prompt position k (every row, not only outputs)
    layers = [np.ctypeslib.as_array(get_embeddings_layer_inp(ctx_tgt, lid), shape=(n, d)).copy()
              for lid in spec.target_layers]
    return ctx_tgt, ctx_dft, np.concatenate(layers, axis=1), t_next


def _encode(ctx_dft, features: np.ndarray, d: int) -> np.ndarray:
    """The draft's encoder (fc) over the feature rows: one g row each (their positions are placeholders)."""
    n = len(features)
    _process(ctx_dft, llama_cpp.LLAMA_PROCESS_TYPE_ENCODE, [(None, k, features[k], True) for k in range(n)])
    return np.ctypeslib.as_array(llama_get_embeddings_nextn(ctx_dft), shape=(n, d)).copy()


PROMPT = [1, 269, 102, 104, 270, 261]


def test_the_encoder_projects_the_three_target_layers(pair) -> None:
    spec = Eagle3Pair()
    m, draft_path = pair(spec)
    _, ctx_dft, features, _ = _run_target(m, spec, PROMPT)
    d = spec.n_embd
    assert features.shape == (len(PROMPT), 3 * d) and np.isfinite(features).all()
    assert not np.allclose(features[:, :d], features[:, d:2 * d])  # three different layers
    fc = np.asarray(next(t for t in gguf.GGUFReader(draft_path).tensors if t.name == "fc.weight").data)
    assert fc.shape == (d, 3 * d)
    g = _encode(ctx_dft, features, d)
    np.testing.assert_allclose(g, features @ fc.T, rtol=1e-4, atol=1e-4)


def test_the_eagle3_protocol_drafts_the_targets_next_token(pair) -> None:
    """residual 0 and head_noise 0: the draft's seed step must predict what the target says next (in its vocabulary)."""
    spec = Eagle3Pair(residual=0.0, head_noise=0.0)
    m, draft_path = pair(spec)
    n_vocab, d, n = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(m.target)), spec.n_embd, len(PROMPT)
    ctx_tgt, ctx_dft, features, t_next = _run_target(m, spec, PROMPT)
    # the target's logits after t_next, restricted to the draft vocabulary: what a perfect draft predicts
    _process(ctx_tgt, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, [(t_next, n, None, True)])
    d2t = np.asarray(next(t for t in gguf.GGUFReader(draft_path).tensors if t.name == "d2t").data)
    t_after = int(d2t[np.argmax(_logits(ctx_tgt, 0, n_vocab)[d2t])])

    g = _encode(ctx_dft, features, d)
    # decoder: (t[k+1], g[k]) at pos k for k < n-1; the last pair waits for the target's next token
    _process(ctx_dft, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, [(PROMPT[k + 1], k, g[k], False) for k in range(n - 1)])
    _process(ctx_dft, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, [(t_next, n - 1, g[n - 1], True)])
    logits = _logits(ctx_dft, 0, n_vocab)
    assert set(np.flatnonzero(np.isfinite(logits))) == set(d2t.tolist())  # d2t scatters, -inf elsewhere
    assert int(np.argmax(logits)) == t_after
