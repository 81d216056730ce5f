"""The host's time a step, `ar` against `auto` held back by the realised check (not a test: a probe).

Where speculation does not pay, `auto` decodes plainly (backends.realised holds it back) and its steps should
cost what `ar`'s do; on a fast device (a small model on a GPU, docs/results.md "A GPU") the host's time around
llama_decode is a large share of a step, so each microsecond `auto` spends there beyond `ar`'s shows. This
runs both on one engine through the server's scheduler (tests/auto_helpers.pool_run), one request at a time,
in turns, on the tests' tiny GGUF (a decode of a few hundred microseconds), with a record that holds `auto`
back from the first step, and prints each run's host time a step (wall time less the time in llama_decode)
and its time in llama_decode, then the medians:

    python tests/perf/held_back_host.py --tokens 1000 --repeats 8 [--alone]

(`--alone`: each generation alone, as the chat app and `specchat run` run one: `auto` through a scheduler of one.)

(On that tiny model `auto`'s decodes also read ~10% slower than `ar`'s, identical one-row decodes of the same
cells: caches its host work leaves cold, by the look of it; on the 4-layer SmolLM2 cut they are equal.)
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
from backends.realised import Realised  # noqa: E402
from backends.sampling import GenParams  # noqa: E402
from backends.strategies.auto.state import AutoState  # noqa: E402


def losing() -> Realised:
    """A record in which speculating ticks at one sequence delivered half the plain ones' rate."""
    r = Realised()
    _ticks(r, 20, 1, False, 1, 0.01)
    _ticks(r, 20, 1, True, 1, 0.02)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1000, help="tokens a run (sampled at 0.8, end of text ignored)")
    ap.add_argument("--repeats", type=int, default=8, help="runs of each, in turns (who goes first alternates)")
    ap.add_argument("--alone", action="store_true",
                    help="each generation alone (Strategy.generate: `auto` through a scheduler of one, "
                         "backends.scheduler.Alone; `ar` through run_solo), not in a slot pool")
    args = ap.parse_args()
    path = Path(tempfile.mkdtemp(prefix="held-back-")) / "target.gguf"
    write_llama_gguf(path)
    engine = Engine(EngineConfig(target=path, n_ctx=2048, threads=1, n_seq_max=8, cost_cache=Path("")))
    engine._cost = DeviceCost(BatchCost(tuple(0.01 for _ in range(16))), 0.0)  # rows look free: only the check
    options = StrategyOptions(memory=False, auto=AutoConfig(draft=False, lookahead=False, explore_budget=0.0))
    params = GenParams(max_tokens=args.tokens, temperature=0.8, seed=1, ignore_eos=True)
    host: dict[str, list[float]] = {"ar": [], "auto": []}
    decode: dict[str, list[float]] = {"ar": [], "auto": []}
    try:
        prompt = _copying_prompt(engine)
        for rep in range(args.repeats):
            for strategy in ("ar", "auto") if rep % 2 == 0 else ("auto", "ar"):
                engine.auto_states = {mode: AutoState(learn_timing=True) for mode in ("greedy", "sampled")}
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
                print(f"{strategy:4} host {host[strategy][-1]:6.1f} µs a step, decode {decode[strategy][-1]:6.1f}")
    finally:
        engine.close()
    med = {s: statistics.median(v) for s, v in host.items()}
    print(f"median host µs a step: ar {med['ar']:.1f}, auto held back {med['auto']:.1f} "
          f"(+{med['auto'] - med['ar']:.1f}); decode: ar {statistics.median(decode['ar']):.1f}, "
          f"auto {statistics.median(decode['auto']):.1f}")


if __name__ == "__main__":
    main()
