"""`auto` over time while the machine changes under it (not a test: a measurement).

Issue 42 asks that `auto` follow a machine whose other programs come and go:
with a draft as dear as the target it stops drafting within seconds of load,
and after a busy program stops it drafts again where that pays. The matrix
(machine_matrix.py) holds each condition for a whole run; this changes the
condition in the middle of one. One engine, `--clients` closed-loop clients
over the chat prompts (the server's scheduler, backends.slot_pool.SlotPool, in
process), and the run in phases: quiet, a busy loop on one core (as another
program on the user's laptop), quiet again. Within each phase `auto` and `ar`
take turns in blocks of `--block` requests (each block drained before the
next, so a block's time is its strategy's alone), `auto` keeping what it
learnt across the whole run as a server does. Every `auto` step is filed by
the time since load and what it verified (StepEnd.choice), so the table says
when drafting stopped and started again, and each block pair gives `auto`'s
tokens per second against the `ar` block beside it.

    python tests/perf/auto_timeline.py -md smollm2-draft --clients 4 --phases quiet:40,busy:40,quiet:40
    python tests/perf/auto_timeline.py -md smollm2 --clients 4 --phases quiet:30   # the F32 draft: the target itself
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "perf"))

from app.bench.prompts import load_prompt_set  # noqa: E402
from app.cli import build_parser, settings_from_args  # noqa: E402
from app.commands.bench import bench_tokens  # noqa: E402
from app.commands.serve import COST_ROWS_MAX  # noqa: E402
from app.loading import open_engine  # noqa: E402
from app.prompt_format import PromptFormat  # noqa: E402
from backends.config import AUTO_K_MAX, StrategyOptions  # noqa: E402
from backends.events import Done, Event, StepEnd, Token  # noqa: E402
from backends.registry import n_seq_needed  # noqa: E402
from backends.slot_pool import SlotPool  # noqa: E402
from backends.strategies.auto.decide import PLAIN  # noqa: E402  StepEnd.choice of a step that drafted nothing
from machine_matrix import hog  # noqa: E402
from matrix_record import runs_text  # noqa: E402


@dataclass
class Block:
    """One strategy's block of requests: its time, its tokens, and (for auto) its steps by what they verified."""

    phase: str
    strategy: str
    start: float  # seconds since load
    seconds: float = 0.0
    tokens: int = 0
    steps: dict[str, int] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def run_block(pool: SlotPool, strategy: str, options: StrategyOptions, prompts: list[list[int]], params,
              clients: int, block: Block, steps: list[tuple[float, str]], t_load: float) -> None:
    """`len(prompts)` requests over `clients` closed-loop clients, drained; auto's steps filed by time."""
    queue = list(range(len(prompts)))
    ended: list[Done] = []

    def sink(event: Event) -> None:
        if isinstance(event, Token) and event.kind != "rejected":
            block.tokens += 1
        elif isinstance(event, StepEnd) and strategy == "auto":
            choice = event.choice or PLAIN
            block.steps[choice] = block.steps.get(choice, 0) + 1
            steps.append((time.perf_counter() - t_load, choice))
        elif isinstance(event, Done):
            ended.append(event)

    t0 = time.perf_counter()
    while queue or len(pool):
        while queue and pool.running < clients:
            pool.admit(strategy, options, prompts[queue.pop(0)], params, sink)
        pool.step()
    block.seconds = time.perf_counter() - t0
    failed = [d.error for d in ended if d.reason == "error"]
    if failed:
        raise RuntimeError(f"{strategy}: {failed[0]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", default="smollm2")
    ap.add_argument("-md", default="smollm2-draft")
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--block", type=int, default=0, help="requests per block (default: twice the clients)")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--temp", type=float, default=0.8)
    ap.add_argument("--phases", default="quiet:40,busy:40,quiet:40",
                    help="NAME:SECONDS,...; a phase named busy runs a busy loop on one core beside the engine")
    ap.add_argument("--window", type=float, default=5.0, help="seconds per line of auto's step timeline")
    args = ap.parse_args()
    phases = [(name, float(s)) for name, s in (p.split(":") for p in args.phases.split(","))]
    block_n = args.block or 2 * args.clients

    cli = build_parser().parse_args(["bench", "-m", args.m, "-md", args.md, "-t", str(args.t), "--temp",
                                     str(args.temp), "--seed", "1", "-n", str(args.n), "--no-memory"])
    settings = settings_from_args(cli)
    t_load = time.perf_counter()
    # Room for every sequence id `auto` may use (lookahead's window), in each slot, as the load bench opens it.
    engine = open_engine(settings, n_seq_needed("auto", settings.options), lambda m: print(m, file=sys.stderr),
                         n_parallel=args.clients)
    chat = load_prompt_set("chat", 8)
    prompts = bench_tokens(PromptFormat(engine), chat, False, "")
    # As `specchat serve` does with more than one slot: the device's cost measured at start (the seed the live
    # curve then moves from), so that the time since load includes it.
    engine.measure_now(engine.tokenize("The quick brown fox jumps over the lazy dog."),
                       min(settings.n_batch, max(AUTO_K_MAX, COST_ROWS_MAX)))
    print(f"loaded and measured in {time.perf_counter() - t_load:.1f} s", file=sys.stderr)
    pool = SlotPool(engine)
    params = settings.params
    blocks: list[Block] = []
    steps: list[tuple[float, str]] = []
    bounds: list[tuple[str, float, float]] = []
    k = 0
    try:
        for name, seconds in phases:
            busy = hog() if name == "busy" else None
            start = time.perf_counter() - t_load
            try:
                turn = 0
                while time.perf_counter() - t_load - start < seconds:
                    for strategy in (("auto", "ar") if turn % 2 == 0 else ("ar", "auto")):
                        batch = [prompts[(k + i) % len(prompts)] for i in range(block_n)]
                        b = Block(name, strategy, time.perf_counter() - t_load)
                        run_block(pool, strategy, settings.options, batch, params, args.clients, b, steps, t_load)
                        blocks.append(b)
                        print(f"{b.start:6.1f} s  {name:6} {strategy:5} {b.rate:6.1f} tok/s  "
                              + " ".join(f"{c} {n}" for c, n in sorted(b.steps.items())), file=sys.stderr)
                    k += block_n
                    turn += 1
            finally:
                if busy is not None:
                    busy.kill()
            bounds.append((name, start, time.perf_counter() - t_load))
    finally:
        engine.close()

    print(f"\n{args.clients} clients, draft {args.md}, -t {args.t}, temp {args.temp:g}, blocks of {block_n} "
          f"requests of {args.n} tokens\n")
    print("| phase | from, s | to, s | `auto` / `ar` (median of block pairs) | by pair "
          "| `auto`'s steps: speculating / all |")
    print("|---|---:|---:|---:|---|---:|")
    for i, (name, start, end) in enumerate(bounds):
        mine = [b for b in blocks if start <= b.start < end]
        autos, ars = [b for b in mine if b.strategy == "auto"], [b for b in mine if b.strategy == "ar"]
        pairs = [a.rate / r.rate for a, r in zip(autos, ars) if r.rate]
        spec = sum(n for b in autos for c, n in b.steps.items() if c != PLAIN)
        total = sum(n for b in autos for n in b.steps.values())
        print(f"| {i + 1}. {name} | {start:.0f} | {end:.0f} | "
              f"{statistics.median(pairs) if pairs else float('nan'):.2f} | {runs_text(pairs)} "
              f"| {spec} / {total} |")
    print(f"\n`auto`'s steps by {args.window:g} s of the run (time since load): speculating / all, and what they "
          "verified\n")
    print("| from, s | phase | speculating / all | by choice |")
    print("|---:|---|---:|---|")
    if steps:
        w = args.window
        for lo in [w * i for i in range(int(steps[-1][0] // w) + 1)]:
            inside = [c for t, c in steps if lo <= t < lo + w]
            if not inside:
                continue
            phase = next((n for n, s, e in reversed(bounds) if s <= lo), bounds[0][0])
            counts: dict[str, int] = {}
            for c in inside:
                counts[c] = counts.get(c, 0) + 1
            spec = sum(n for c, n in counts.items() if c != PLAIN)
            print(f"| {lo:.0f} | {phase} | {spec} / {len(inside)} | "
                  + ", ".join(f"{c} {n}" for c, n in sorted(counts.items())) + " |")


if __name__ == "__main__":
    main()
