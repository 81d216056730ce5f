"""`specchat bench --clients 1,2,4,8`: throughput and latency with many requests decoding together.

C clients each send the prompt set's requests one after another (a closed
loop, as a chat window, an editor and a script would), so at most C requests
decode at once, in one batch per step (backends.slot_pool.SlotPool, the server's
own scheduler, in process: no HTTP in the figures). For each client count and
each configuration (`ar` is plain batched decoding, the baseline), the run
reports the aggregate tokens per second (all output tokens over the wall
time), p50/p95 time to first token (from the moment a client sends to its
first token) and the median tokens per second of one request.

By default each prompt is one request: with as many clients as prompts that
is one wave, and its slowest request sets the end (a strategy that finishes
some requests early leaves the batch small at the end: measured, `auto` at 8
clients in one wave 0.91-0.96x `ar` while faster per step, docs/results.md).
`--requests N` sends N requests in all, the prompts in turn, so the clients
stay busy as a server's in steady use are.

Interleaved as the single-sequence bench is: within each repeat the client
counts and the configurations take turns going first, and each
configuration's aggregate is compared with `ar`'s at the same client count
in the same repeat (the ratio's median over repeats is the speedup). Every
run starts from empty caches (the slots' and the server's prompt cache,
backends.prompt_cache, which then serves the run's repeated prompts as the
server's would); `auto` starts from nothing learnt and learns
across the run. At temperature 0, outputs are compared with `ar`'s at the
same client count: llama.cpp is not batch-invariant, so a near-tie may flip;
the count of differing requests is reported, not hidden.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

from app.bench.solo import BenchConfig
from backends.engine import Engine
from backends.events import Done, Event, Prefilled, Token
from backends.sampling import GenParams
from backends.slot_pool import SlotPool


@dataclass
class LoadRun:
    """One configuration at one client count, one repeat: every request's figures."""

    seconds: float
    tokens: int
    ttft: list[float]
    per_request: list[float]
    outputs: list[tuple[int, ...]]
    forwards: int
    drafted: int
    accepted: int

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class LoadResult:
    config: BenchConfig
    clients: int
    runs: list[LoadRun] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)  # aggregate tok/s vs ar's, same clients and repeat
    differing: int = 0  # greedy outputs that differ from ar's at the same client count

    def summary(self) -> dict[str, object]:
        ttft = sorted(t for r in self.runs for t in r.ttft)
        agg = [r.tokens_per_second for r in self.runs]
        drafted = sum(r.drafted for r in self.runs)
        return {
            "label": self.config.label,
            "strategy": self.config.strategy,
            "clients": self.clients,
            "aggregate_tokens_per_second": round(statistics.median(agg), 3),
            "aggregate_min": round(min(agg), 3),
            "aggregate_max": round(max(agg), 3),
            "speedup_vs_ar": round(statistics.median(self.ratios), 4) if self.ratios else 1.0,
            "ttft_p50": round(_percentile(ttft, 50), 4),
            "ttft_p95": round(_percentile(ttft, 95), 4),
            "request_tokens_per_second": round(statistics.median(t for r in self.runs for t in r.per_request), 3),
            "tokens_per_forward": round(sum(r.tokens for r in self.runs) / max(sum(r.forwards for r in self.runs), 1),
                                        4),
            "acceptance_rate": round(sum(r.accepted for r in self.runs) / drafted, 4) if drafted else 0.0,
            "greedy_differing_requests": self.differing,
        }


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    k = (len(values) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def run_load(engine: Engine, config: BenchConfig, prompts: list[list[int]], params: GenParams,
             clients: int) -> LoadRun:
    """`clients` closed-loop clients share the requests (one each in turn); all of them from empty caches."""
    pool = SlotPool(engine)
    for slot in range(pool.size):
        pool.reset(slot)
    queue = list(range(len(prompts)))
    sent: dict[int, float] = {}
    first: dict[int, float] = {}
    dones: dict[int, Done] = {}

    def sink(i: int) -> Callable[[Event], None]:
        def take(event: Event) -> None:
            if isinstance(event, Token) and i not in first and event.kind != "rejected":
                first[i] = time.perf_counter()
            elif isinstance(event, Done):
                dones[i] = event
                first.setdefault(i, time.perf_counter())
            elif isinstance(event, Prefilled):
                pass
        return take

    t0 = time.perf_counter()
    while queue or len(pool):
        while queue and pool.running < clients:
            i = queue.pop(0)
            sent[i] = time.perf_counter()
            pool.admit(config.strategy, config.options, prompts[i], params, sink(i))
        pool.step()
    seconds = time.perf_counter() - t0
    failed = [d.error for d in dones.values() if d.reason == "error"]
    if failed or len(dones) != len(prompts):
        raise RuntimeError(f"{config.label} at {clients} clients: {failed[0] if failed else 'a request did not end'}")
    order = sorted(dones)
    return LoadRun(
        seconds=seconds,
        tokens=sum(d.stats.generated_tokens for d in dones.values()),
        ttft=[first[i] - sent[i] for i in order],
        per_request=[dones[i].stats.tokens_per_second for i in order],
        outputs=[dones[i].tokens for i in order],
        forwards=sum(d.stats.target_forwards for d in dones.values()),
        drafted=sum(d.stats.drafted for d in dones.values()),
        accepted=sum(d.stats.accepted for d in dones.values()),
    )


def run_load_bench(engine: Engine, configs: list[BenchConfig], prompts: list[list[int]], params: GenParams,
                   clients: list[int], repeats: int,
                   progress: Callable[[str], None] = lambda _m: None, rotate: int = 0) -> list[LoadResult]:
    """Every configuration at every client count, `repeats` times, interleaved (who goes first turns by one a
    repeat and client count, starting `rotate` turns on); `configs[0]` is `ar`."""
    assert configs and configs[0].strategy == "ar", "the baseline comes first"
    engine.learn_afresh()
    results = {(c.label, n): LoadResult(c, n) for n in clients for c in configs}
    warm = GenParams(max_tokens=min(8, params.max_tokens), temperature=params.temperature, seed=params.seed)
    for c in configs:
        run_load(engine, c, prompts[:max(clients)], warm, max(clients))
    total = repeats * len(clients) * len(configs)
    done = 0
    for rep in range(repeats):
        for ci in range(len(clients)):
            n = clients[(ci + rep) % len(clients)]
            first = (rep + ci + rotate) % len(configs)
            runs: dict[int, LoadRun] = {}
            for k in [*range(first, len(configs)), *range(first)]:
                c = configs[k]
                runs[k] = run = run_load(engine, c, prompts, params, n)
                results[(c.label, n)].runs.append(run)
                done += 1
                progress(f"[{done}/{total}] repeat {rep + 1}, {n} client{'s' * (n > 1)}, {c.label}: "
                         f"{run.tokens_per_second:.1f} tok/s in all")
            base = runs[0]
            for k, run in runs.items():
                res = results[(configs[k].label, n)]
                res.ratios.append(run.tokens_per_second / base.tokens_per_second if base.tokens_per_second else 0.0)
                if params.greedy and k:
                    res.differing += sum(a != b for a, b in zip(run.outputs, base.outputs))
    return list(results.values())


def format_load_table(rows: list[dict[str, object]]) -> str:
    head = (f"{'clients':>7}  {'configuration':32} {'tok/s in all':>12} {'vs ar':>6} {'TTFT p50':>9} "
            f"{'TTFT p95':>9} {'tok/s each':>10} {'tok/fwd':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['clients']:>7}  {str(r['label'])[:32]:32} {r['aggregate_tokens_per_second']:>12.1f} "
                     f"{r['speedup_vs_ar']:>5.2f}x {r['ttft_p50']:>8.3f}s {r['ttft_p95']:>8.3f}s "
                     f"{r['request_tokens_per_second']:>10.1f} {r['tokens_per_forward']:>7.2f}")
    return "\n".join(lines)
