"""`specchat` console script: the chat app (`chat`, the default), headless generation
(`run`), the bundled demo (`demo`), the benchmark (`bench`), the model manager
(`models`), the OpenAI-compatible server (`serve`) and llama.cpp's RPC server
(`rpc-server`).

Text goes to stdout; progress, stats and errors to stderr. User errors (a
missing or malformed model, an incompatible pair, a bad flag, a prompt that
does not fit) print one line and exit 1; failures at run time exit 2; no
traceback without --debug. Flag spellings follow llama.cpp's.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, NoReturn, Sequence

from app.chat_template import ChatMessage
from app.commands.cache import add_cache_parser, run_cache
from app.commands.models import add_models_parser, run_models
from app.commands.rpc import add_rpc_parser
from app.commands.serve import add_serve_parser
from app.errors import EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, EXIT_RUNTIME, EXIT_USER, UserError, describe, is_user_error, print_error, print_progress
from app.grammar_flags import add_grammar_flags, grammar_from_flags
from app.loading import open_engine
from app.prompt_format import PromptFormat
from app.render import LEGEND, TextView, event_json, stats_lines
from app.settings import CHAT_TEMPERATURE, REASONING_EFFORTS, Settings, apply_flags
from backends.config import MEMORY_TOKENS, StrategyOptions
from backends.events import Done
from backends.registry import DEFAULT_STRATEGY, REGISTRY, n_seq_needed, require_draft
from backends.settings_schema import Knob, flag_default, parse_text, strategy_flags

DEMO_PROMPT = "Once upon a time, in a small village,"


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        if self.prog != "specchat":  # a command's own --debug too: where an error line says to add it, it works
            self.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER, f"specchat: error: {message} (see '{self.prog} --help')\n")


def _size(text: str) -> int:
    from app.units import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_generation_flags(p: argparse.ArgumentParser, output: bool = True, temp: float = CHAT_TEMPERATURE) -> None:
    g = p.add_argument_group("generation")
    g.add_argument("-n", "--n-predict", type=int, default=128, dest="max_tokens", help="tokens to generate (default: 128)")
    g.add_argument("--temp", type=float, default=temp, help=f"temperature; 0 = greedy (default: {temp:g})")
    g.add_argument("--top-k", type=int, default=40, help="top-k, 0 = off (default: 40)")
    g.add_argument("--top-p", type=float, default=0.95, help="top-p (default: 0.95)")
    g.add_argument("--min-p", type=float, default=0.05, help="min-p, 0 = off (default: 0.05)")
    g.add_argument("--seed", type=_seed, default=None, help="random seed for sampling; -1 = random (default: random)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    p.add_argument_group("drafters").add_argument(
        "--no-mtp", dest="mtp", action="store_false", default=None,
        help="do not draft with the target's own MTP head (a file that has one drafts with it when no -md is given)")
    s_mem = p.add_argument_group("speculation memory")
    s_mem.add_argument("--no-memory", "--no-suffix-cache", dest="memory", action="store_false", default=None,
                       help="neither consult nor update the speculation memory of earlier outputs")
    s_mem.add_argument("--memory-size", "--suffix-cache-size", type=int, default=None, metavar="TOKENS",
                       help=f"the speculation memory's bound in tokens (default: {MEMORY_TOKENS:,}); the "
                            "least recently used texts go first")
    g.add_argument("--ignore-eos", action="store_true", default=None,
                   help="never end at an end-of-generation token: exactly -n tokens (for benchmarks)")
    t = p.add_argument_group("thinking models")
    t.add_argument("--no-think", dest="thinking", action="store_false", default=None,
                   help="answer without thinking first (a template that takes enable_thinking)")
    t.add_argument("--reasoning-budget", type=int, default=None, metavar="N",
                   help="end the thinking after N tokens; the answer follows (default: no bound)")
    t.add_argument("--reasoning-effort", choices=REASONING_EFFORTS, default=None,
                   help="how hard to think, for a template that reads reasoning_effort (gpt-oss); default: its own")
    add_strategy_flags(p.add_argument_group("speculation"))
    r = p.add_argument_group("runtime")
    r.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size in tokens (default: 4096)")
    r.add_argument("-b", "--batch-size", type=int, default=512, help="logical batch size (default: 512)")
    r.add_argument("-t", "--threads", type=int, default=None,
                   help="the most CPU threads (default: all cores); fewer while fewer decode faster (a busy program)")
    r.add_argument("-ngl", "--gpu-layers", type=int, default=0, help="target layers to offload to the GPU")
    r.add_argument("-ngld", "--gpu-layers-draft", type=int, default=0, help="draft layers to offload to the GPU")
    r.add_argument("--kv-cache-disk", type=_size, default=None, metavar="SIZE",
                   help="KV cells kept on disk for the chat app's conversations and the server's prompt cache, "
                        "at most SIZE (e.g. 2G; 0 turns it off; default: 2G)")
    r.add_argument("--rpc", type=_rpc_servers, default=None, metavar="HOST:PORT[,HOST:PORT...]",
                   help="run the target's offloaded layers (-ngl) on llama.cpp RPC servers (`specchat rpc-server`)")
    if not output:
        return
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="one JSON object per event on stdout")
    o.add_argument("--reasoning", choices=("show", "hide"), default="show",
                   help="a thinking model's reasoning: dimmed on stderr (show) or not at all (default: show)")
    o.add_argument("--color", dest="color", action="store_true", default=None,
                   help="speculation view: accepted green, rejected red struck through, corrections blue")
    o.add_argument("--no-color", dest="color", action="store_false", help="plain text")
    o.add_argument("--stats", action="store_true", help="print generation stats to stderr")


def _rpc_servers(value: str) -> tuple[str, ...]:
    """--rpc: comma-separated HOST:PORT endpoints, as llama.cpp spells them."""
    servers = tuple(v.strip() for v in value.split(",") if v.strip())
    for server in servers:
        host, sep, port = server.partition(":")  # llama.cpp's rule: the first colon (IPv4 or a host name)
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise argparse.ArgumentTypeError(f"expected HOST:PORT (an IPv4 address or a host name), got {server!r}")
    if not servers:
        raise argparse.ArgumentTypeError("expected at least one HOST:PORT")
    return servers


def _seed(value: str) -> int | None:
    """--seed: a non-negative number, or -1 for a random seed (llama.cpp's LLAMA_DEFAULT_SEED)."""
    try:
        seed = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
    if seed < -1:
        raise argparse.ArgumentTypeError(f"expected a seed >= 0, or -1 for a random one, got {seed}")
    return seed  # -1 stays -1 here, so that it overrides a saved seed; apply_flags makes it None


def _add_prompt_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prompt")
    g.add_argument("--system", "-sys", "--system-prompt", dest="system", default=None,
                   help="system message (models with a chat template)")
    g.add_argument("-no-cnv", "--no-conversation", dest="raw", action="store_true",
                   help="send the prompt as it is, without the model's chat template (llama.cpp's spelling)")


def add_strategy_flags(group: argparse._ActionsContainer, options: StrategyOptions | None = None) -> None:
    """The strategies' flags, as their fields declare them (backends.config): each flag once, its default the
    fields' default (per strategy when they differ), a switch for a flag that sets a fixed value."""
    for flag, knobs in strategy_flags(options or StrategyOptions()):
        if flag.sets is not None:
            group.add_argument(*flag.names, action="store_true", help=flag.help)
            continue
        default = flag_default(knobs)
        shown = default if default is not None else ", ".join(f"{k.default} for {k.section}" for k in knobs)
        first = knobs[0]  # the fields of one flag share a kind
        kind = _typed_text(first) if first.setting.words else None if first.setting.choices else first.kind
        group.add_argument(*flag.names, type=kind, choices=first.setting.choices or None, default=default,
                           help=f"{flag.help} (default: {shown})")


def _typed_text(knob: Knob) -> Callable[[str], object]:
    """A flag's value read by the schema (a number or a word: --tree-nodes 12, --tree-nodes auto)."""
    def parse(text: str) -> object:
        try:
            return parse_text(knob, text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


MODEL_HELP = "target model: a .gguf path, 'smollm2' or 'demo' (the bundled pairs), an alias, or hf:OWNER/REPO[:QUANT]"
DRAFT_HELP = ("draft model, same forms: e.g. 'smollm2-draft' or 'demo-draft' (needed by sps and tree; used by auto); "
              "a target with its own MTP head drafts with it when none is given")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specchat", description="Local LLM chat and generation, faster with speculative decoding.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and llama.cpp's log")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    run = sub.add_parser("run", help="generate a completion headlessly")
    run.add_argument("prompt", nargs="?", help="prompt text, or - to read it from stdin")
    run.add_argument("-p", "--prompt", dest="prompt_flag", metavar="PROMPT",
                     help="the prompt as llama.cpp's programs take it (instead of the argument)")
    run.add_argument("-m", "--model", required=True, help=MODEL_HELP)
    run.add_argument("-md", "--model-draft", default=None, help=DRAFT_HELP)
    _add_strategy_flag(run)
    _add_prompt_flags(run)
    _add_generation_flags(run)
    add_grammar_flags(run)
    run.add_argument("--prompt-cache", type=Path, default=None, metavar="FILE",
                     help="keep the prompt's KV cache in FILE: a later run whose prompt starts the same way "
                          "restores it instead of decoding it (llama-cli's flag)")

    chat = sub.add_parser("chat", help="open the chat app (the default with no command)",
                          description="Open the chat app. Flags given here override the saved settings "
                                      "(F4 in the app); the defaults shown are those of `specchat run`.")
    chat.add_argument("-m", "--model", help=MODEL_HELP + " (default: the saved one)")
    chat.add_argument("-md", "--model-draft", help=DRAFT_HELP)
    chat.add_argument("--system", help="system prompt")
    chat.add_argument("--resume", nargs="?", const="last", default=None, metavar="ID",
                      help="reopen a saved conversation (its id, as F5 lists them; default: the last one); its KV "
                           "cells come back from disk instead of being decoded")
    _add_strategy_flag(chat)
    _add_generation_flags(chat, output=False)
    # Only the flags given on the command line override the saved settings.
    chat.set_defaults(**{a.dest: None for a in chat._actions if a.dest != "help"})

    demo = sub.add_parser("demo", help="build (once) and run the bundled Gemma 3 270M demo pair")
    demo.add_argument("prompt", nargs="?", default=DEMO_PROMPT, help=f"prompt (default: {DEMO_PROMPT!r})")
    _add_strategy_flag(demo)
    # Greedy: the demo completes a base model's text to show speculation at work, and the draft is
    # accepted most under greedy decoding (at 0.8 `auto` rightly keeps to plain steps on this pair).
    _add_generation_flags(demo, temp=0.0)

    bench = sub.add_parser("bench", help="strategies side by side on this device: table, JSON and plot")
    bench.add_argument("-m", "--model", required=True, help=MODEL_HELP)
    bench.add_argument("-md", "--model-draft", default=None, help=DRAFT_HELP)
    bench.add_argument("-s", "--strategies", default="ar,sps,lookahead,lookup,auto",
                       help=f"comma-separated strategies, of {','.join(REGISTRY)} "
                            "(default: ar,sps,lookahead,lookup,auto; sps and tree only with -md)")
    bench.add_argument("--prompts", default="builtin",
                       help="builtin, chat (instruct requests), extract (JSON extraction, each answer under its "
                            "schema), humaneval, or a JSONL file (default: builtin)")
    bench.add_argument("--memory", "--suffix-cache", dest="memory", action="store_true",
                       help="use and update the speculation memory (off by default: the bench's runs would "
                            "otherwise speed each other up, and its texts would stay in your memory)")
    bench.add_argument("--unmasked-drafts", action="store_true",
                       help="under a schema, let drafters propose without it (only the target is masked, as "
                            "llama.cpp does): what masking the drafts gains")
    bench.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    bench.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default: 3)")
    bench.add_argument("--sweep", action="store_true", help="also try a grid of K / W,N,G settings")
    bench.add_argument("--rotate", type=int, default=0, metavar="K",
                       help="start the configurations' turns at going first where K repeats would have left "
                            "them: repeats run as separate processes (each --repeats 1) then take turns too")
    bench.add_argument("--control", action="store_true",
                       help="run ar twice (an A/A row): its ratio is this machine's noise")
    bench.add_argument("--cost-k-max", type=int, default=32, help="batch cost curve up to k tokens; 0 skips (default: 32)")
    bench.add_argument("--clients", default=None, metavar="LIST",
                       help="load bench: C clients at once for each C in LIST (e.g. 1,2,4,8), each sending the "
                            "prompts one after another through the server's batching scheduler: aggregate tok/s, "
                            "time to first token, per-request tok/s (default: one sequence at a time)")
    bench.add_argument("--requests", type=int, default=None, metavar="N",
                       help="load bench: N requests in all, the prompts taken in turn (default: each prompt once). "
                            "More requests than clients keep every client busy, as a server in steady use is; "
                            "with one wave, its slowest request sets the end")
    bench.add_argument("--out", default="specchat-bench", help="folder for bench.json and bench.png")
    bench.add_argument("--raw", action="store_true",
                       help="send the prompts as they are, without the model's chat template")
    bench.add_argument("--system", default=None, help="system message for every prompt (models with a chat template)")
    # Greedy by default: the bench checks every strategy's output against ar's, token for token.
    _add_generation_flags(bench, output=False, temp=0.0)
    add_models_parser(sub, _Parser)
    add_serve_parser(sub, _Parser, _add_model_flags, lambda p: _add_generation_flags(p, output=False))
    add_rpc_parser(sub, _Parser)
    add_cache_parser(sub, _Parser)
    return parser


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", required=True, help=MODEL_HELP)
    p.add_argument("-md", "--model-draft", default=None, help=DRAFT_HELP)
    _add_strategy_flag(p)


def _add_strategy_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("-s", "--strategy", default=DEFAULT_STRATEGY, choices=list(REGISTRY),
                   help="; ".join(f"{k}: {v.help}" for k, v in REGISTRY.items()) + f" (default: {DEFAULT_STRATEGY})")


def _read_prompt(arg: str | None, flag: str | None = None) -> str:
    if flag is not None:
        if arg is not None:
            raise UserError("the prompt is given twice (as an argument and with -p): give it once")
        arg = flag
    if arg == "-":
        data = sys.stdin.buffer.read()
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"the prompt on stdin is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") \
                from None
    if arg is None:
        raise UserError("no prompt given (pass it as an argument, or - to read stdin)")
    return arg


class _Interrupt:
    """Ctrl-C from before the models load until they are freed. While generating, the first asks the generation to
    stop (the text so far is kept) and a second aborts; otherwise it is noted and the run ends once llama.cpp
    returns. An exception raised there would land in llama.cpp's log callback, which swallows it (a Ctrl-C while
    loading was lost, the run went on and exited 0), or in the middle of freeing the models (a segfault)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.generating = False
        self._previous: object = None

    def __enter__(self) -> "_Interrupt":
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._previous)  # type: ignore[arg-type]

    def _handle(self, signum: int, frame: object) -> None:
        if self.event.is_set() and self.generating:
            raise KeyboardInterrupt
        self.event.set()


def settings_from_args(args: argparse.Namespace, only: tuple[str, ...] = ("",)) -> Settings:
    """The flags as settings, through the table `chat` uses too (app.settings.flag_paths)."""
    try:
        return apply_flags(Settings(), args, only)
    except ValueError as e:
        raise UserError(str(e)) from None


def generate(args: argparse.Namespace) -> int:
    prompt_text = _read_prompt(args.prompt, getattr(args, "prompt_flag", None))
    settings = settings_from_args(args)
    options = settings.options
    if not settings.mtp:  # without the target's own head, whether there is a drafter is known before loading
        require_draft(args.strategy, settings.draft is not None)
    raw = getattr(args, "raw", False) or args.command == "demo"
    if raw and settings.system_prompt:
        raise UserError("--system needs the chat template; it cannot go with --no-conversation")
    with _Interrupt() as interrupt:
        engine = open_engine(settings, n_seq_needed(args.strategy, options), print_progress,
                             with_draft=REGISTRY[args.strategy].uses_draft)
        try:
            return _generate(args, engine, settings, prompt_text, raw, interrupt)
        finally:
            engine.close()


def _generate(args: argparse.Namespace, engine, settings: Settings, prompt_text: str, raw: bool,
              interrupt: _Interrupt) -> int:
    params, options = settings.params, settings.options
    require_draft(args.strategy, engine.draft is not None)
    strategy = engine.strategy(args.strategy, options)
    grammar = grammar_from_flags(args, engine.target_model)
    if grammar is not None:
        params = replace(params, grammar=grammar)
    prompt_format = PromptFormat(engine)
    kwargs = None
    if not raw and prompt_format.reasoning is not None:
        kwargs = prompt_format.thinking_kwargs(settings.thinking, effort=settings.reasoning_effort)
        params = replace(params, reasoning=prompt_format.reasoning_for([ChatMessage("user", prompt_text)],
                                                                       settings.system_prompt, kwargs=kwargs))
    elif settings.reasoning_effort is not None:  # a model that does not think, or no template: said so
        if raw:
            raise UserError("--reasoning-effort needs the chat template; it cannot go with --no-conversation")
        prompt_format.thinking_kwargs(settings.thinking, effort=settings.reasoning_effort)
    tokens = prompt_format.prompt(prompt_text, settings.system_prompt, raw=raw, kwargs=kwargs)
    color = sys.stdout.isatty() if args.color is None else args.color
    view = TextView(sys.stdout, color, reasoning=sys.stderr if getattr(args, "reasoning", "show") == "show"
                    else None)
    parse = getattr(args, "json_schema", None) is not None
    show: Callable[[object], None] = (lambda ev: print(event_json(ev, parse), flush=True)) if args.json \
        else view.show
    if args.command == "demo" and args.strategy == "auto" and not engine.measured_to():
        # The demo is there to show speculation at work. On a new machine `auto` decodes its first answer
        # plainly and measures the device's cost after it (backends.strategies.auto): the demo's one completion
        # would be plain, and the measurement paid at its end all the same. So it is measured first.
        print_progress("measuring this machine's costs (once; a few seconds)")
        engine.measure_now(tokens)
    if args.command == "demo" and not args.json:
        if color:
            print(LEGEND, file=sys.stderr, flush=True)
        view.show_prompt(prompt_text)
    cache_file = getattr(args, "prompt_cache", None)
    if cache_file is not None:
        _restore_prompt(engine, cache_file, tokens)
    if interrupt.event.is_set():  # while the models loaded: nothing generated
        print("specchat: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    done = None
    interrupt.generating = True
    try:
        for ev in strategy.generate(tokens, params, interrupt.event.is_set):
            show(ev)
            if isinstance(ev, Done):
                done = ev
    finally:
        interrupt.generating = False
    assert done is not None
    if cache_file is not None and done.reason != "error":
        _save_prompt(engine, cache_file, tokens)
    if args.stats:
        for line in stats_lines(done.stats, done.reason):
            print(line, file=sys.stderr)
    if done.reason == "error":
        print_error(done.error or "generation failed")
        return EXIT_RUNTIME
    return EXIT_INTERRUPTED if done.reason == "cancelled" else 0


def _restore_prompt(engine, path: Path, prompt: list[int]) -> None:
    """`--prompt-cache`: the prompt's cells from FILE where it starts the same way; a file of another model or
    context, or damaged, is one line on stderr, and the prompt decodes as without it (the file is replaced after).
    A file that is no specchat KV file is a user error before anything is generated: not ours to overwrite (as
    llama.cpp's --prompt-cache refuses a session file it cannot load)."""
    from backends.kv_store import KvStoreError, NotKvFile, read_entry, restore

    if not path.exists():
        return
    t0 = time.perf_counter()
    try:
        entry = read_entry(path, engine.kv_key())
    except NotKvFile as e:
        raise UserError(f"--prompt-cache: {e}; it is left as it is (give a new file's name)") from None
    except KvStoreError as e:
        print(f"specchat: prompt cache not used: {e}", file=sys.stderr, flush=True)
        return
    slot = engine.slots[0]
    n = restore(entry, slot.target, slot.draft, prompt)
    if n:
        print_progress(f"restored {n} prompt tokens from {path} in {1000 * (time.perf_counter() - t0):.0f} ms")


def _save_prompt(engine, path: Path, prompt: list[int]) -> None:
    """`--prompt-cache`: the prompt's cells (the answer's cut off) into FILE, atomically."""
    from backends.kv_store import snapshot, write_entry

    slot = engine.slots[0]
    entry = snapshot(slot.target, slot.draft, upto=len(prompt))
    if entry is not None:
        try:
            write_entry(path, engine.kv_key(), entry)
        except OSError as e:
            print(f"specchat: prompt cache not written: {e.strerror or e}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command in (None, "chat"):
            from app.commands.chat import chat

            return chat(args)
        if args.command == "models":
            return run_models(args)
        if args.command == "cache":
            return run_cache(args)
        from backends.llama_process import set_native_logging  # llama.cpp loads only for the commands that run it

        set_native_logging(args.debug)
        if args.command == "rpc-server":
            from app.commands.rpc import run_rpc_server

            return run_rpc_server(args)
        if args.command == "demo":
            if args.color is None:
                args.color = True
            args.stats = True
            args.model, args.model_draft = "demo", "demo-draft"
            return generate(args)
        if args.command == "bench":
            from app.commands.bench import bench

            return bench(args, settings_from_args(args))
        if args.command == "serve":
            from app.commands.serve import run_serve

            return run_serve(args, settings_from_args(args))
        return generate(args)
    except KeyboardInterrupt:
        print("\nspecchat: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader closed the pipe (`| head`): stop quietly, as other command-line tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except Exception as e:  # one line unless --debug
        if args.debug:
            raise
        if is_user_error(e):
            print_error(describe(e))
            return EXIT_USER
        print_error(f"{describe(e)} (run with --debug for details)")
        return EXIT_RUNTIME


def entry() -> None:
    sys.exit(main())
