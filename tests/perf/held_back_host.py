"""The host's time a step, `ar` against `auto` held back by the realised check (not a test: a probe).

Where speculation does not pay, `auto` decodes plainly (backends.realised holds it back) and its steps should
cost what `ar`'s do; on a fast device (a small model on a GPU, docs/results.md "A GPU") the host's time around
llama_decode is a large share of a step, so each microsecond `auto` spends there beyond `ar`'s shows. This
runs both on one engine through the server's scheduler (tests/auto_helpers.pool_run), one request at a time,
in turns, on the tests' tiny GGUF (a decode of a few hundred microseconds), with a record that holds `auto`
back from the first step, and prints each run's host time a step (wall time less the time in llama_decode)
and its time in llama_decode a token, then the medians, and the decode time split: the median one-row decode
(a plain step's), and the multi-row decodes a token (the probes `auto` makes held back, backends.realised):

    python tests/perf/held_back_host.py --tokens 1000 --repeats 8 [--alone] [--model M.gguf --threads 2] \
        [--measured-cost] [--probe-share 1e9]

(`--alone`: each generation alone, as the chat app and `specchat run` run one: `auto` through a scheduler of one.
`--measured-cost`: price rows with the device's measured cost, as a real engine does; by default every row looks
free, so that the check alone holds `auto` back, and its probes verify the largest trees they may.)

(`auto`'s time in llama_decode a token read above `ar`'s on the tiny model by a tenth: not its one-row decodes,
which take what `ar`'s take, but its probes, a 13-row tree every 128 ticks at 12 times a plain step's cost there,
since rows look free; now they are spaced by what they cost, backends.realised.PROBE_SHARE, and `--probe-share 1e9`
spaces them as before.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]

from auto_helpers import pool_run, recorded  # noqa: E402
from gguf_factory import write_llama_gguf  # noqa: E402
from test_lossless import _copying_prompt  # noqa: E402
from test_realised import _ticks  # noqa: E402

from backends.config import AutoConfig, StrategyOptions  # noqa: E402
from backends.device_cost import BatchCost, DeviceCost  # noqa: E402
from backends.engine import Engine, EngineConfig  # noqa: E402
from backends import realised  # noqa: E402
from backends.realised import Realised  # noqa: E402
from backends.sampling import GenParams  # noqa: E402
from backends.strategies.auto.state import AutoState  # noqa: E402


# Only the check holds `auto` back: no draft, no lookahead, no exploration, no memory.
OPTIONS = StrategyOptions(memory=False, auto=AutoConfig(draft=False, lookahead=False, explore_budget=0.0))


def rows_look_free(engine: Engine) -> None:
    """A device cost on which every row is nearly free: the cost model never holds `auto` back, the check does."""
    engine._cost = DeviceCost(BatchCost(tuple(0.01 for _ in range(16))), 0.0)


def losing() -> Realised:
    """A record in which speculating ticks at one sequence delivered half the plain ones' rate."""
    r = Realised()
    _ticks(r, 20, 1, False, 1, 0.01)
    _ticks(r, 20, 1, True, 1, 0.02)
    r._last_speculated.clear()  # these ticks' times are not the model's: the first probe's cost spaces the next
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1000, help="tokens a run (sampled at 0.8, end of text ignored)")
    ap.add_argument("--repeats", type=int, default=8, help="runs of each, in turns (who goes first alternates)")
    ap.add_argument("--alone", action="store_true",
                    help="each generation alone (Strategy.generate: `auto` through a scheduler of one, "
                         "backends.scheduler.Alone; `ar` through run_solo), not in a slot pool")
    ap.add_argument("--model", type=Path, help="a GGUF to run instead of the tiny one (e.g. the 4-layer SmolLM2 cut, "
                    "tests/perf/cut_layers.py: a step as fast as the H200's)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--measured-cost", action="store_true", help="rows priced by the device's measured cost")
    ap.add_argument("--probe-share", type=float, default=realised.PROBE_SHARE,
                    help="backends.realised.PROBE_SHARE (1e9: a probe every STALE ticks whatever it costs, as before "
                         "probes were spaced by their cost)")
    args = ap.parse_args()
    realised.PROBE_SHARE = args.probe_share
    path = args.model
    if path is None:
        path = Path(tempfile.mkdtemp(prefix="held-back-")) / "target.gguf"
        write_llama_gguf(path)
    engine = Engine(EngineConfig(target=path, n_ctx=2048, threads=args.threads, n_seq_max=8, cost_cache=Path("")))
    if not args.measured_cost:
        rows_look_free(engine)
    one_row: dict[str, list[float]] = {"ar": [], "auto": []}
    multi: dict[str, list[float]] = {"ar": [], "auto": []}
    timed: list[tuple[int, float]] = []  # (rows, seconds) of each target decode of the run
    lane_decode = engine.target_lane.decode

    def timed_decode(requests):  # type: ignore[no-untyped-def]
        before = engine.target_lane.seconds
        rows = lane_decode(requests)
        timed.append((sum(map(len, requests)), engine.target_lane.seconds - before))
        return rows

    engine.target_lane.decode = timed_decode  # type: ignore[method-assign]
    options = OPTIONS
    params = GenParams(max_tokens=args.tokens, temperature=0.8, seed=1, ignore_eos=True)
    host: dict[str, list[float]] = {"ar": [], "auto": []}
    decode: dict[str, list[float]] = {"ar": [], "auto": []}
    try:
        prompt = _copying_prompt(engine)
        if args.measured_cost:
            engine.measure_now(prompt)
        for rep in range(args.repeats):
            for strategy in ("ar", "auto") if rep % 2 == 0 else ("auto", "ar"):
                engine.auto_states = {mode: AutoState(learn_timing=True) for mode in ("greedy", "sampled")}
                timed.clear()
                d0, t0 = engine.target_lane.seconds, time.perf_counter()
                if args.alone:
                    recorded(engine, losing())  # what every scheduler of the engine, one alone too, reads
                    for _ in engine.strategy(strategy, options).generate(prompt, params):
                        pass
                else:
                    pool_run(engine, [(strategy, prompt)], params, options, losing())
                wall, inside = time.perf_counter() - t0, engine.target_lane.seconds - d0
                host[strategy].append((wall - inside) / args.tokens * 1e6)
                decode[strategy].append(inside / args.tokens * 1e6)
                ones = [t for n, t in timed if n == 1]
                one_row[strategy].append(statistics.median(ones) * 1e6 if ones else 0.0)
                multi[strategy].append(sum(t for n, t in timed if n > 1) / args.tokens * 1e6)
                print(f"{strategy:4} host {host[strategy][-1]:6.1f} µs a step, decode {decode[strategy][-1]:6.1f} "
                      f"(one-row {one_row[strategy][-1]:6.1f}, multi-row {multi[strategy][-1]:5.1f} a token in "
                      f"{sum(1 for n, _ in timed if n > 1)} decodes)")
    finally:
        engine.close()
    med = {s: statistics.median(v) for s, v in host.items()}
    print(f"median host µs a step: ar {med['ar']:.1f}, auto held back {med['auto']:.1f} "
          f"(+{med['auto'] - med['ar']:.1f}); decode: ar {statistics.median(decode['ar']):.1f}, "
          f"auto {statistics.median(decode['auto']):.1f}; one-row decode: ar {statistics.median(one_row['ar']):.1f}, "
          f"auto {statistics.median(one_row['auto']):.1f}; multi-row a token: ar {statistics.median(multi['ar']):.1f}, "
          f"auto {statistics.median(multi['auto']):.1f}")


if __name__ == "__main__":
    main()
