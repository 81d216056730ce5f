"""Where `auto`'s time goes against `ar`'s, by kind of step (not a test: a probe).

`specchat bench` says how fast `auto` is against `ar` per category; when a
category reads under the bar, this says why. One engine runs `ar` and `auto`
on each chosen prompt in turn (who goes first alternates by pass), and every
target step of `auto`'s answers is timed from one StepEnd event to the next
and filed by its kind: plain, lookup, draft, lookahead, memory, with "~try"
for a try of an option its estimate called worse. Each kind's line is its
steps, its mean time and output tokens per step, the tokens it drafted per
step, and its net cost against `ar`: its time minus its tokens at `ar`'s mean
step time in the same run (negative: it saved time). `ar`'s own steps are
filed as "ar plain" (their net cost is their spread). The first pass is left
out of the kinds (it holds the early tries and the learning of a fresh
engine) but not out of the ratios. At temperature > 0 the target's draws are
fixed by the seed, so the two answers are the same text unless a draft
model's chain was verified (it samples with the run's generator).

Each strategy's answers are also split into the time inside llama_decode
and the host's time around it (a wrapper around LlamaContext.decode), with
the mean time of the target's one-row decodes (a plain step's decode):
what tells a strategy's own cost from the machine's. `--control` runs `ar`
a second time in each pass ("ar control"): its ratio and its one-row
decodes against `ar`'s are this machine's noise, measured beside the rest.

    python tests/perf/step_costs.py --passes 4 --categories explain,email -- \\
        -m smollm2-qwq.gguf -md smollm2-draft --prompts chat -n 192 --temp 0.8 --seed 1 -t 2

The flags after `--` are `specchat bench`'s (model, prompt set, generation flags).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from auto_steps import bench_engine  # noqa: E402
from backends import llama  # noqa: E402
from backends.events import Done, Prefilled, StepEnd  # noqa: E402
from backends.strategies.auto.choose import TRYING  # noqa: E402


class Step(collections.namedtuple("Step", "kind seconds tokens drafted")):
    """One target step of an answer: its kind, seconds since the step before, output tokens, drafted tokens."""


def timed_steps(events, clock: "DecodeClock | None" = None) -> tuple[list[Step], Done]:
    """An answer's steps after its first (the first's time holds the prompt), and its Done. With `clock`, its
    `answer` is set to the seconds spent in decodes between the prompt (Prefilled) and Done, the span of
    Done's decode_seconds."""
    steps, last = [], None
    for e in events:
        now = time.perf_counter()
        if isinstance(e, Prefilled) and clock is not None:
            clock.answer = -clock.seconds
        elif isinstance(e, StepEnd):
            if last is not None:
                kind = e.choice + ("~try" if (e.why or "").endswith(TRYING) else "")
                steps.append(Step(kind, now - last, e.accepted + 1, e.drafted))
            last = now
        elif isinstance(e, Done):
            if e.reason == "error":
                raise SystemExit(f"step_costs: {e.error}")
            if clock is not None:
                clock.answer += clock.seconds
            return steps, e
    raise SystemExit("step_costs: the generation ended without a Done event")


class DecodeClock:
    """Time inside LlamaContext.decode while installed: in all, and the target's one-row decodes apart."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.answer = 0.0  # of the last answer, after its prompt (timed_steps)
        self.one_row = [0, 0.0]  # the target's one-row decodes: count, seconds
        self.target: object = None  # the target's context
        self._decode = llama.LlamaContext.decode

    def __enter__(self) -> "DecodeClock":
        clock, decode = self, self._decode

        def timed(ctx, batch) -> None:  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            decode(ctx, batch)
            dt = time.perf_counter() - t
            clock.seconds += dt
            if ctx is clock.target and len(batch) == 1:
                clock.one_row[0] += 1
                clock.one_row[1] += dt

        llama.LlamaContext.decode = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *_exc: object) -> None:
        llama.LlamaContext.decode = self._decode  # type: ignore[method-assign]


def by_kind(steps: list[Step], t_ar: float) -> list[str]:
    """One line per kind, dearest first: steps, ms a step, tokens a step, drafted a step, net ms against ar."""
    kinds: dict[str, list[Step]] = collections.defaultdict(list)
    for s in steps:
        kinds[s.kind].append(s)
    lines = []
    for kind, group in sorted(kinds.items(), key=lambda kv: -sum(s.seconds for s in kv[1])):
        n, seconds, tokens = len(group), sum(s.seconds for s in group), sum(s.tokens for s in group)
        lines.append(f"{kind:14} steps {n:5d}  ms/step {1e3 * seconds / n:6.2f}  tok/step {tokens / n:5.2f}  "
                     f"drafted/step {sum(s.drafted for s in group) / n:5.2f}  net vs ar "
                     f"{1e3 * (seconds - tokens * t_ar):+8.1f} ms")
    return lines


def main() -> int:
    if "--" not in sys.argv:
        raise SystemExit("usage: step_costs.py [--passes N] [--categories A,B] -- <specchat bench flags>")
    cut = sys.argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=4, help="passes over the chosen prompts (default: 4)")
    parser.add_argument("--categories", default="", help="comma-separated categories (default: every one)")
    parser.add_argument("--control", action="store_true", help="run `ar` twice a pass: the machine's noise")
    args = parser.parse_args(sys.argv[1:cut])
    engine, settings, prompts, tokenized = bench_engine(sys.argv[cut + 1:])
    try:
        wanted = set(filter(None, args.categories.split(",")))
        chosen = [(p, t) for p, t in zip(prompts, tokenized) if not wanted or p.category in wanted]
        if not chosen:
            raise SystemExit(f"step_costs: no prompt of the categories {sorted(wanted)}")
        runs = ["ar", "auto"] + (["ar control"] if args.control else [])
        steps: dict[str, list[Step]] = {"ar": [], "auto": [], "ar control": []}
        ratios: dict[str, list[float]] = collections.defaultdict(list)
        split = {run: collections.Counter() for run in runs}  # after the first pass: seconds, decode, one-row
        clock = DecodeClock()
        clock.target = engine.slots[0].target.ctx
        with clock:
            for n in range(args.passes):
                for prompt, tokens in chosen:
                    speed = {}
                    for run in runs[n % len(runs):] + runs[:n % len(runs)]:
                        engine.slots[0].reset()
                        before = clock.one_row[:]
                        answer, done = timed_steps(engine.strategy(run.split()[0], settings.options).generate(
                            tokens, settings.params), clock)
                        speed[run] = done.stats.generated_tokens / max(done.stats.decode_seconds, 1e-9)
                        if n > 0:
                            steps[run].extend(answer)
                            got = split[run]
                            got["tokens"] += done.stats.generated_tokens
                            got["seconds"] += done.stats.decode_seconds
                            got["decode"] += clock.answer
                            got["one_row"] += clock.one_row[0] - before[0]
                            got["one_row_seconds"] += clock.one_row[1] - before[1]
                    ratios[prompt.category].append(speed["auto"] / speed["ar"])
                    if args.control:
                        ratios[prompt.category + " (control)"].append(speed["ar control"] / speed["ar"])
                    print(f"{n + 1} {prompt.category:12} " + "  ".join(f"{r} {speed[r]:6.1f} tok/s" for r in runs)
                          + f"  ratio {speed['auto'] / speed['ar']:.3f}", flush=True)
    finally:
        engine.close()
    if not steps["ar"]:
        raise SystemExit("step_costs: one pass only; the kinds need a second (the first is left out)")
    t_ar = sum(s.seconds for s in steps["ar"]) / sum(s.tokens for s in steps["ar"])
    print(f"ar: {1e3 * t_ar:.2f} ms a token over its steps after the first pass")
    for line in by_kind([s._replace(kind="ar " + s.kind) for s in steps["ar"]] + steps["auto"], t_ar):
        print(line)
    for run, got in split.items():
        tokens = max(got["tokens"], 1)
        host = got["seconds"] - got["decode"]
        print(f"{run:12} ms a token {1e3 * got['seconds'] / tokens:6.2f}: host {1e3 * host / tokens:5.2f}"
              f"  one-row target decodes {1e3 * got['one_row_seconds'] / max(got['one_row'], 1):6.2f} ms"
              f" x {got['one_row']}")
    for category, r in ratios.items():
        print(f"{category:12} auto / ar median {statistics.median(r):.3f}  ({' '.join(f'{x:.2f}' for x in r)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
