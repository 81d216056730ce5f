"""The speculation memory on work that repeats, and on work that does not (not a test: a measurement).

Three task families of 24 requests each, as people run them day after day:
- `extract`: the same fields pulled from 24 different short texts (`extract1`,
  measured with `--families extract1`: the same with one worked example
  first, as one prompts a base model; `code1` likewise for `code`);
- `code`: the same small function asked for again, 24 names and aggregates;
- `tool`: an agent loop through the OpenAI tools API as `specchat serve` runs
  it (the model's tool format and its grammar, app/serve/tools.py, tool_choice
  "auto"): 12 cities, each a turn asking for the weather and the turn after
  the tool's result.
(`rename`, "rename the variable x", and a tool call asked for in the system
prompt, were the families until 2026-11-25: SmolLM2-135M did neither task,
answering in prose, so they measured less repetition than the work they
stood for; docs/results.md keeps their figures.)
1. warm-up, in a process of its own (`--phase warm`): the first 12 requests
   of each family run with `auto` and the memory on, which remembers them
   (the device's cost and what `auto` learnt are kept in the bench's own
   folder, so the second process starts from them and from nothing older);
2. the second 12 of each family, in this process, with the memory as the
   first process left it (frozen: it does not learn from these runs, so the
   repeats and configurations do not feed each other): `ar`, `auto` without
   the memory, `auto` with it, each on an engine of its own that starts from
   a copy of what the warm-up's `auto` learnt, interleaved (who goes first
   rotates), medians over repeats of each run's tokens/s ratio to `ar`'s on
   the same request; with how much of `auto`'s answers the memory held at
   their place (what the model's work repeats: at 0.8 it answers afresh);
   and the second halves as one workload: each config's tokens over its
   seconds, all families together, against `ar`'s (where a family's answers
   are long, it weighs as long);
3. exact repeats: 8 of the warm-up's requests again, `ar` against `auto`
   with the memory;
4. work that does not repeat: the chat and builtin prompt sets, `auto` with
   the warm memory against `auto` without it.

    python tests/perf/memory_bench.py -m smollm2 -md smollm2-draft --repeats 3 --temp 0
    python tests/perf/memory_bench.py -m smollm2 -md smollm2-draft --repeats 3 --temp 0.8

`--runs N` does all of it N times (a warm-up each) and reports the medians over the runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from app.bench.prompts import load_prompt_set  # noqa: E402
from app.chat_template import ChatMessage, ToolCall  # noqa: E402
from app.prompt_format import PromptFormat  # noqa: E402
from app.serve.tools import Tool, ToolChoice, grammar_for, prompt_messages, tool_format  # noqa: E402
from backends.config import StrategyOptions  # noqa: E402
from backends.engine import LEARNT_FILE, Engine, EngineConfig  # noqa: E402
from backends.events import until_done  # noqa: E402
from backends.grammar import Grammar, compile_grammar  # noqa: E402
from backends.memory import SpeculationMemory  # noqa: E402
from backends.sampling import GenParams  # noqa: E402
from backends.strategies.auto.generation import MEMORY_MIN_MATCH  # noqa: E402
from models.resolve import resolve_model  # noqa: E402

PEOPLE = [("Maria Lopez", 31, "Rome", "nurse"), ("John Smith", 45, "London", "teacher"),
          ("Aiko Tanaka", 28, "Osaka", "engineer"), ("Pierre Martin", 52, "Lyon", "baker"),
          ("Sara Cohen", 39, "Haifa", "lawyer"), ("Lars Berg", 61, "Oslo", "fisherman"),
          ("Ana Costa", 24, "Porto", "student"), ("Omar Haddad", 47, "Amman", "pilot"),
          ("Li Wei", 33, "Chengdu", "chef"), ("Eva Novak", 29, "Prague", "designer"),
          ("Tom Walsh", 56, "Dublin", "farmer"), ("Nina Petrova", 41, "Sofia", "doctor"),
          ("Raj Patel", 36, "Pune", "banker"), ("Ella Berg", 27, "Malmo", "painter"),
          ("Diego Ruiz", 50, "Seville", "driver"), ("Mia Klein", 22, "Vienna", "musician"),
          ("Kofi Mensah", 44, "Accra", "tailor"), ("Zoe Adams", 35, "Perth", "vet"),
          ("Ivan Horvat", 58, "Split", "sailor"), ("Lea Roux", 30, "Nantes", "writer"),
          ("Sam Lee", 26, "Busan", "coder"), ("Ada Nwosu", 48, "Lagos", "judge"),
          ("Max Vogel", 63, "Bremen", "clockmaker"), ("Iris Blom", 38, "Utrecht", "architect")]
AGGREGATES = [("total", "sum"), ("count", "number"), ("mean", "average"), ("largest", "maximum"),
              ("smallest", "minimum"), ("product", "product"), ("squares", "sum of the squares"),
              ("range", "difference between the largest and the smallest")]
KINDS = ["positive", "negative", "even"]
WEATHER = Tool("get_weather", "Get the current weather in a city",
               {"type": "object", "properties": {"city": {"type": "string", "description": "the city's name"},
                                                 "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"]})
DEFAULT_FAMILIES = ["extract", "code", "tool"]
EXAMPLE = ('Extract name, age, city and job as JSON.\n\nText: Noor Aziz is a 34-year-old pharmacist who lives in '
           'Cairo.\nJSON: {"name": "Noor Aziz", "age": 34, "city": "Cairo", "job": "pharmacist"}\n\n')
CODE_EXAMPLE = ("Write Python functions. Show only the code.\n\nTask: a function named sum_odd(items) that returns the "
                "sum of the odd numbers in items.\nCode:\ndef sum_odd(items):\n"
                "    return sum(x for x in items if x % 2 == 1)\n\n")
COST_FILE = "cost.json"
WORKLOAD = "the workload's second half, all families together"
REACH = "memory held"  # the share of the answers' tokens the memory held at their place (memory_reach)
CONDITIONS = ["sunny", "cloudy", "light rain", "clear", "windy", "fog"]


@dataclass(frozen=True)
class Request:
    """One request of a family: its conversation, and whether it offers the weather tool (tool_choice auto)."""

    messages: tuple[ChatMessage, ...]
    tools: bool = False


def _weather_turns(i: int, city: str) -> list[Request]:
    """An agent loop's two turns for a city: the question, and the question with the call and its result."""
    ask = ChatMessage("user", f"What is the weather in {city}?")
    call = ToolCall(f"call_{i}", WEATHER.name, json.dumps({"city": city, "unit": "celsius"}))
    result = json.dumps({"city": city, "temperature": 5 + (7 * i) % 25, "conditions": CONDITIONS[i % len(CONDITIONS)]})
    return [Request((ask,), tools=True),
            Request((ask, ChatMessage("assistant", "", (call,)),
                     ChatMessage("tool", result, tool_call_id=call.id, name=WEATHER.name)), tools=True)]


def _code_tasks() -> list[tuple[str, str, str]]:
    """(name, aggregate, kind) of the 24 `code` requests: 8 aggregates and 3 kinds, coprime, so the 24 hold
    each pair once and both halves mix them."""
    return [(*AGGREGATES[i % len(AGGREGATES)], KINDS[i % len(KINDS)]) for i in range(len(AGGREGATES) * len(KINDS))]


def families() -> dict[str, list[Request]]:
    return {
        "extract": [Request((ChatMessage("user", f"Extract name, age, city and job as JSON: {n} is a {a}-year-old "
                                                 f"{j} who lives in {c}."),)) for n, a, c, j in PEOPLE],
        # The same, as a script for a base model words it: one worked example first (the base Gemma, asked as
        # `extract` asks, goes on with the text's prose at 0.8; shown one example, it answers with the JSON).
        "extract1": [Request((ChatMessage("user", f"{EXAMPLE}Text: {n} is a {a}-year-old {j} who lives in "
                                                  f"{c}.\nJSON:"),)) for n, a, c, j in PEOPLE],
        "code": [Request((ChatMessage("user", f"Write a Python function named {name}_{kind}(items) that returns "
                                              f"the {what} of the {kind} numbers in items. Show only the code."),))
                 for name, what, kind in _code_tasks()],
        "code1": [Request((ChatMessage("user", f"{CODE_EXAMPLE}Task: a function named {name}_{kind}(items) that "
                                               f"returns the {what} of the {kind} numbers in items.\nCode:\n"),))
                  for name, what, kind in _code_tasks()],
        "tool": [turn for i, (_n, _a, c, _j) in enumerate(PEOPLE[:12]) for turn in _weather_turns(i, c)],
    }


class Prompts:
    """A family's requests as the engine gets them: tokens through the chat template and, for tool turns,
    the tools in the model's format and the grammar `specchat serve` holds the answer to."""

    def __init__(self, engine: Engine) -> None:
        self.fmt = PromptFormat(engine)
        self.format = tool_format(self.fmt.template)
        self.choice = ToolChoice("auto")
        spec = grammar_for([WEATHER], self.choice, self.format)
        model = engine.target_model
        self.grammar = compile_grammar(*spec, model.guidance_tokenizer, model.n_vocab) if spec else None

    def __call__(self, request: Request) -> tuple[list[int], Grammar | None]:
        if not request.tools:
            return self.fmt.tokens(list(request.messages)), None
        messages, tools = prompt_messages(request.messages, [WEATHER], self.choice, self.format)
        return self.fmt.tokens(messages, tools=tools), self.grammar


def chosen(args: argparse.Namespace) -> dict[str, list[Request]]:
    """The families named by --families (by default `extract`, `code` and `tool`)."""
    names = args.families.split(",") if args.families else DEFAULT_FAMILIES
    known = families()
    unknown = set(names) - set(known)
    if unknown:
        raise SystemExit(f"unknown families: {', '.join(sorted(unknown))} (known: {', '.join(known)})")
    return {name: known[name] for name in names}


def open_engine(args: argparse.Namespace, memory: Path, keep: Path | None = None) -> Engine:
    """An engine on the bench's memory. The device's cost and what auto learnt are kept in the bench's own
    folder (or `keep`, a copy of it): the second process starts from what the warm-up kept (as a user's next
    session does), and the figures do not depend on earlier sessions."""
    target = resolve_model(args.m, lambda _m: None, None)
    draft = resolve_model(args.md, lambda _m: None, None) if args.md else None
    return Engine(EngineConfig(target, draft, n_ctx=4096, threads=args.t, n_seq_max=64,
                               cost_cache=(keep or memory.parent) / COST_FILE, memory_dir=memory))


def config_engines(args: argparse.Namespace, memory: Path, labels: list[str]) -> dict[str, Engine]:
    """An engine per configuration, each starting from its own copy of what the warm-up kept. What `auto`
    learns is kept per engine, so on one engine auto without the memory would teach auto with it (the rate it
    reaches, the batch scale, the tries; a user runs one or the other): shared, `extract` ran at 1.72x `ar`
    where alone it ran at 1.80x (SmolLM2 greedy, the same process, interleaved)."""
    engines = {}
    for label in labels:
        keep = memory.parent / label.replace("+", "-")
        keep.mkdir()
        for name in (COST_FILE, LEARNT_FILE):
            if (memory.parent / name).exists():
                shutil.copy(memory.parent / name, keep / name)
        engines[label] = open_engine(args, memory, keep)
        store = engines[label].memory()
        assert store is not None
        store.frozen = True
    return engines


def warm(args: argparse.Namespace) -> None:
    engine = open_engine(args, Path(args.memory))
    prompts = Prompts(engine)
    params = GenParams(max_tokens=args.n, temperature=args.temp, seed=1)
    for requests in chosen(args).values():
        for request in requests[:12]:
            tokens, grammar = prompts(request)
            until_done(engine.strategy("auto").generate(tokens, replace(params, grammar=grammar)))
    engine.close()


def run(engine: Engine, name: str, options: StrategyOptions, tokens: list[int], params: GenParams
        ) -> tuple[float, tuple, float]:
    """tokens/s, the answer, and its decoding seconds."""
    engine.slots[0].reset()
    done = until_done(engine.strategy(name, options).generate(tokens, params))
    if done.reason == "error":
        raise SystemExit(f"{name}: {done.error}")
    return done.stats.tokens_per_second, done.tokens, done.stats.decode_seconds


# Per config, per repeat: [answer tokens, decoding seconds] summed over a set of requests (workload_ratios).
Totals = dict[str, list[list[float]]]


def workload_ratios(totals: Totals, base: str) -> dict[str, float]:
    """Each config's median over repeats of its throughput over the whole set (all its tokens over all its
    seconds) against `base`'s: what the workload as a whole runs at, its long answers weighing as they take."""
    out = {}
    for label, reps in totals.items():
        out[label] = statistics.median((t / s) / (bt / bs) for (t, s), (bt, bs) in zip(reps, totals[base])
                                       if s > 0 and bs > 0 and bt > 0)
    return out


Config = tuple[str, Engine, str, StrategyOptions]  # label, its engine, strategy, options


def memory_reach(store: SpeculationMemory, prompt: Sequence[int], output: Sequence[int]) -> int:
    """How many of an answer's tokens the memory held at their place: among the first tokens of its
    continuations of everything before them, matching MEMORY_MIN_MATCH tokens back as `auto` consults it.
    What this model's work repeats, whoever drafts: a sampled answer leaves the remembered ones, and the
    memory can propose only what it holds."""
    had = 0
    context = list(prompt)
    for tok in output:
        found = store.continuations(context, 1, 64, min_match=MEMORY_MIN_MATCH)
        had += tok in {found.tree.tokens[i] for i in found.tree.children()}
        context.append(tok)
    return had


def compare(prompts: list[tuple[list[int], Grammar | None]], configs: list[Config], params: GenParams,
            repeats: int, label: str, totals: Totals | None = None) -> dict[str, float]:
    """Each config's median ratio to the first's tokens/s, same prompt and repeat, rotating who goes first;
    with the memory's reach (memory_reach) over the answers of the configs that use it. `totals`, if given,
    gathers each config's tokens and seconds per repeat (workload_ratios)."""
    ratios: dict[str, list[float]] = {c[0]: [] for c in configs}
    by_prompt: dict[str, dict[int, list[float]]] = {c[0]: {} for c in configs}
    lowest: dict[str, float] = {}
    differ = empty = reached = answered = 0
    turn = 0
    for rep in range(repeats):
        for i, (tokens, grammar) in enumerate(prompts):
            order = [configs[(turn + k) % len(configs)] for k in range(len(configs))]
            turn += 1
            got = {}
            for label_c, engine, name, options in order:
                got[label_c] = run(engine, name, options, tokens,
                                   replace(params, grammar=grammar, seed=params.seed if params.greedy else rep * 1000 + i))
                store = engine.memory()
                if options.memory and store is not None:
                    reached += memory_reach(store, tokens, got[label_c][1])
                    answered += len(got[label_c][1])
            base_speed, base_tokens, _s = got[configs[0][0]]
            if min(speed for speed, _out, _s in got.values()) <= 0:  # a sampled answer that ended at once: no rate
                empty += 1
                continue
            for label_c, (speed, out, seconds) in got.items():
                if totals is not None:
                    rep_totals = totals.setdefault(label_c, [[0.0, 0.0] for _ in range(repeats)])[rep]
                    rep_totals[0] += len(out)
                    rep_totals[1] += seconds
                ratios[label_c].append(speed / base_speed)
                by_prompt[label_c].setdefault(i, []).append(speed / base_speed)
                differ += params.greedy and out != base_tokens
    medians = {k: statistics.median(v) for k, v in ratios.items()}
    for k in medians:
        lowest[k] = min(statistics.median(v) for v in by_prompt[k].values())
    print(f"{label}: " + ", ".join(f"{k} {medians[k]:.2f}x (lowest prompt {lowest[k]:.2f}x)" for k in medians)
          + (f"; the memory held {reached / answered:.0%} of the answers' tokens at their place" if answered else "")
          + (f"; greedy outputs differing from the first config's: {differ}" if params.greedy else "")
          + (f"; runs left out (an answer with no tokens): {empty}" if empty else ""), flush=True)
    if answered:
        medians[REACH] = reached / answered
    return medians


def measure(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """One run: a warm-up in another process, then every comparison against the memory it left."""
    folder = Path(tempfile.mkdtemp(prefix="specchat-memory-bench-"))
    memory = folder / "memory"
    tasks = chosen(args)
    engines: dict[str, Engine] = {}
    results = {}
    try:
        print(f"warming the memory with the first half of each family (another process), in {memory}", flush=True)
        subprocess.run([sys.executable, __file__, "--phase", "warm", "--memory", str(memory), "-m", args.m, "-md",
                        args.md, "-t", str(args.t), "-n", str(args.n), "--temp", str(args.temp)]
                       + (["--families", args.families] if args.families else []), check=True)
        on, off = StrategyOptions(), StrategyOptions(memory=False)
        engines = config_engines(args, memory, ["ar", "auto", "auto+memory"])
        store = engines["auto+memory"].memory()
        assert store is not None
        kept = {k: v for k, v in store.stats().items() if k in ("documents", "tokens", "file_bytes")}
        print(f"memory: {json.dumps(kept)}")
        cost = engines["auto+memory"].known_device_cost()
        if cost is not None:  # measured by the warm-up: runs differ with it (docs/results.md, "Speculation memory")
            print(f"device cost the warm-up measured: T(1) {1000 * cost.batch.seconds[0]:.1f} ms, T(k)/T(1) for k = "
                  f"2, 4, 8, 16: {', '.join(f'{cost.batch.relative(k):.2f}' for k in (2, 4, 8, 16))}; "
                  f"draft {cost.draft:.2f}", flush=True)
        prompts = Prompts(engines["ar"])
        params = GenParams(max_tokens=args.n, temperature=args.temp, seed=1)
        configs: list[Config] = [("ar", engines["ar"], "ar", off), ("auto", engines["auto"], "auto", off),
                                 ("auto+memory", engines["auto+memory"], "auto", on)]
        totals: Totals = {}
        for family, requests in tasks.items():
            results[family] = compare([prompts(r) for r in requests[12:]], configs, params, args.repeats,
                                      f"{family} (second half)", totals)
        if len(tasks) > 1:  # the second halves as one workload: all of a config's tokens over all its seconds
            results[WORKLOAD] = workload_ratios(totals, "ar")
            print(f"{WORKLOAD}: " + ", ".join(f"{k} {v:.2f}x" for k, v in results[WORKLOAD].items()), flush=True)
        repeats = [prompts(r) for requests in tasks.values() for r in requests[:12:4]]
        results["exact repeats"] = compare(repeats, [configs[0], configs[2]], params, args.repeats,
                                           "exact repeats of the warm-up")
        for name in () if args.skip_nothing_repeats else ("chat", "builtin"):
            texts = [prompts(Request(tuple(p.messages) or (ChatMessage("user", p.chat_text()),)))
                     for p in load_prompt_set(name)]
            results[name] = compare(texts, [configs[1], configs[2]], params, args.repeats,
                                    f"{name} (nothing repeats): auto+memory against auto")
    finally:
        for engine in engines.values():
            engine.close()
        shutil.rmtree(folder, ignore_errors=True)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", default="smollm2")
    ap.add_argument("-md", default="smollm2-draft")
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("-n", type=int, default=96)
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=3)
    # Whole runs (warm-up included) differ by up to 0.4x on a family (docs/results.md, "Speculation memory"):
    # each measures the device's cost afresh and starts auto from what its own warm-up learnt. --runs N
    # repeats everything N times and reports each figure's median over the runs.
    ap.add_argument("--runs", type=int, default=1, help="whole runs, warm-up included (default 1)")
    ap.add_argument("--families", help="comma-separated families to warm and measure (default: extract,code,tool; "
                                       "extract1 and code1 are extract and code with one worked example first)")
    ap.add_argument("--skip-nothing-repeats", action="store_true", help="leave out the chat and builtin sets")
    ap.add_argument("--phase", choices=["all", "warm"], default="all")
    ap.add_argument("--memory", help="(warm phase) the memory folder")
    args = ap.parse_args()
    chosen(args)  # unknown families: one line, before any warm-up
    if args.phase == "warm":
        warm(args)
        return 0
    runs = []
    for k in range(args.runs):
        if args.runs > 1:
            print(f"-- run {k + 1} of {args.runs}", flush=True)
        runs.append(measure(args))
    if args.runs == 1:
        print(json.dumps(runs[0], indent=1))
        return 0
    medians = {w: {c: statistics.median(r[w][c] for r in runs) for c in runs[0][w]} for w in runs[0]}
    for w, by_config in medians.items():
        print(f"median over {args.runs} runs, {w}: " + ", ".join(
            f"{c} {v:.2f}{'' if c == REACH else 'x'} ({' / '.join(f'{r[w][c]:.2f}' for r in runs)})"
            for c, v in by_config.items()))
    print(json.dumps({"runs": runs, "medians": medians}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
