"""What a new session of `auto` gains from what earlier ones kept (Learnt.keep). Not a test.

`processes`: whole `specchat run` processes, as a user runs them, on the
chat set through the instruct pair's template: `ar`, `auto` with a learnt
store that one pass over the prompts filled first, and `auto` with none
(its learnt file removed before each run), the three rotated per prompt and
round; ratios to `ar` of the same prompt and round, median per category.
Each store is a folder of its own (SPECCHAT_COST_CACHE), the device cost
copied from the kept one so both decide with the same curve.

    python tests/perf/auto_kept.py processes --rounds 3 -- \\
        -m smollm2 -md smollm2-draft --prompts chat --limit 8 -n 128 -t 2 --temp 0.8 --seed 1

`modes`: in one engine, one-off runs (each from a copy of its starting
state) at the bench flags' temperature, starting from a state learnt over
one pass of the prompt set greedily, one learnt at that temperature, and
none: what keeping a state per sampling mode is for.

    python tests/perf/auto_kept.py modes --rounds 3 -- -m demo -md demo-draft -n 128 -t 2 --temp 0.8 --seed 1
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from app.bench.prompts import load_prompt_set  # noqa: E402
from app.bench.solo import BenchConfig  # noqa: E402
from app.bench.solo import _run as run_config  # noqa: E402
from app.cli import build_parser  # noqa: E402
from auto_steps import bench_engine  # noqa: E402
from backends.strategies.auto.state import AutoState, sampling_mode  # noqa: E402


def report(ratios: dict[str, dict[str, list[float]]]) -> None:
    for name, cats in ratios.items():
        med = {c: round(statistics.median(v), 3) for c, v in cats.items()}
        every = [x for v in cats.values() for x in v]
        print(f"{name:12} median of all runs {statistics.median(every):.3f}  lowest category "
              f"{min(med.values()):.3f}  {med}")


def processes(rounds: int, flags: list[str]) -> None:
    args = build_parser().parse_args(["bench", *flags])
    prompts = load_prompt_set(args.prompts, args.limit)
    model = ["-m", args.model] + (["-md", args.model_draft] if args.model_draft else [])
    run_flags = [*model, "-n", str(args.max_tokens), "-t", str(args.threads or 2), "--temp", str(args.temp),
                 "--seed", str(args.seed if args.seed is not None else 1), "--json"]
    root = Path(tempfile.mkdtemp(prefix="auto-kept-"))
    kept, none = root / "kept", root / "none"
    kept.mkdir()
    none.mkdir()

    def run(strategy: str, store: Path, text: str) -> float:
        env = dict(os.environ, SPECCHAT_COST_CACHE=str(store / "device-cost.json"))
        out = subprocess.run(["specchat", "run", text, "-s", strategy, *run_flags], env=env, capture_output=True,
                             text=True, check=True).stdout
        return float(json.loads(out.strip().splitlines()[-1])["stats"]["tokens_per_second"])

    try:
        for p in prompts:  # a user's earlier runs
            run("auto", kept, p.text)
        shutil.copy(kept / "device-cost.json", none / "device-cost.json")
        ratios: dict[str, dict[str, list[float]]] = {"kept": {}, "none": {}}
        configs = [("ar", kept, "ar"), ("auto", kept, "kept"), ("auto", none, "none")]
        for r in range(rounds):
            for i, p in enumerate(prompts):
                (none / "learnt.json").unlink(missing_ok=True)
                first = (r + i) % len(configs)
                speed = {name: run(s, store, p.text) for s, store, name in configs[first:] + configs[:first]}
                for name in ratios:
                    ratios[name].setdefault(p.category, []).append(speed[name] / speed["ar"])
                print(r + 1, p.category, {k: round(v, 1) for k, v in speed.items()}, file=sys.stderr, flush=True)
        report(ratios)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def modes(rounds: int, flags: list[str]) -> None:
    engine, settings, prompts, tokenized = bench_engine(flags)
    try:
        params = settings.params
        auto = BenchConfig("auto", "auto", settings.options)

        def learn(p) -> AutoState:
            engine.auto_states.clear()
            for tokens in tokenized:
                run_config(engine, auto, tokens, p)
            return engine.auto_states[sampling_mode(p)]  # type: ignore[return-value]

        start = {"from greedy": learn(replace(params, temperature=0.0)), "from same": learn(params),
                 "from none": AutoState()}
        names = ["ar", *start]
        ratios: dict[str, dict[str, list[float]]] = {n: {} for n in start}
        for r in range(rounds):
            for i, (prompt, tokens) in enumerate(zip(prompts, tokenized)):
                first = (r + i) % len(names)
                speed = {}
                for name in names[first:] + names[:first]:
                    if name != "ar":
                        engine.auto_states[sampling_mode(params)] = copy.deepcopy(start[name])
                    config = auto if name != "ar" else BenchConfig("ar", "ar", settings.options)
                    speed[name] = run_config(engine, config, tokens, params).stats.tokens_per_second
                for name in start:
                    ratios[name].setdefault(prompt.category, []).append(speed[name] / speed["ar"])
            print(f"round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
        report(ratios)
    finally:
        engine.close()


def main() -> int:
    if "--" not in sys.argv:
        raise SystemExit("usage: auto_kept.py {processes,modes} [--rounds N] -- <specchat bench flags>")
    cut = sys.argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["processes", "modes"])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(sys.argv[1:cut])
    (processes if args.what == "processes" else modes)(args.rounds, sys.argv[cut + 1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
