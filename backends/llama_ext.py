"""llama.cpp's extended API for drafters that read the target's hidden states: the third module that imports
`llama_cpp` (beside backends/llama.py, whose typed surface it extends, and backends/llama_process.py).

llama.cpp 0c1e570 (vendored in llama-cpp-python 0.3.36) runs a model's MTP
head in a context of its own (LLAMA_CONTEXT_TYPE_MTP, backends.llama's
`LlamaContext(other=target, mtp=True)`), whose rows carry a token *and* a hidden state of
the target: common/speculative.cpp's `common_speculative_impl_draft_mtp`
fills them through `common_batch` (common/common.cpp, `get_sub_batch`) with
`llama_batch_ext_add_token`, `llama_batch_ext_set_pos`,
`llama_batch_ext_set_embd_token` and `llama_batch_ext_set_output_logits`,
decodes with `llama_process`, and reads the hidden states out with
`llama_get_embeddings_nextn[_ith]` (llama_cpp.llama_cpp_ext: C++ symbols). A model with several
NextN blocks has them picked per decode with `llama_set_nextn_layer_offset` (backends.mtp_chain).

Two readings of the hidden rows, as llama.cpp sets them (`llama_set_embeddings_nextn(ctx, on, masked)`):
  - the target's context, unmasked: one row per batch row, whether its logits
    were asked or not (a prompt chunk's rows too), indexed by batch row;
  - the MTP context, masked: rows only for the batch rows that asked for
    logits, read by batch row (llama.cpp resolves it to its output row).

An EAGLE-3 draft (backends.eagle3, docs/eagle3-protocol.md) reads the *inputs*
of three target layers. src/llama-ext.h declares the functions it needs
without `extern "C"`, and llama-cpp-python 0.3.36 wraps none of them, so they
are bound here by their C, Itanium and MSVC names in turn, as
llama_cpp/llama_cpp_ext.py binds its own (`_ctypes_function_from_names`):
`llama_set_embeddings_layer_inp` / `llama_get_embeddings_layer_inp` (one row
per batch row, src/llama-context.cpp:2151-2153, 2278-2308) and
`llama_model_target_layer_ids[_n]`. An id equal to the target's n_layer names
its final pre-norm state, the nextn rows (common/speculative.cpp:541-549).
The draft's encoder runs as `common_speculative_impl_draft_eagle3::process`
runs it (:645-671): rows of width 3 x n_embd_target added with
`llama_batch_ext_add_embd`, `llama_process(ctx, LLAMA_PROCESS_TYPE_ENCODE)`
in chunks of n_ubatch (the encoder takes no more, src/llama-context.cpp:1503),
its output read with `llama_get_embeddings_nextn` (`EncodeBatch`).
"""

from __future__ import annotations

import ctypes
import time
from typing import Sequence

import llama_cpp
import numpy as np
from llama_cpp import llama_cpp_ext

from backends.errors import DecodeError
from backends.llama import LlamaContext, LlamaModel

_FLOAT_P = ctypes.POINTER(ctypes.c_float)


def _bind(names: tuple[str, ...], argtypes: list, restype: object):
    """A function of src/llama-ext.h under the first of its names libllama exports (C, Itanium, MSVC)."""
    lib = llama_cpp.llama_cpp._lib
    for name in names:
        f = getattr(lib, name, None)
        if f is not None:
            f.argtypes, f.restype = argtypes, restype
            return f
    raise AttributeError(f"libllama exports none of {', '.join(names)}")


_CTX, _MODEL = llama_cpp.llama_context_p_ctypes, llama_cpp.llama_model_p_ctypes
_set_layer_inp = _bind(("llama_set_embeddings_layer_inp", "_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
                        "?llama_set_embeddings_layer_inp@@YAXPEAUllama_context@@I_N@Z"),
                       [_CTX, ctypes.c_uint32, ctypes.c_bool], None)
_get_layer_inp = _bind(("llama_get_embeddings_layer_inp", "_Z30llama_get_embeddings_layer_inpP13llama_contextj",
                        "?llama_get_embeddings_layer_inp@@YAPEAMPEAUllama_context@@I@Z"),
                       [_CTX, ctypes.c_uint32], _FLOAT_P)
_target_layer_ids = _bind(("llama_model_target_layer_ids", "_Z28llama_model_target_layer_idsPK11llama_model",
                           "?llama_model_target_layer_ids@@YAPEBHPEBUllama_model@@@Z"),
                          [_MODEL], ctypes.POINTER(ctypes.c_int32))
_target_layer_ids_n = _bind(("llama_model_target_layer_ids_n", "_Z30llama_model_target_layer_ids_nPK11llama_model",
                             "?llama_model_target_layer_ids_n@@YAIPEBUllama_model@@@Z"),
                            [_MODEL], ctypes.c_uint32)


def target_layer_ids(model: LlamaModel) -> tuple[int, ...]:
    """The target layers an EAGLE-3 draft reads, as llama.cpp loaded them (() for any other model)."""
    n = int(_target_layer_ids_n(model.ptr))
    ids = _target_layer_ids(model.ptr) if n else None
    return tuple(int(ids[i]) for i in range(n)) if ids else ()


def n_layer(model: LlamaModel) -> int:
    """The model's layers, as llama.cpp counts them (llama_model_n_layer)."""
    return int(llama_cpp.llama_model_n_layer(model.ptr))


def enable_layer_inputs(ctx: LlamaContext, ids: Sequence[int]) -> None:
    """Have `ctx` output the input rows of these layers from its next decode on, one per batch row; an id equal
    to the model's n_layer is its final pre-norm state (the unmasked nextn rows). Ids beyond are refused
    (llama.cpp would abort)."""
    top = n_layer(ctx.model)
    for lid in ids:
        if not 0 <= lid <= top:
            raise ValueError(f"layer {lid} is not in 0..{top}")
        if lid < top:
            _set_layer_inp(ctx.ptr, lid, True)
        else:
            enable_hidden(ctx, masked=False)


def layer_input_rows(ctx: LlamaContext, lid: int, n_rows: int) -> np.ndarray:
    """The input rows of layer `lid` in the last decode of `ctx` (one per batch row): a view, valid until the
    next decode."""
    if lid == n_layer(ctx.model):
        return hidden_rows(ctx, n_rows)
    ptr = _get_layer_inp(ctx.ptr, lid)
    if not ptr:
        raise DecodeError(f"the context has no input rows of layer {lid} (llama_get_embeddings_layer_inp)")
    return np.ctypeslib.as_array(ptr, shape=(n_rows, ctx.model.n_embd))


def enable_hidden(ctx: LlamaContext, masked: bool) -> None:
    """Have `ctx` output its NextN hidden rows from now on (masked: for the rows that want logits only)."""
    llama_cpp_ext.llama_set_embeddings_nextn(ctx.ptr, True, masked)


def set_nextn_layer_offset(ctx: LlamaContext, offset: int) -> None:
    """Have the MTP context's next decodes run its model's NextN block `offset` (0 = the first head): how
    llama.cpp chains a model's several heads (common/speculative.cpp, `chain_heads`). llama.cpp aborts on an
    offset outside 0 .. n_layer_nextn - 1, so one is refused here."""
    n = max(ctx.model.n_layer_nextn, 1)  # the heads loaded with the model
    if not 0 <= offset < n:
        raise ValueError(f"head {offset} is not in 0..{n - 1}")
    llama_cpp_ext.llama_set_nextn_layer_offset(ctx.ptr, offset)


def hidden_rows(ctx: LlamaContext, n_rows: int) -> np.ndarray:
    """The hidden rows of the last decode of an unmasked context (one per batch row): a view, valid until the
    next decode."""
    ptr = llama_cpp_ext.llama_get_embeddings_nextn(ctx.ptr)
    if not ptr:
        raise DecodeError("the context has no hidden rows (llama_get_embeddings_nextn)")
    return np.ctypeslib.as_array(ptr, shape=(n_rows, ctx.model.n_embd))


def hidden_row(ctx: LlamaContext, row: int, width: int | None = None) -> np.ndarray:
    """The hidden row of batch row `row` of the last decode of a masked context (a row that wanted logits):
    `width` floats, the model's n_embd unless given (llama.cpp's rows are n_embd_out wide: a Gemma 4 assistant's
    are the target's width, src/llama-context.cpp:2143)."""
    ptr = llama_cpp_ext.llama_get_embeddings_nextn_ith(ctx.ptr, row)
    if not ptr:
        raise DecodeError(f"no hidden row for batch row {row}")
    return np.ctypeslib.as_array(ptr, shape=(width or ctx.model.n_embd,))


def n_embd_out(model: LlamaModel) -> int:
    """The width of the model's output rows (llama_model_n_embd_out): its n_embd, or another where the file says
    (`{arch}.embedding_length_out`: a Gemma 4 assistant's hidden rows are its target's width)."""
    return int(llama_cpp.llama_model_n_embd_out(model.ptr))


class _ExtBatch:
    """A llama_batch_ext of one context, with its position buffer; freed on close."""

    def __init__(self, ctx: LlamaContext, what: str) -> None:
        self.ctx = ctx
        self._b = llama_cpp.llama_batch_ext_init(ctx.ptr)
        if not self._b:
            raise DecodeError(f"llama.cpp could not make an extended batch for {what}")
        self._pos = (llama_cpp.llama_pos * 4)()

    def close(self) -> None:
        if getattr(self, "_b", None):
            llama_cpp.llama_batch_ext_free(self._b)
            self._b = None

    def __del__(self) -> None:
        self.close()


class HiddenBatch(_ExtBatch):
    """A llama_batch_ext whose rows are (token, position, sequence ids, wants logits, hidden state).

    The hidden states of one fill live in one contiguous array that is kept
    until the next fill: llama.cpp reads them during `process`, not when they
    are set.
    """

    def __init__(self, ctx: LlamaContext) -> None:
        super().__init__(ctx, "the MTP context")
        self.capacity = ctx.n_batch
        self.n_embd = ctx.model.n_embd
        self._hidden = np.zeros((0, self.n_embd), dtype=np.float32)
        self.n_rows = 0

    def fill(self, rows: Sequence[tuple[int, int, Sequence[int], bool]], hidden: np.ndarray) -> None:
        """Put `rows` in the batch, row i carrying `hidden[i]` (float32, one row of n_embd per entry)."""
        if len(rows) > self.capacity:
            raise ValueError(f"batch is full ({self.capacity} rows)")
        self._hidden = np.ascontiguousarray(hidden, dtype=np.float32)
        b, pos = self._b, self._pos
        llama_cpp.llama_batch_ext_clear(b)
        base = self._hidden.ctypes.data
        stride = self.n_embd * 4
        for i, (tok, p, seqs, want) in enumerate(rows):
            idx = llama_cpp.llama_batch_ext_add_token(b, seqs[0], tok)
            if idx != i:
                raise DecodeError(f"llama_batch_ext_add_token failed ({idx}) for token {tok}")
            for s in seqs[1:]:
                llama_cpp.llama_batch_ext_add_seq(b, idx, s)
            pos[0] = p
            llama_cpp.llama_batch_ext_set_pos(b, idx, pos)
            embd = llama_cpp.llama_embd(ctypes.cast(base + i * stride, _FLOAT_P), 1, self.n_embd)
            llama_cpp.llama_batch_ext_set_embd_token(b, idx, embd)
            if want:
                llama_cpp.llama_batch_ext_set_output_logits(b, idx, True)
        self.n_rows = len(rows)

    def process(self) -> float:
        """Decode the batch on its context; the seconds it took."""
        t0 = time.perf_counter()
        rc = llama_cpp.llama_process(self.ctx.ptr, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, self._b)
        if rc != 0:
            raise DecodeError(f"llama_process failed with code {rc} (MTP batch of {self.n_rows} rows)")
        return time.perf_counter() - t0



class EncodeBatch(_ExtBatch):
    """An EAGLE-3 draft's encoder: rows of the target's layer inputs (3 x n_embd_target wide) in, one g row
    (the draft's n_embd) out each, by `llama_process(ctx, LLAMA_PROCESS_TYPE_ENCODE)` in chunks of n_ubatch.
    No KV cell is written; the positions are placeholders, after what sequence 0 holds (llama.cpp checks them
    against its cells as a decode's: common/speculative.cpp:653-660)."""

    def __init__(self, ctx: LlamaContext, width: int) -> None:
        super().__init__(ctx, "the EAGLE-3 encoder")
        self.width, self.n_embd = width, ctx.model.n_embd
        self.chunk = int(llama_cpp.llama_n_ubatch(ctx.ptr))

    def encode(self, features: np.ndarray) -> np.ndarray:
        """g for each row of `features` (float32, n x width): a new array, n x n_embd."""
        features = np.ascontiguousarray(features, dtype=np.float32)
        n = len(features)
        out = np.empty((n, self.n_embd), dtype=np.float32)
        b, pos, base, stride = self._b, self._pos, features.ctypes.data, self.width * 4
        for start in range(0, n, self.chunk):
            k = min(self.chunk, n - start)
            llama_cpp.llama_batch_ext_clear(b)
            first = self.ctx.pos_max(0) + 1
            for j in range(k):
                embd = llama_cpp.llama_embd(ctypes.cast(base + (start + j) * stride, _FLOAT_P), 1, self.width)
                idx = llama_cpp.llama_batch_ext_add_embd(b, 0, embd)  # copies the row
                if idx != j:
                    raise DecodeError(f"llama_batch_ext_add_embd failed ({idx})")
                pos[0] = first + j
                llama_cpp.llama_batch_ext_set_pos(b, idx, pos)
                llama_cpp.llama_batch_ext_set_output_logits(b, idx, True)
            rc = llama_cpp.llama_process(self.ctx.ptr, llama_cpp.LLAMA_PROCESS_TYPE_ENCODE, b)
            if rc != 0:
                raise DecodeError(f"llama_process failed with code {rc} (EAGLE-3 encoder, {k} rows)")
            ptr = llama_cpp_ext.llama_get_embeddings_nextn(self.ctx.ptr)
            if not ptr:
                raise DecodeError("the EAGLE-3 encoder gave no rows (llama_get_embeddings_nextn)")
            out[start:start + k] = np.ctypeslib.as_array(ptr, shape=(k, self.n_embd))
        return out



# -- DFlash / DSpark block drafts (backends.dflash, docs/dflash-protocol.md) ------------------------------------

_selector_top_k = _bind(("llama_model_dflash_selector_top_k", "_Z33llama_model_dflash_selector_top_kPK11llama_model",
                         "?llama_model_dflash_selector_top_k@@YAHPEBUllama_model@@@Z"),
                        [_MODEL], ctypes.c_int32)


def dflash_selector_top_k(model: LlamaModel) -> int:
    """A DFlash2 draft's selector top-k (0 for DFlash, DSpark and any other model)."""
    return int(_selector_top_k(model.ptr))


def mask_token(model: LlamaModel) -> int:
    """The vocabulary's mask token as llama.cpp loaded it (`tokenizer.ggml.mask_token_id`), -1 when it has none."""
    return int(llama_cpp.llama_vocab_mask(llama_cpp.llama_model_get_vocab(model.ptr)))


def set_causal_attention(ctx: LlamaContext, causal: bool) -> None:
    """Causal or not for the context's next decodes (a DFlash draft's block attends to all its sequence's cells)."""
    llama_cpp.llama_set_causal_attn(ctx.ptr, causal)


def n_ubatch(ctx: LlamaContext) -> int:
    return int(llama_cpp.llama_n_ubatch(ctx.ptr))


class InjectBatch(_ExtBatch):
    """A DFlash draft's injection rows: the target's layer inputs at one position each (n_layers x n_embd wide),
    decoded (LLAMA_PROCESS_TYPE_DECODE) into keys and values of the draft's cells at that position, asking for
    no output (common/speculative.cpp:1164-1175). Positions are given as llama.cpp gives them, {p, p, p, 0}: the
    four rows an M-RoPE draft reads for an embedding row."""

    def __init__(self, ctx: LlamaContext, width: int) -> None:
        super().__init__(ctx, "a DFlash draft's injection")
        self.width = width
        self._rows = np.zeros((0, width), dtype=np.float32)

    def process(self, rows: Sequence[tuple[int, int]], features: np.ndarray) -> float:
        """Decode (position, sequence id) rows, row i carrying `features[i]`; the seconds it took."""
        self._rows = np.ascontiguousarray(features, dtype=np.float32)
        b, pos = self._b, self._pos
        llama_cpp.llama_batch_ext_clear(b)
        base, stride = self._rows.ctypes.data, self.width * 4
        for i, (p, seq) in enumerate(rows):
            embd = llama_cpp.llama_embd(ctypes.cast(base + i * stride, _FLOAT_P), 1, self.width)
            idx = llama_cpp.llama_batch_ext_add_embd(b, seq, embd)  # copies the row
            if idx != i:
                raise DecodeError(f"llama_batch_ext_add_embd failed ({idx}) for a DFlash injection row")
            pos[0], pos[1], pos[2], pos[3] = p, p, p, 0
            llama_cpp.llama_batch_ext_set_pos(b, idx, pos)
        t0 = time.perf_counter()
        rc = llama_cpp.llama_process(self.ctx.ptr, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, b)
        if rc != 0:
            raise DecodeError(f"llama_process failed with code {rc} (DFlash injection of {len(rows)} rows)")
        return time.perf_counter() - t0


class TokenBatch(_ExtBatch):
    """Token rows of one llama_batch_ext, every one asking for logits (a DFlash block: its graph selects no
    outputs, so llama.cpp's outputs are its first rows, common/speculative.cpp:1209)."""

    def __init__(self, ctx: LlamaContext) -> None:
        super().__init__(ctx, "a DFlash draft's block")

    def process(self, rows: Sequence[tuple[int, int, int]]) -> tuple[np.ndarray, float]:
        """Decode (token, position, sequence id) rows: a copy of their logits (one row each) and the seconds."""
        b, pos = self._b, self._pos
        llama_cpp.llama_batch_ext_clear(b)
        for i, (tok, p, seq) in enumerate(rows):
            idx = llama_cpp.llama_batch_ext_add_token(b, seq, tok)
            if idx != i:
                raise DecodeError(f"llama_batch_ext_add_token failed ({idx}) for token {tok}")
            pos[0] = p
            llama_cpp.llama_batch_ext_set_pos(b, idx, pos)
            llama_cpp.llama_batch_ext_set_output_logits(b, idx, True)
        t0 = time.perf_counter()
        rc = llama_cpp.llama_process(self.ctx.ptr, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, b)
        if rc != 0:
            raise DecodeError(f"llama_process failed with code {rc} (DFlash block of {len(rows)} rows)")
        seconds = time.perf_counter() - t0
        ptr = llama_cpp.llama_get_logits(self.ctx.ptr)
        if not ptr:
            raise DecodeError("the DFlash block gave no logits")
        return np.ctypeslib.as_array(ptr, shape=(len(rows), self.ctx.n_vocab)).copy(), seconds
