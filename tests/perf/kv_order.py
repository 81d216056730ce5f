"""How far a model's logits move when a sequence's KV cells are out of order in llama.cpp's buffer (not a test).

llama.cpp sums attention over the cache's cells in their order in the buffer and gives a new token the lowest
free cell. Here a sentence is decoded twice in sequence 0: once in order, once with a token of a scratch
sequence decoded between two of its tokens and freed, so that the next token's cell takes that hole, ahead of
the cell of the position before it (as after a tree's rejected branch). Printed: the largest difference of
any logit after the last token (docs/results.md, "The KV cells' order").

    python tests/perf/kv_order.py MODEL.gguf [--flash-attn auto|on|off] [-t THREADS]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import llama_cpp  # noqa: E402

from backends.llama import Batch, ContextConfig, LlamaContext, LlamaModel  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog and then runs far away into the forest"
FLASH = {"auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
         "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--flash-attn", choices=FLASH, default="auto")
    ap.add_argument("-t", type=int, default=2)
    args = ap.parse_args()
    defaults = llama_cpp.llama_context_default_params

    def params():  # ContextConfig has no flash-attention field: llama.cpp's default is set here
        p = defaults()
        p.flash_attn_type = FLASH[args.flash_attn]
        return p

    llama_cpp.llama_context_default_params = params
    model = LlamaModel(args.model)
    ctx = LlamaContext(model, ContextConfig(n_ctx=512, n_seq_max=4, kv_unified=True, n_threads=args.t))
    batch = Batch(64, 4)
    tokens = model.tokenize(TEXT)[:12]

    def decode(entries: list[tuple[int, int, tuple[int, ...], bool]]) -> list[int]:
        batch.clear()
        rows = [batch.add(*entry) for entry in entries]
        ctx.decode(batch)
        return rows

    def last_logits() -> np.ndarray:
        row = decode([(tokens[-1], len(tokens) - 1, (0,), True)])[0]
        return np.array(ctx.logits(row), dtype=np.float64)

    decode([(t, i, (0,), False) for i, t in enumerate(tokens[:-1])])
    in_order = last_logits()
    ctx.seq_rm(-1, -1, -1)
    k = 6
    decode([(t, i, (0,), False) for i, t in enumerate(tokens[:k])])
    ctx.seq_cp(0, 1, -1, -1)  # the scratch sequence's positions follow on from the prefix
    decode([(tokens[k], k, (0,), False), (tokens[k], k, (1,), False), (tokens[k + 1], k + 1, (0,), False)])
    ctx.seq_rm(1, -1, -1)  # the hole, between the cells of positions k and k + 1
    decode([(t, i, (0,), False) for i, t in enumerate(tokens[:-1]) if i >= k + 2])  # the first takes the hole
    out_of_order = last_logits()
    print(f"{args.model.name}, flash attention {args.flash_attn}: largest logit difference "
          f"{np.abs(out_of_order - in_order).max():.4f}")
    ctx.close()
    model.close()


if __name__ == "__main__":
    main()
