"""`specchat bench`: builds the configurations, runs app.bench.solo, writes the table, JSON and PNG."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import replace
from pathlib import Path
from app.bench.plot import write_load_plot, write_plot
from app.bench.prompts import BenchPrompt, load_prompt_set
from app.bench.solo import BenchConfig, format_table, measure_costs, mismatch_lines, prompt_grammars, run_bench
from app.chat_template import ChatMessage
from app.errors import print_progress
from app.loading import open_engine
from app.prompt_format import PromptFormat
from app.settings import Settings
from backends.config import StrategyOptions
from backends.llama import default_threads
from backends.registry import NEEDS_DRAFT, STRATEGIES, n_seq_needed, spec, strategy_label

CONTROL_LABEL = "ar (control)"


def build_configs(names: list[str], options: StrategyOptions, sweep: bool, control: bool = False) -> list[BenchConfig]:
    """`ar` first, then each strategy (and its sweep grid); with `control`, `ar` once more, last: an A/A pair."""
    configs = [BenchConfig("ar", "ar")]
    for name in names:
        if name == "ar":
            continue
        grid = [options] + (spec(name).sweep(options) if sweep else [])
        seen = set()
        for opt in grid:
            label = strategy_label(name, opt)
            if label not in seen:
                seen.add(label)
                configs.append(BenchConfig(label, name, opt))
    if control:
        configs.append(BenchConfig(CONTROL_LABEL, "ar"))
    return configs


def bench_tokens(fmt: PromptFormat, prompts: list[BenchPrompt], raw: bool, system_prompt: str) -> list[list[int]]:
    """Each prompt as the target sees it: through the chat template unless raw (or the model has none)."""
    out = []
    for p in prompts:
        if p.messages:
            if raw:
                raise ValueError("--raw sends prompt texts as they are; a prompt set with messages needs the template")
            system = () if p.messages[0].role == "system" or not system_prompt else \
                (ChatMessage("system", system_prompt),)
            out.append(fmt.tokens([*system, *p.messages]))
        elif raw or fmt.plain:
            out.append(fmt.prompt(p.text, system_prompt, raw=raw))
        else:
            out.append(fmt.prompt(p.chat_text(), system_prompt))
    return out


def bench(args: argparse.Namespace, settings: Settings) -> int:
    settings = replace(settings, memory=bool(args.memory) and settings.memory is not False)
    params, options = settings.params, settings.options
    if args.raw and settings.system_prompt:
        raise ValueError("--system needs the chat template; it cannot go with --raw")
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategy {unknown[0]!r}; choose from {', '.join(STRATEGIES)}")
    if args.model_draft is None and not settings.mtp:  # else the target's own MTP head may draft: known once loaded
        names = [n for n in names if n not in NEEDS_DRAFT]
    if args.repeats < 1:
        raise ValueError("--repeats must be at least 1")
    if Path(args.out).exists() and not Path(args.out).is_dir():  # found now, not after the measuring
        raise ValueError(f"--out {args.out} is a file; it names the folder for bench.json and bench.png")
    if args.rotate < 0:
        raise ValueError("--rotate must be 0 or more")
    prompts = load_prompt_set(args.prompts, args.limit)
    configs = build_configs(names, options, args.sweep, args.control)
    if args.requests is not None and args.clients is None:
        raise ValueError("--requests is for the load bench: give --clients too")
    if args.requests is not None and args.requests < 1:
        raise ValueError("--requests must be at least 1")
    if args.clients is not None:
        if any(p.schema for p in prompts) or args.unmasked_drafts:  # else the schemas would be dropped unsaid
            raise ValueError("the load bench (--clients) runs without schemas: --prompts with schemas and "
                             "--unmasked-drafts are for one sequence at a time")
        return load_bench(args, settings, prompts, configs)
    n_seq = max(n_seq_needed(c.strategy, c.options) for c in configs)
    engine = open_engine(settings, n_seq, print_progress)
    target, draft = engine.config.target, engine.config.draft
    if engine.draft is None:
        configs = [c for c in configs if c.strategy not in NEEDS_DRAFT]
    try:
        tokenized = bench_tokens(PromptFormat(engine), prompts, args.raw, settings.system_prompt)
        cost, draft_cost = (None, 0.0)
        if args.cost_k_max > 0:
            print_progress(f"measuring the batch cost curve (k = 1..{args.cost_k_max})")
            cost, draft_cost = measure_costs(engine, tokenized[0], args.cost_k_max)
        if args.unmasked_drafts:
            params = replace(params, mask_drafts=False)
        results = run_bench(engine, configs, prompts, tokenized, params, args.repeats, cost, draft_cost,
                            print_progress, prompt_grammars(engine, prompts), args.rotate)
    finally:
        engine.close()
    rows = [r.summary(cost, draft_cost) for r in results]
    best = {}
    for row in rows:
        s = str(row["strategy"])
        if s != "ar" and (s not in best or row["speedup"] > best[s]["speedup"]):
            best[s] = {"label": row["label"], "speedup": row["speedup"]}
    report = {
        **_report_head(args, params, target, draft, prompts, tokenized),
        "chat_template": not args.raw and engine.target_info.chat_template is not None,
        "batch_cost": cost.as_list() if cost else None,
        "draft_cost": round(draft_cost, 4),
        "results": rows,
        "best": best,
    }
    json_path, png_path = _write_report(report, Path(args.out), write_plot)
    print(format_table(rows))
    mismatches = mismatch_lines(rows)
    if mismatches:
        print("\n" + "\n".join(mismatches))
    if cost:
        curve = " ".join(f"{v:.2f}" for v in report["batch_cost"][:16])
        print(f"\nbatch cost T(k)/T(1), k=1..: {curve}" + (f"; one draft token = {draft_cost:.2f} target tokens" if draft_cost else ""))
        print("limit: the speedup llama.cpp's decode times alone allow at each run's tokens per forward (median)")
    for row in rows:
        if row["strategy"] == "auto":
            print(f"\n{row['label']}: what its target forwards verified, by category")
            for category, mix in row["choices_by_category"].items():  # type: ignore[union-attr]
                total = sum(mix.values()) or 1
                print(f"  {category:14} " + "  ".join(f"{c} {100 * n / total:.0f}%" for c, n in mix.items()))
    if args.sweep:
        for s, b in best.items():
            print(f"best {s} on this device: {b['label']} ({b['speedup']:.2f}x)")
    print(f"\nwrote {json_path} {png_path}", file=sys.stderr)
    return 0


def _report_head(args: argparse.Namespace, params, target: Path, draft: Path | None, prompts: list[BenchPrompt],
                 tokenized: list[list[int]]) -> dict[str, object]:
    """What every bench.json starts with: the models, the device, the settings and the prompts."""
    return {
        "target": str(target),
        "draft": str(draft) if draft else None,
        "device": {"machine": platform.machine(), "system": platform.system(),
                   "threads": args.threads or default_threads()},
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "repeats": args.repeats,
        "prompts": [{"category": p.category, "text": p.text, "tokens": len(t)} for p, t in zip(prompts, tokenized)],
    }


def _write_report(report: dict, out: Path, plot) -> tuple[Path, str]:
    """bench.json and bench.png (drawn by `plot`) in `out`; what was written, for the last line. A plot that cannot
    be drawn (no matplotlib: the `bench` extra) is a line on stderr, not a failure after minutes of measuring."""
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "bench.json"
    json_path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    try:
        return json_path, f"and {plot(report, out / 'bench.png')}"
    except (ValueError, OSError) as e:
        print(f"specchat: bench.png not drawn: {e}", file=sys.stderr)
        return json_path, "(no plot)"


def parse_clients(text: str) -> list[int]:
    try:
        clients = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise ValueError(f"--clients takes client counts separated by commas, like 1,2,4,8; got {text!r}") from None
    if not clients or min(clients) < 1:
        raise ValueError("--clients needs counts of at least 1, like 1,2,4,8")
    return sorted(set(clients))


def load_bench(args: argparse.Namespace, settings: Settings, prompts: list[BenchPrompt],
               configs: list[BenchConfig]) -> int:
    """`specchat bench --clients`: app.bench.load's table, bench.json and bench.png."""
    from app.bench.load import format_load_table, run_load_bench
    from backends.llama import max_sequences

    clients = parse_clients(args.clients)
    params = settings.params
    if args.sweep:
        raise ValueError("--sweep is for one sequence at a time; the load bench runs the configurations as given")
    parallel = max(clients)
    n_seq = max(n_seq_needed(c.strategy, c.options) for c in configs)
    if n_seq * parallel > min(max_sequences(), settings.n_batch):
        raise ValueError(f"{parallel} clients x {n_seq} sequence ids each is over what one batch can hold "
                         f"({min(max_sequences(), settings.n_batch)}); use fewer clients or a smaller -W/-G/tree")
    engine = open_engine(settings, n_seq, print_progress, n_parallel=parallel)
    target, draft = engine.config.target, engine.config.draft
    if engine.draft is None:
        configs = [c for c in configs if c.strategy not in NEEDS_DRAFT]
    try:
        tokenized = bench_tokens(PromptFormat(engine), prompts, args.raw, settings.system_prompt)
        if args.requests is not None:  # the prompts in turn, N requests in all
            tokenized = [tokenized[i % len(tokenized)] for i in range(args.requests)]
        rows_max = min(settings.n_batch, max(args.cost_k_max, 16 * parallel))
        print_progress(f"measuring the batch cost curve (k = 1..{rows_max})")
        cost = engine.measure_now(tokenized[0], rows_max)
        results = run_load_bench(engine, configs, tokenized, params, clients, args.repeats, print_progress,
                                 args.rotate)
    finally:
        engine.close()
    rows = [r.summary() for r in results]
    report = {
        **_report_head(args, params, target, draft, prompts, tokenized),
        "clients": clients,
        "requests": len(tokenized),
        "batch_cost": cost.batch.as_list() if cost else None,
        "load": rows,
    }
    json_path, png_path = _write_report(report, Path(args.out), write_load_plot)
    print(format_load_table(rows))
    if params.greedy:
        differing = [r for r in rows if r["greedy_differing_requests"]]
        for r in differing:
            print(f"{r['label']} at {r['clients']} clients: {r['greedy_differing_requests']} request(s) differ from ar's "
                  "(llama.cpp's batched arithmetic is not batch-invariant: near-ties can flip)")
    print(f"\nwrote {json_path} {png_path}", file=sys.stderr)
    return 0
