"""llama.cpp's extended API for drafters that read the target's hidden states: the third module that imports
`llama_cpp` (beside backends/llama.py, whose typed surface it extends, and backends/llama_process.py).

llama.cpp 0c1e570 (vendored in llama-cpp-python 0.3.36) runs a model's MTP
head in a context of its own (LLAMA_CONTEXT_TYPE_MTP, backends.llama's
`LlamaContext(mtp_of=...)`), whose rows carry a token *and* a hidden state of
the target: common/speculative.cpp's `common_speculative_impl_draft_mtp`
fills them through `common_batch` (common/common.cpp, `get_sub_batch`) with
`llama_batch_ext_add_token`, `llama_batch_ext_set_pos`,
`llama_batch_ext_set_embd_token` and `llama_batch_ext_set_output_logits`,
decodes with `llama_process`, and reads the hidden states out with
`llama_get_embeddings_nextn[_ith]` (llama_cpp.llama_cpp_ext: C++ symbols).

Two readings of the hidden rows, as llama.cpp sets them (`llama_set_embeddings_nextn(ctx, on, masked)`):
  - the target's context, unmasked: one row per batch row, whether its logits
    were asked or not (a prompt chunk's rows too), indexed by batch row;
  - the MTP context, masked: rows only for the batch rows that asked for
    logits, read by batch row (llama.cpp resolves it to its output row).
"""

from __future__ import annotations

import ctypes
import time
from typing import Sequence

import llama_cpp
import numpy as np
from llama_cpp import llama_cpp_ext

from backends.errors import DecodeError
from backends.llama import LlamaContext

_FLOAT_P = ctypes.POINTER(ctypes.c_float)


def enable_hidden(ctx: LlamaContext, masked: bool) -> None:
    """Have `ctx` output its NextN hidden rows from now on (masked: for the rows that want logits only)."""
    llama_cpp_ext.llama_set_embeddings_nextn(ctx.ptr, True, masked)


def hidden_rows(ctx: LlamaContext, n_rows: int) -> np.ndarray:
    """The hidden rows of the last decode of an unmasked context (one per batch row): a view, valid until the
    next decode."""
    ptr = llama_cpp_ext.llama_get_embeddings_nextn(ctx.ptr)
    if not ptr:
        raise DecodeError("the context has no hidden rows (llama_get_embeddings_nextn)")
    return np.ctypeslib.as_array(ptr, shape=(n_rows, ctx.model.n_embd))


def hidden_row(ctx: LlamaContext, row: int) -> np.ndarray:
    """The hidden row of batch row `row` of the last decode of a masked context (a row that wanted logits)."""
    ptr = llama_cpp_ext.llama_get_embeddings_nextn_ith(ctx.ptr, row)
    if not ptr:
        raise DecodeError(f"no hidden row for batch row {row}")
    return np.ctypeslib.as_array(ptr, shape=(ctx.model.n_embd,))


class HiddenBatch:
    """A llama_batch_ext whose rows are (token, position, sequence ids, wants logits, hidden state).

    The hidden states of one fill live in one contiguous array that is kept
    until the next fill: llama.cpp reads them during `process`, not when they
    are set.
    """

    def __init__(self, ctx: LlamaContext) -> None:
        self.ctx = ctx
        self._b = llama_cpp.llama_batch_ext_init(ctx.ptr)
        if not self._b:
            raise DecodeError("llama.cpp could not make an extended batch for the MTP context")
        self.capacity = ctx.n_batch
        self.n_embd = ctx.model.n_embd
        self._hidden = np.zeros((0, self.n_embd), dtype=np.float32)
        self._pos = (llama_cpp.llama_pos * 4)()
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

    def close(self) -> None:
        if getattr(self, "_b", None):
            llama_cpp.llama_batch_ext_free(self._b)
            self._b = None

    def __del__(self) -> None:
        self.close()
