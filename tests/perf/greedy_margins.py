"""How close the target's greedy choices come to a tie along an answer. Not a test.

Why: at temperature 0 every strategy must give the target's greedy tokens,
and the tests compare answers token for token. But llama.cpp's arithmetic is
not batch-invariant: a row decoded in a verification batch (or beside other
sequences) gets logits a few last bits away from the same row decoded alone,
so where the top two logits are closer than that noise, greedy argmax may
rightly flip and the two answers part there. A test that compares greedy runs
whose batch shapes follow live timings (`auto`, a tree's `auto` budget, a
server's slots) fails now and then on such a near-tie: a clean-clone CI run
did, at the 14th token of tests/test_serve_reasoning.py's budget-0 answer.
This measures the risk instead of guessing it: for each prompt it decodes the
greedy answer plainly (`ar`) and reports the smallest top-1/top-2 logit gap
along it and at which output token, and how many of the first tokens are
chosen by more than the noise (`engine_helpers.near_tie`, the prefix a test
can compare exactly). With `--noise` it also decodes the answer once more in
one batch with every row's logits and reports the largest logit difference to
the one-row pass: the batch noise of this model on this machine.

The gaps come from tests/engine_helpers.greedy_gaps, which tests call at run
time (`assert_greedy_agrees`, `min_greedy_gap`). A model is a GGUF path or
an alias (`smollm2`, `demo`); `--chat` sends each prompt as one user message
through the model's chat template (as `specchat run` and the server do),
`--template FILE` with another template instead (as tests/conftest.py's
thinking models are the SmolLM2 file re-packed), `--kwargs JSON` the
template's variables (`{"enable_thinking": false}`); `--json-schema FILE`
decodes under that schema, and a gap is then to the best token it allows.

    python tests/perf/greedy_margins.py -m demo -n 48 "Once upon a time, in a small village," "def fibonacci(n):\\n"
    python tests/perf/greedy_margins.py -m smollm2 --chat -n 64 --noise "Explain in two sentences why the sky is blue."
    python tests/perf/greedy_margins.py -m /tmp/tiny/target.gguf -n 48 --gaps "the cat sat on the mat"
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from app.bench.greedy import greedy_gaps, plain_pass_noise  # noqa: E402
from app.chat_template import ChatMessage  # noqa: E402
from app.loading import quantize  # noqa: E402
from app.prompt_format import PromptFormat  # noqa: E402
from backends.engine import Engine, EngineConfig  # noqa: E402
from backends.grammar import compile_grammar  # noqa: E402
from backends.sampling import GenParams  # noqa: E402
from engine_helpers import BATCH_NOISE, near_tie, run_to_done  # noqa: E402
from models.resolve import resolve_model  # noqa: E402




def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prompts", nargs="+")
    ap.add_argument("-m", "--model", required=True, help="a GGUF path or an alias (smollm2, demo)")
    ap.add_argument("-n", type=int, default=48, help="answer length in tokens (the test's max_tokens)")
    ap.add_argument("--chat", action="store_true", help="one user message through the chat template")
    ap.add_argument("--system", default="", help="a system prompt (with --chat)")
    ap.add_argument("--template", type=Path, help="render with this jinja template instead of the file's")
    ap.add_argument("--kwargs", default="{}", help="the template's variables, as JSON")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--json-schema", type=Path, help="decode under this JSON schema (gaps among what it allows)")
    ap.add_argument("--threshold", type=float, default=BATCH_NOISE,
                    help=f"a gap at or below this is a near-tie (default BATCH_NOISE, {BATCH_NOISE})")
    ap.add_argument("--noise", action="store_true", help="also measure the batch noise along each answer")
    ap.add_argument("--gaps", action="store_true", help="print every gap")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="one JSON line per prompt")
    args = ap.parse_args()

    path = resolve_model(args.model, lambda msg: print(msg, file=sys.stderr), quantize)
    engine = Engine(EngineConfig(target=path, n_ctx=4096, threads=args.threads, cost_cache=Path(""), memory=False))
    try:
        fmt = PromptFormat(engine)
        if args.template is not None:
            fmt.template = args.template.read_text()
        for text in args.prompts:
            text = text.replace("\\n", "\n")  # a newline typed as \n
            prompt = (fmt.tokens([ChatMessage("user", text)], args.system, kwargs=json.loads(args.kwargs))
                      if args.chat or args.template else engine.tokenize(text))
            grammar = None if args.json_schema is None else compile_grammar(
                "json_schema", json.loads(args.json_schema.read_text()), engine.target_model.guidance_tokenizer,
                engine.target_model.n_vocab)
            done = run_to_done(engine, "ar", prompt, GenParams(max_tokens=args.n, ignore_eos=args.ignore_eos,
                                                               grammar=grammar))
            tokens = done.tokens
            gaps = greedy_gaps(engine, prompt, tokens, grammar)
            at = int(np.argmin(gaps))
            row = {"prompt": text, "prompt_tokens": len(prompt), "tokens": len(tokens), "reason": done.reason,
                   "min_gap": round(gaps[at], 6), "at": at, "safe_prefix": near_tie(gaps, args.threshold),
                   "near_ties": sum(g <= args.threshold for g in gaps)}
            if args.noise:
                row["noise"], row["argmax_flips"] = plain_pass_noise(engine, prompt, tokens)
            if args.json:
                print(json.dumps(row))
            else:
                print(f"{text!r}: {row['tokens']} tokens ({row['reason']}), smallest gap {row['min_gap']:.6f} at "
                      f"output token {at} ({engine.target_model.token_text(tokens[at])!r}); "
                      f"{row['near_ties']} at or under {args.threshold:g}, the first at {row['safe_prefix']}"
                      + (f"; batch noise {row['noise']:.2e}, argmax flips {row['argmax_flips']}" if args.noise else ""))
            if args.gaps:
                print("  " + " ".join(f"{g:.4f}" for g in gaps))
    finally:
        engine.close()


if __name__ == "__main__":
    main()
