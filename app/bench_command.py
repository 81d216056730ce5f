"""`specchat bench`: builds the configurations, runs app.bench, writes the table, JSON and PNG."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import replace
from pathlib import Path
from typing import Callable

from app.bench import BenchConfig, format_table, measure_costs, print_progress, run_bench
from app.bench_plot import write_plot
from app.render import strategy_label
from app.prompt_sets import load_prompt_set
from backends.engine import NEEDS_DRAFT, STRATEGIES, Engine, StrategyOptions, n_seq_needed
from backends.llama import default_threads
from backends.sampling import GenParams

SWEEP_SPS = [(k, p) for k in (2, 3, 4, 6, 8) for p in (0.0, 0.4)]
SWEEP_LOOKAHEAD = [(2, 3, 2), (3, 3, 2), (4, 3, 4), (2, 4, 2), (8, 4, 8), (15, 5, 15)]
SWEEP_LOOKUP = [(4, 3), (10, 3), (16, 3), (10, 2)]
# (depth, top_k, nodes, shape): nodes "auto" picks M per step from the measured cost curve.
SWEEP_TREE = [(3, 2, 6, "dynamic"), (5, 2, 10, "dynamic"), (4, 3, 12, "dynamic"), (6, 2, 12, "dynamic"),
              (4, 2, "auto", "dynamic"), (5, 3, "auto", "dynamic"), (6, 4, 12, "static"), (8, 4, "auto", "static")]


def build_configs(names: list[str], options: StrategyOptions, sweep: bool) -> list[BenchConfig]:
    configs = [BenchConfig("ar", "ar")]
    for name in names:
        if name == "ar":
            continue
        grid = [options]
        if sweep and name == "sps":
            grid += [replace(options, sps=replace(options.sps, draft_max=k, p_min=p)) for k, p in SWEEP_SPS]
        elif sweep and name == "lookahead":
            grid += [replace(options, lookahead=replace(options.lookahead, window=w, ngram=n, guesses=g))
                     for w, n, g in SWEEP_LOOKAHEAD]
        elif sweep and name == "tree":
            grid += [replace(options, tree=replace(options.tree, depth=d, top_k=k, nodes=m, shape=shape))
                     for d, k, m, shape in SWEEP_TREE]
        elif sweep and name == "lookup":
            grid += [replace(options, lookup=replace(options.lookup, draft_max=k, ngram_max=n)) for k, n in SWEEP_LOOKUP]
        seen = set()
        for opt in grid:
            label = strategy_label(name, opt)
            if label not in seen:
                seen.add(label)
                configs.append(BenchConfig(label, name, opt))
    return configs


def bench(
    args: argparse.Namespace,
    params_and_options: tuple[GenParams, StrategyOptions],
    resolve: Callable[..., Path],
    load_engine: Callable[[argparse.Namespace, Path, Path | None, int], Engine],
) -> int:
    params, options = params_and_options
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategy {unknown[0]!r}; choose from {', '.join(STRATEGIES)}")
    if args.model_draft is None:
        names = [n for n in names if n not in NEEDS_DRAFT]
    if args.repeats < 1:
        raise ValueError("--repeats must be at least 1")
    prompts = load_prompt_set(args.prompts, args.limit)
    configs = build_configs(names, options, args.sweep)
    target = resolve(args.model, print_progress)
    draft = resolve(args.model_draft, print_progress) if args.model_draft else None
    n_seq = max(n_seq_needed(c.strategy, c.options) for c in configs)
    engine = load_engine(args, target, draft, n_seq)
    try:
        cost, draft_cost = (None, 0.0)
        if args.cost_k_max > 0:
            print_progress(f"measuring the batch cost curve (k = 1..{args.cost_k_max})")
            cost, draft_cost = measure_costs(engine, engine.tokenize(prompts[0].text), args.cost_k_max)
        results = run_bench(engine, configs, prompts, params, args.repeats, cost, draft_cost, print_progress)
    finally:
        engine.close()
    rows = [r.summary(cost, draft_cost) for r in results]
    best = {}
    for row in rows:
        s = str(row["strategy"])
        if s != "ar" and (s not in best or row["speedup"] > best[s]["speedup"]):
            best[s] = {"label": row["label"], "speedup": row["speedup"]}
    report = {
        "target": str(target),
        "draft": str(draft) if draft else None,
        "device": {"machine": platform.machine(), "system": platform.system(),
                   "threads": args.threads or default_threads()},
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "repeats": args.repeats,
        "prompts": [{"category": p.category, "text": p.text} for p in prompts],
        "batch_cost": cost.as_list() if cost else None,
        "draft_cost": round(draft_cost, 4),
        "results": rows,
        "best": best,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "bench.json"
    json_path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    png_path = write_plot(report, out / "bench.png")
    print(format_table(rows))
    if cost:
        curve = " ".join(f"{v:.2f}" for v in report["batch_cost"][:16])
        print(f"\nbatch cost T(k)/T(1), k=1..: {curve}" + (f"; one draft token = {draft_cost:.2f} target tokens" if draft else ""))
        print("limit: the speedup llama.cpp's decode times alone allow at each run's tokens per forward (median)")
    if args.sweep:
        for s, b in best.items():
            print(f"best {s} on this device: {b['label']} ({b['speedup']:.2f}x)")
    print(f"\nwrote {json_path} and {png_path}", file=sys.stderr)
    return 0
