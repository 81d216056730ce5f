"""`specchat bench`: strategies side by side on this device.

Every configuration runs on every prompt, interleaved (A B C, B C A, C A B,
...: each takes its turn going first) so that drift on a busy machine hits
all alike, after one warm-up pass. Caches are reset before each run so that
each measures the same work. Speedups are ratios to `ar` taken within the
same repeat and prompt, then the median. `--control` adds `ar` a second
time: its ratio to `ar` is the machine's own noise, the band within which a
configuration's ratio says nothing. The device's batch cost curve
(backends.pricing) turns each configuration's measured tokens per forward and
drafts per forward into the speedup that llama.cpp's decode times alone
would allow, so the table shows how close each runs to its limit. `auto`
starts from nothing learnt (Engine.learn_afresh) and learns across the run,
as over one long conversation: its first tries fall in the warm-up and the
first repeat.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from app.bench.greedy import Parting, first_difference, parting
from app.bench.prompts import BenchPrompt
from app.errors import UserError
from backends.config import StrategyOptions
from backends.device_cost import BatchCost
from backends.engine import Engine
from backends.events import Done, until_done
from backends.grammar import Grammar, compile_grammar
from backends.pricing import best_chain_speedup, predicted_speedup
from backends.registry import spec
from backends.sampling import GenParams

CHAIN_STRATEGIES = ("sps", "lookup")


@dataclass(frozen=True)
class BenchConfig:
    label: str
    strategy: str
    options: StrategyOptions = StrategyOptions()


@dataclass
class ConfigResult:
    config: BenchConfig
    tok_s: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)  # vs ar, same repeat and prompt
    ratios_by_category: dict[str, list[float]] = field(default_factory=dict)
    # Target forwards by what they verified (plain, draft, lookup, ...), per prompt category.
    choices_by_category: dict[str, dict[str, int]] = field(default_factory=dict)
    tokens_by_source: dict[str, int] = field(default_factory=dict)
    grammar_seconds: float = 0.0  # time the grammar took (masks, look-aheads), under a schema
    decode_seconds: float = 0.0
    limits: list[float] = field(default_factory=list)  # per run: speedup the decode times alone allow
    generated: int = 0
    forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)
    drafted_at: list[int] = field(default_factory=list)
    greedy_match: bool | None = None  # None: not checked (sampling)
    # Greedy runs whose output differed from ar's: where ({"category", "repeat", "token": first differing index}),
    # by how much ar's choice won there ("gap") against the batch noise ("noise"), and whether that is a near-tie
    # (app.bench.greedy).
    greedy_mismatches: list[dict[str, object]] = field(default_factory=list)

    def add(self, done: Done, cost: BatchCost | None, draft_cost: float, category: str) -> None:
        s = done.stats
        mix = self.choices_by_category.setdefault(category, {})
        for choice, n in s.steps_by_choice.items():
            mix[choice] = mix.get(choice, 0) + n
        for source, n in s.tokens_by_source.items():
            self.tokens_by_source[source] = self.tokens_by_source.get(source, 0) + n
        self.tok_s.append(s.tokens_per_second)
        self.grammar_seconds += float(s.extra.get("grammar_seconds", 0.0))
        self.decode_seconds += s.decode_seconds
        if cost is not None and s.target_forwards:
            fwd = s.target_forwards
            # Draft decode calls per forward: one per drafted token for a chain, one per depth for a tree.
            drafts = float(s.extra.get("draft_forwards", s.drafted if self.config.strategy == "sps" else 0)) / fwd
            batch = float(s.extra.get("batch_tokens", s.drafted + fwd)) / fwd
            self.limits.append(predicted_speedup(s.generated_tokens / fwd, drafts, batch, draft_cost, cost))
        self.generated += s.generated_tokens
        self.forwards += s.target_forwards
        self.drafted += s.drafted
        self.accepted += s.accepted
        for total, part in ((self.accepted_at, s.accepted_per_position), (self.drafted_at, s.drafted_per_position)):
            total.extend([0] * (len(part) - len(total)))
            for i, n in enumerate(part):
                total[i] += n

    def summary(self, cost: BatchCost | None, draft_cost: float) -> dict[str, object]:
        tokens_per_forward = self.generated / max(self.forwards, 1)
        out: dict[str, object] = {
            "label": self.config.label,
            "strategy": self.config.strategy,
            "tokens_per_second": round(statistics.median(self.tok_s), 3),
            "tokens_per_second_min": round(min(self.tok_s), 3),
            "tokens_per_second_max": round(max(self.tok_s), 3),
            "speedup": round(statistics.median(self.ratios), 4),
            "speedup_by_category": {k: round(statistics.median(v), 4) for k, v in self.ratios_by_category.items()},
            "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
            "tokens_per_forward": round(tokens_per_forward, 4),
            "accepted_per_position": [round(a / d, 4) if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)],
            "greedy_matches_ar": self.greedy_match,
            "greedy_mismatches": self.greedy_mismatches,
            # Parted from ar's only where another batch shape may rightly choose otherwise (app.bench.greedy).
            "greedy_near_ties_only": bool(self.greedy_mismatches) and all(m["near_tie"]
                                                                          for m in self.greedy_mismatches),
            "choices_by_category": {c: dict(sorted(m.items())) for c, m in self.choices_by_category.items()},
            "tokens_by_source": dict(sorted(self.tokens_by_source.items())),
        }
        if self.grammar_seconds:
            out["grammar_ms_per_token"] = round(1e3 * self.grammar_seconds / max(self.generated, 1), 4)
            out["grammar_share_of_time"] = round(self.grammar_seconds / max(self.decode_seconds, 1e-9), 4)
        if self.limits:
            out["predicted_speedup"] = round(statistics.median(self.limits), 4)
        if cost is not None and self.config.strategy in CHAIN_STRATEGIES and self.drafted:
            # The best any fixed K could do at this acceptance (Leviathan et al. section 3.4).
            c = draft_cost if self.config.strategy == "sps" else 0.0
            bound, k = best_chain_speedup(self.accepted / self.drafted, c, cost)
            out["best_chain_bound"] = {"speedup": round(bound, 4), "K": k}
        return out


def prompt_grammars(engine: Engine, prompts: Sequence[BenchPrompt]) -> list[Grammar | None]:
    """Each prompt's schema compiled for the target's vocabulary (None for a prompt without one)."""
    model = engine.target_model
    return [compile_grammar("json_schema", p.schema, model.guidance_tokenizer, model.n_vocab) if p.schema else None
            for p in prompts]


def _run(engine: Engine, config: BenchConfig, tokens: list[int], params: GenParams) -> Done:
    engine.slots[0].reset()
    done = until_done(engine.strategy(config.strategy, config.options).generate(tokens, params))
    if done.reason == "error":
        raise RuntimeError(f"{config.label}: {done.error}")
    return done


def run_bench(
    engine: Engine,
    configs: list[BenchConfig],
    prompts: list[BenchPrompt],
    tokenized: list[list[int]],
    params: GenParams,
    repeats: int,
    cost: BatchCost | None = None,
    draft_cost: float = 0.0,
    progress: Callable[[str], None] = lambda _m: None,
    grammars: Sequence[Grammar | None] = (),
    rotate: int = 0,
) -> list[ConfigResult]:
    """Run every configuration on every prompt (`tokenized`: as the target sees it) `repeats` times.

    The first config must be plain `ar`: every run's ratio is against `ar`'s
    run on the same prompt in the same repeat. The configurations take turns
    going first (the order rotates by one per prompt and repeat), so that none
    always follows the same one: on a shared machine a slow spell, or what
    the run before left in the caches, then falls on each alike. `rotate`
    starts the turns where they would be after that many repeats (repeats run
    as separate processes, each `--repeats 1`, then take turns too).
    `grammars[i]`, when given, is what prompt i's answer must follow (the extract set's schemas).
    """
    assert configs and configs[0].strategy == "ar", "the baseline comes first"
    # `auto` starts from nothing learnt, as on a new machine, so that the figures do not depend on what earlier
    # sessions kept; what it learns here is still kept for later ones.
    engine.learn_afresh()
    results = [ConfigResult(c) for c in configs]
    warm = GenParams(max_tokens=min(16, params.max_tokens), temperature=params.temperature, seed=params.seed)
    for c in configs:
        _run(engine, c, tokenized[0], warm)
    total = repeats * len(prompts) * len(configs)
    done_runs = 0
    partings: dict[tuple, Parting] = {}  # the same parting from ar's answer is measured once
    for rep in range(repeats):
        for i, (prompt, tokens) in enumerate(zip(prompts, tokenized)):
            run_params = replace(params, grammar=grammars[i]) if i < len(grammars) and grammars[i] else params
            first = ((rep + rotate) * len(prompts) + i) % len(results)
            dones: dict[int, Done] = {}
            for n in [*range(first, len(results)), *range(first)]:
                res = results[n]
                dones[n] = done = _run(engine, res.config, tokens, run_params)
                res.add(done, cost, draft_cost, prompt.category)
                done_runs += 1
                progress(f"[{done_runs}/{total}] repeat {rep + 1}, {prompt.category}, {res.config.label}: "
                         f"{done.stats.tokens_per_second:.1f} tok/s")
            base = dones[0]
            base_speed = base.stats.tokens_per_second
            for n, res in enumerate(results):
                done = dones[n]
                if n and params.greedy:
                    at = first_difference(done.tokens, base.tokens)
                    res.greedy_match = res.greedy_match is not False and at is None
                    if at is not None:
                        key = (i, base.tokens[:at + 1], at >= len(base.tokens))
                        if key not in partings:
                            # A thinking model's phases under a grammar each have their own: not measured.
                            partings[key] = Parting(at) if run_params.grammar and run_params.reasoning else \
                                parting(engine, tokens, base.tokens, at, run_params.grammar)
                        where = partings[key]
                        reorders = spec(res.config.strategy).n_seq(res.config.options) > 1
                        res.greedy_mismatches.append({"category": prompt.category, "repeat": rep + 1, "token": at,
                                                      "gap": where.gap, "noise": where.noise,
                                                      "order_noise": where.order if reorders else None,
                                                      "near_tie": where.near_tie_for(reorders)})
                ratio = done.stats.tokens_per_second / base_speed if base_speed else 0.0
                res.ratios.append(ratio)
                res.ratios_by_category.setdefault(prompt.category, []).append(ratio)
    return results


def measure_costs(engine: Engine, context: list[int], k_max: int) -> tuple[BatchCost, float]:
    """The target's batch cost curve, and one draft token's cost relative to one target token.

    Measured through the engine, which keeps it (and caches it on disk): `auto`
    then decides with this curve, in this run and in later sessions.
    """
    engine.target.sync(context, logits=False)
    if engine.draft is not None:
        engine.draft.sync(context, logits=False)
    measured = engine.device_cost(k_max, repeats=3, remeasure=True)
    if measured is None:
        raise UserError(f"no room to measure the batch cost: --cost-k-max must be at least 2 and the first prompt "
                        f"({len(context)} tokens) must leave 2 free cells in the context ({engine.target.n_ctx})")
    engine.slots[0].reset()
    return measured.batch, measured.draft


def mismatch_lines(rows: list[dict[str, object]]) -> list[str]:
    """Per configuration whose greedy output differed from ar's, a line for its changed tokens and one for its
    near-ties (app.bench.greedy), saying on which runs and where."""
    def place(m: dict) -> str:
        measured = f", where ar's choice wins by {m['gap']:.4f} against a batch noise of {m['noise']:.4f}" \
            if m.get("gap") is not None and m.get("noise") is not None else ""
        if measured and m.get("order_noise") is not None:
            measured += f" and a KV-cell order noise of {m['order_noise']:.4f}"
        return f"{m['category']} (repeat {m['repeat']}) from token {m['token']}{measured}"

    lines = []
    for r in rows:
        where: list[dict] = r.get("greedy_mismatches") or []  # type: ignore[assignment]
        changed = [m for m in where if not m.get("near_tie")]
        ties = [m for m in where if m.get("near_tie")]
        if changed:
            lines.append(f"{r['label']}: greedy output differs from ar's on " + "; ".join(map(place, changed)))
        if ties:
            lines.append(f"{r['label']}: parts from ar's greedy output at near-ties that llama.cpp's batch "
                         f"arithmetic or its KV cells' order may flip (the target's greedy output either way) on "
                         + "; ".join(map(place, ties)))
    return lines


def format_table(rows: list[dict[str, object]]) -> str:
    head = f"{'configuration':28} {'tok/s':>8} {'min-max':>13} {'vs ar':>6} {'accept':>6} {'tok/fwd':>7} " \
           f"{'limit':>6} {'greedy=ar':>9}  accepted by position"
    lines = [head, "-" * len(head)]
    for r in rows:
        spread = f"{r['tokens_per_second_min']:.1f}-{r['tokens_per_second_max']:.1f}"
        limit = f"{r['predicted_speedup']:.2f}" if "predicted_speedup" in r else "-"
        per_pos = " ".join(f"{a:.2f}" for a in r["accepted_per_position"][:8])  # type: ignore[index]
        lines.append(
            f"{r['label']:28} {r['tokens_per_second']:8.2f} {spread:>13} {r['speedup']:6.2f} "
            f"{r['acceptance_rate']:6.2f} {r['tokens_per_forward']:7.2f} {limit:>6} "
            f"{_greedy_cell(r):>9}  {per_pos}"
        )
    return "\n".join(lines)


def _greedy_cell(row: dict[str, object]) -> str:
    """The table's greedy=ar cell: yes, near-tie (parted only where batches may flip the choice), NO, or - (not
    checked: sampling)."""
    if row["greedy_matches_ar"] is False and row.get("greedy_near_ties_only"):
        return "near-tie"
    return {True: "yes", False: "NO", None: "-"}[row["greedy_matches_ar"]]  # type: ignore[index]
