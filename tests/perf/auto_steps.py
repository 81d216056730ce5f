"""What `auto` chose at every step of every answer of a prompt set, with one learnt state across them.

Not a test: a probe for reading where `auto`'s time goes. The engine (and so
`auto`'s learnt state) is kept across the answers and passes, as in `specchat
bench` and in a conversation, and each answer prints one line: its category,
tokens, tokens/s, and a character per target forward pass:

    .      a plain step
    L3     lookup chosen on its estimate, 3 of its tokens accepted
    D2     a draft chain, 2 accepted
    A0     a lookahead step, 0 accepted
    d[0:2/0]  a try (its estimate was stale), lower case: at the answer's
           token 0, 2 tokens drafted (lookahead: n-gram tokens verified), 0 accepted

The flags after `--` are `specchat bench`'s (model, prompt set, generation flags):

    python tests/perf/auto_steps.py --passes 3 -- -m smollm2 -md smollm2-draft --prompts chat --limit 8 -t 2 --temp 0
    python tests/perf/auto_steps.py -- -m demo -md demo-draft -n 128 -t 2 --temp 0.8 --seed 1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from app.bench.prompts import load_prompt_set  # noqa: E402
from app.cli import build_parser, settings_from_args  # noqa: E402
from app.commands.bench import bench_tokens  # noqa: E402
from app.loading import open_engine  # noqa: E402
from app.prompt_format import PromptFormat  # noqa: E402
from backends.events import Done, StepEnd  # noqa: E402
from backends.registry import n_seq_needed  # noqa: E402
from backends.strategies.auto.choose import TRYING  # noqa: E402

MARKS = {"plain": ".", "lookup": "L", "draft": "D", "lookahead": "A"}


def trace(events) -> tuple[str, Done]:
    """The step string of one answer, and its Done."""
    marks, position = [], 0
    for e in events:
        if isinstance(e, StepEnd):
            mark = MARKS.get(e.choice, "?")
            if (e.why or "").endswith(TRYING):
                marks.append(f"{mark.lower()}[{position}:{e.drafted}/{e.accepted}]")
            elif e.choice != "plain":
                marks.append(f"{mark}{e.accepted}")
            else:
                marks.append(mark)
            position += e.accepted + 1
        elif isinstance(e, Done):
            if e.reason == "error":
                raise SystemExit(f"auto_steps: {e.error}")
            return "".join(marks), e
    raise SystemExit("auto_steps: the generation ended without a Done event")


def bench_engine(bench_flags: list[str]):
    """`specchat bench`'s flags read: an engine for `auto` (learning afresh, as the bench starts, whatever earlier
    sessions kept), its settings, the prompt set and each prompt's tokens as the bench sends them."""
    bench_args = build_parser().parse_args(["bench", *bench_flags])
    settings = settings_from_args(bench_args)
    engine = open_engine(settings, n_seq_needed("auto", settings.options), lambda m: print(m, file=sys.stderr))
    try:
        engine.learn_afresh()
        prompts = load_prompt_set(bench_args.prompts, bench_args.limit)
        tokenized = bench_tokens(PromptFormat(engine), prompts, bench_args.raw, settings.system_prompt)
    except BaseException:
        engine.close()
        raise
    return engine, settings, prompts, tokenized


def main() -> int:
    if "--" not in sys.argv:
        raise SystemExit("usage: auto_steps.py [--passes N] -- <specchat bench flags>")
    cut = sys.argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=3, help="passes over the prompt set (default: 3)")
    args = parser.parse_args(sys.argv[1:cut])
    engine, settings, prompts, tokenized = bench_engine(sys.argv[cut + 1:])
    try:
        for n in range(args.passes):
            for prompt, tokens in zip(prompts, tokenized):
                engine.slots[0].reset()
                steps, done = trace(engine.strategy("auto", settings.options).generate(tokens, settings.params))
                s = done.stats
                print(f"{n + 1} {prompt.category:14} {s.generated_tokens:4d} {s.tokens_per_second:6.1f} tok/s  {steps}",
                      flush=True)
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
