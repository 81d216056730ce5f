"""A/B of `auto` variants against `ar` in one engine: each variant with its own learnt state, order rotated.

Not a test: the measurement behind the A/B figures in docs/results.md's notes on
`auto`. One engine runs `ar` and every variant on every prompt, after a
warm-up run, the configurations taking turns going first (as `specchat
bench` does), and each variant keeps its own learnt state across the whole
run (as one conversation or one bench run would), swapped in before each of
its runs. A variant is a name and `KEY=VALUE` settings, each either a field of
AutoConfig (`lookup=0`, `explore_budget=0.005`) or a module constant of
backends.strategies.auto (`TRY_DRAFT_MAX=2`), set for that variant's runs
only; `fresh=1` starts each of its runs from nothing learnt instead, as a
`specchat run` (a new process) does on a machine where nothing was kept. `ar` is also run a second time as a control (its ratio is the noise).

Prints, per variant, the median of the per-run ratios to `ar` in each prompt
category, their geometric mean and the lowest category, and the share of
target forwards by choice:

    python tests/perf/auto_ab.py --repeats 7 --variant base --variant plain-only:draft=0,lookup=0,lookahead=0 \\
        -- -m smollm2 -md smollm2-draft --prompts chat --limit 8 -n 128 -t 2 --temp 0.8 --seed 1
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import fields, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from app.bench.prompts import load_prompt_set  # noqa: E402
from app.bench.solo import BenchConfig  # noqa: E402
from app.bench.solo import _run as run_config  # noqa: E402
from app.cli import build_parser, settings_from_args  # noqa: E402
from app.commands.bench import bench_tokens  # noqa: E402
from app.loading import open_engine  # noqa: E402
from app.prompt_format import PromptFormat  # noqa: E402
from backends.config import AutoConfig  # noqa: E402
from backends.events import Done  # noqa: E402
from backends.registry import n_seq_needed  # noqa: E402
from backends.sampling import GenParams  # noqa: E402
from backends.strategies import auto as auto_module  # noqa: E402

AUTO_FIELDS = {f.name for f in fields(AutoConfig)}


def _typed(current: object, value: str) -> object:
    """`value` as the type of the setting it replaces (a bool from 0 or 1)."""
    return bool(int(value)) if isinstance(current, bool) else type(current)(value)


def parse_variant(text: str) -> tuple[str, dict[str, object], dict[str, object]]:
    """'name:k=v,k=v' -> (name, AutoConfig changes, module constants)."""
    name, _, spec = text.partition(":")
    config: dict[str, object] = {}
    constants: dict[str, object] = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key == "fresh":
            constants[key] = bool(int(value))
        elif key in AUTO_FIELDS:
            config[key] = _typed(getattr(AutoConfig(), key), value)
        elif key.isupper() and hasattr(auto_module, key):
            constants[key] = _typed(getattr(auto_module, key), value)
        else:
            raise SystemExit(f"auto_ab: {key!r} is neither an AutoConfig field nor a constant of the auto module")
    return name, config, constants


def main() -> int:
    if "--" not in sys.argv:
        raise SystemExit("usage: auto_ab.py [--repeats N] --variant NAME[:K=V,...] ... -- <specchat bench flags>")
    cut = sys.argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--variant", action="append", required=True, help="NAME[:KEY=VALUE,...] (repeatable)")
    args = parser.parse_args(sys.argv[1:cut])
    bench_args = build_parser().parse_args(["bench", *sys.argv[cut + 1:]])
    settings = settings_from_args(bench_args)
    variants = [parse_variant(v) for v in args.variant]
    defaults = {k: getattr(auto_module, k) for _, _, c in variants for k in c if k != "fresh"}
    engine = open_engine(settings, n_seq_needed("auto", settings.options), lambda m: print(m, file=sys.stderr))
    try:
        prompts = load_prompt_set(bench_args.prompts, bench_args.limit)
        tokenized = bench_tokens(PromptFormat(engine), prompts, bench_args.raw, settings.system_prompt)
        engine.device_cost()  # from the disk cache, or measured once now
        engine.learn_afresh()  # every variant starts from nothing learnt, whatever earlier sessions kept
        names = ["ar", "ar (control)", *(v[0] for v in variants)]
        states: dict[str, dict] = {v[0]: {} for v in variants}  # each variant's learnt states by sampling mode
        ratios = {n: {} for n in names}  # name -> category -> [ratio]
        mix = {n: {} for n in names}  # name -> choice -> forwards

        def run(name: str, tokens: list[int], params: GenParams) -> Done:
            """One run with fresh caches (the bench's own), as `ar` or as the variant `name` with its state."""
            if name.startswith("ar"):
                return run_config(engine, BenchConfig(name, "ar", settings.options), tokens, params)
            _, config, constants = next(v for v in variants if v[0] == name)
            engine.auto_states = {} if constants.get("fresh") else states[name]
            for k, v in {**defaults, **constants}.items():
                if k != "fresh":
                    setattr(auto_module, k, v)
            options = replace(settings.options, auto=replace(settings.options.auto, **config))
            done = run_config(engine, BenchConfig(name, "auto", options), tokens, params)
            states[name] = engine.auto_states
            return done

        p = settings.params
        warm = replace(p, max_tokens=min(16, p.max_tokens))
        for name in names:  # the warm-up, as the bench's: every configuration once on the first prompt
            run(name, tokenized[0], warm)
        for rep in range(args.repeats):
            for i, (prompt, tokens) in enumerate(zip(prompts, tokenized)):
                first = (rep * len(prompts) + i) % len(names)
                speed = {}
                for name in names[first:] + names[:first]:
                    done = run(name, tokens, p)
                    speed[name] = done.stats.tokens_per_second
                    for choice, n in done.stats.steps_by_choice.items():
                        mix[name][choice] = mix[name].get(choice, 0) + n
                for name in names:
                    ratios[name].setdefault(prompt.category, []).append(speed[name] / speed["ar"])
            print(f"repeat {rep + 1}/{args.repeats} done", file=sys.stderr, flush=True)
        cats = list(dict.fromkeys(pr.category for pr in prompts))
        print(f"{'':14}" + "".join(f"{c[:9]:>10}" for c in cats) + f"{'geomean':>10}{'lowest':>8}  forwards by choice")
        for name in names[1:]:
            med = [statistics.median(ratios[name][c]) for c in cats]
            geo = math.exp(sum(math.log(m) for m in med) / len(med))
            total = sum(mix[name].values()) or 1
            shares = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted(mix[name].items()))
            print(f"{name[:14]:14}" + "".join(f"{m:10.3f}" for m in med) + f"{geo:10.3f}{min(med):8.3f}  {shares}")
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
