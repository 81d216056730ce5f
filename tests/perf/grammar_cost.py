"""What a grammar costs per token: llguidance (specchat's engine) against llama.cpp's own grammar sampler.

For each schema of the `extract` prompt set, the answer SmolLM2 writes under
it (greedy, `ar`) is replayed token by token through both engines, which
compute at each place what the target may sample there:
- llguidance: the mask of allowed tokens over the whole vocabulary
  (backends.grammar.Constraint.apply: the mask, applied to the logits);
- llama.cpp: its grammar sampler (`llama_sampler_init_grammar` on the GBNF
  that llama-cpp-python's `json_schema_to_gbnf` writes for the schema),
  `llama_sampler_apply` over a candidates array of the whole vocabulary,
  then `llama_sampler_accept`, as llama.cpp's common sampler does when it
  applies the grammar first.
Reported: median microseconds per token over the answers' tokens, and the
same as a share of a plain decode step of the target on this machine. Not a
test; llama.cpp is called directly here (the product goes through
backends/llama.py and backends/grammar.py).

    python tests/perf/grammar_cost.py -m smollm2 -t 2
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import llama_cpp  # noqa: E402
from llama_cpp.llama_grammar import json_schema_to_gbnf  # noqa: E402

from app.bench.prompts import load_prompt_set  # noqa: E402
from app.prompt_format import PromptFormat  # noqa: E402
from backends.engine import Engine, EngineConfig  # noqa: E402
from backends.grammar import compile_grammar  # noqa: E402
from backends.sampling import GenParams  # noqa: E402
from models.resolve import resolve_model  # noqa: E402


def llama_cpp_costs(model, gbnf: str, tokens: list[int], logits: np.ndarray) -> list[float]:
    vocab = model._vocab
    smpl = llama_cpp.llama_sampler_init_grammar(vocab, gbnf.encode(), b"root")
    if not smpl:
        raise SystemExit("llama.cpp could not parse the GBNF")
    n = model.n_vocab
    data = (llama_cpp.llama_token_data * n)()
    out = []
    try:
        for tok in tokens:
            for i in range(n):  # a fresh candidates array each time, as the common sampler refills it
                data[i].id, data[i].logit, data[i].p = i, float(logits[i]), 0.0
            arr = llama_cpp.llama_token_data_array(data, n, -1, False)
            t0 = time.perf_counter()
            llama_cpp.llama_sampler_apply(smpl, ctypes.byref(arr))
            llama_cpp.llama_sampler_accept(smpl, tok)
            out.append(time.perf_counter() - t0)
    finally:
        llama_cpp.llama_sampler_free(smpl)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", default="smollm2")
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("-n", type=int, default=120)
    args = ap.parse_args()
    target = resolve_model(args.m, lambda _m: None, None)
    engine = Engine(EngineConfig(target, n_ctx=2048, threads=args.t, n_seq_max=64, cost_cache=Path(""),
                                 memory=False))
    model = engine.target_model
    fmt = PromptFormat(engine)
    ours, theirs, plain = [], [], []
    try:
        for p in load_prompt_set("extract"):
            grammar = compile_grammar("json_schema", p.schema, model.guidance_tokenizer, model.n_vocab)
            events = list(engine.strategy("ar").generate(fmt.tokens(list(p.messages)),
                                                         GenParams(max_tokens=args.n, grammar=grammar)))
            done = events[-1]
            plain.append(done.stats.decode_seconds / max(done.stats.target_forwards, 1))
            tokens = list(done.tokens)
            logits = np.random.default_rng(0).standard_normal(model.n_vocab).astype(np.float32)
            c = grammar.start()
            for tok in tokens:
                row = logits.copy()
                t0 = time.perf_counter()
                c.apply(row)
                ours.append(time.perf_counter() - t0)
                c.commit(tok)
            # llama.cpp's sampler on its own GBNF for the schema (its JSON layout: the same compact separators
            # are allowed there, with optional whitespace).
            gbnf = json_schema_to_gbnf(json.dumps(p.schema))
            theirs += llama_cpp_costs(model, gbnf, tokens, logits)
            print(f"{p.category:9} {len(tokens):3} tokens: llguidance {statistics.median(ours[-len(tokens):]) * 1e6:7.0f} us, "
                  f"llama.cpp {statistics.median(theirs[-len(tokens):]) * 1e6:7.0f} us per token", file=sys.stderr)
    finally:
        engine.close()
    step = statistics.median(plain)
    for name, xs in (("llguidance (specchat)", ours), ("llama.cpp grammar sampler", theirs)):
        med = statistics.median(xs)
        print(f"{name:26} median {med * 1e6:7.0f} us/token, p90 {np.percentile(xs, 90) * 1e6:7.0f} us "
              f"({100 * med / step:.1f}% of a plain step of {step * 1e3:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
