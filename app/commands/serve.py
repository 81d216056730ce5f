"""`specchat serve`: flags, loading the engine, and running the server (app/serve/) on uvicorn.

    specchat serve -m TARGET [-md DRAFT] [-s STRATEGY] [generation flags] [-np 4] [--host 127.0.0.1] [--port 8080]
                   [--api-key KEY]

The generation flags are every request's defaults; a request overrides them
field by field. The server binds 127.0.0.1 unless told otherwise, and says so
on stderr when it listens anywhere else. With `--api-key` (or
SPECCHAT_API_KEY, which keeps the key out of the process list) every /v1
route wants `Authorization: Bearer KEY`. One line on stderr gives the URL once
the model is loaded and the socket listens; Ctrl-C (uvicorn's own handling)
cancels what is running, stops the worker and frees the engine.

`--no-think` and `--reasoning-budget N` are every chat's defaults for a
thinking model (app/serve/thinking.py: a request's `chat_template_kwargs`,
`reasoning_effort` and `reasoning_budget_tokens` override them).

`--parallel N` (`-np`, llama-server's spelling) requests decode together in
one batch per step (continuous batching, backends.scheduler); more wait in
arrival order. Each has the whole `-c` context, so the KV cache holds N times
`-c` cells. What a slot gives up for a new prompt is kept in RAM, up to
`--cache-ram` MiB, and put back when its conversation returns
(backends.prompt_cache). `--slot-save-path DIR` turns on llama-server's
manual slot API (`POST /slots/{id}?action=save|restore|erase`,
app/serve/slots.py). Before it listens, the server makes sure the device's
batch cost curve is known up to the largest batch it may decode (measured
once, kept on disk), since `auto` prices every row it adds to the batch by it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Callable

from app.errors import EXIT_OK, EXIT_RUNTIME, UserError, print_error, print_progress
from app.settings import Settings
from backends.config import PROMPT_CACHE_MIB

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_PARALLEL = 4
# Sequence ids one request's strategy may use (lookahead W+G+1, a tree one per path), at most; fewer when
# --parallel N times this is over llama.cpp's limit.
N_SEQ_PER_REQUEST = 64
# The batch cost curve is measured up to this many rows when several requests decode together (beyond it,
# auto extrapolates linearly): a few seconds once per device and model files.
COST_ROWS_MAX = 64
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
API_KEY_ENV = "SPECCHAT_API_KEY"


def add_serve_parser(sub: argparse._SubParsersAction, parser_class: type[argparse.ArgumentParser],
                     add_model_flags: Callable[[argparse.ArgumentParser], None],
                     add_generation_flags: Callable[[argparse.ArgumentParser], None]) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible local server with speculative decoding",
                           description="An OpenAI-compatible server (/v1/chat/completions, /v1/completions, "
                                       "/v1/models, /health) over one engine. The flags below are every request's "
                                       "defaults; a request's 'speculative' object picks the strategy per request.")
    add_model_flags(serve)
    add_generation_flags(serve)
    net = serve.add_argument_group("server")
    net.add_argument("-np", "--parallel", type=int, default=DEFAULT_PARALLEL, metavar="N",
                     help=f"requests decoded together in one batch (default: {DEFAULT_PARALLEL}); more wait in "
                          "arrival order; each has the whole context (-c), so the KV cache holds N times it")
    net.add_argument("-cram", "--cache-ram", type=int, default=PROMPT_CACHE_MIB, metavar="MiB",
                     help=f"RAM for the prompts slots give up, put back when their conversation returns "
                          f"(llama-server's spelling; default: {PROMPT_CACHE_MIB}, 0: off)")
    net.add_argument("--slot-save-path", default=None, metavar="DIR",
                     help="folder for the files of POST /slots/{id}?action=save|restore|erase (llama-server's "
                          "flag; default: off, the endpoint then answers 501)")
    net.add_argument("--host", default=DEFAULT_HOST,
                     help=f"address to listen on (default: {DEFAULT_HOST}, this machine only)")
    net.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port; 0 picks a free one (default: {DEFAULT_PORT})")
    net.add_argument("--api-key", default=None, metavar="KEY",
                     help=f"require 'Authorization: Bearer KEY' on /v1 routes (default: ${API_KEY_ENV} if set)")


def _configure_logging() -> None:
    logger = logging.getLogger("specchat.serve")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("specchat serve: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _slot_folder(value: str | None) -> Path | None:
    """--slot-save-path: an existing folder (llama-server refuses anything else at start too)."""
    if value is None:
        return None
    folder = Path(value).expanduser()
    if not folder.is_dir():
        raise UserError(f"--slot-save-path: not a folder: {value}")
    return folder


def _model_ids(reference: str, target_stem: str) -> tuple[str, ...]:
    """The listed id is the target file's stem; the reference given with -m is accepted too."""
    return tuple(dict.fromkeys((target_stem, reference)))


def run_serve(args: argparse.Namespace, settings: Settings) -> int:
    import uvicorn

    from app.loading import open_engine
    from app.prompt_format import ThinkingError
    from app.serve import AnnouncingServer, EngineWorker, ServerConfig, make_app
    from backends.config import AUTO_K_MAX
    from backends.llama import max_sequences
    from backends.registry import require_draft

    if not 0 <= args.port < 65536:
        raise UserError(f"--port must be in 0..65535, got {args.port}")
    if args.cache_ram < 0:
        raise UserError(f"--cache-ram must be 0 (off) or more MiB, got {args.cache_ram}")
    slot_save_path = _slot_folder(args.slot_save_path)
    parallel = args.parallel
    if not 1 <= parallel <= min(max_sequences(), settings.n_batch):
        raise UserError(f"--parallel must be in 1..{min(max_sequences(), settings.n_batch)}, got {parallel}")
    if not settings.mtp:  # a target's own MTP head is known once it is loaded
        require_draft(settings.strategy, settings.draft is not None)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if args.host not in LOOPBACK_HOSTS:
        print(f"specchat serve: warning: listening on {args.host}, reachable from other machines"
              + ("" if api_key else "; without --api-key anyone who reaches it can use it"),
              file=sys.stderr, flush=True)
    _configure_logging()
    n_seq = min(N_SEQ_PER_REQUEST, max_sequences() // parallel)
    engine = open_engine(settings, n_seq, print_progress, with_draft=True, n_parallel=parallel)  # fits the batch
    try:
        require_draft(settings.strategy, engine.draft is not None)
        if parallel > 1:  # measuring later would decode in the middle of other requests' steps
            rows = min(settings.n_batch, max(AUTO_K_MAX, COST_ROWS_MAX))
            if not engine.measured_to(rows):  # a new machine: ~15 s of silence before the URL otherwise
                print_progress(f"measuring this machine's batch cost, 1 to {rows} rows (once: kept for later starts)")
            if engine.measure_now(engine.tokenize("The quick brown fox jumps over the lazy dog."), rows) is None:
                print_progress("cannot measure the device's batch cost here: auto and tree decode plainly")
        worker = EngineWorker(engine, cache_mib=args.cache_ram, kv_disk=settings.kv_disk)
        try:  # --no-think is every chat's default: refused now on a template that cannot turn thinking off
            worker.format.thinking_kwargs(settings.thinking)
        except ThinkingError as e:
            raise UserError(f"--no-think: {e} (--reasoning-budget N)") from None
        worker.start()
        try:
            config = ServerConfig(
                defaults=settings, model_ids=_model_ids(settings.target or "", engine.config.target.stem),
                api_key=api_key, draft_id=engine.config.draft.stem if engine.config.draft else None,
                slot_save_path=slot_save_path,
            )
            server = AnnouncingServer(
                # asyncio's loop even where uvloop is installed: under uvloop the threads slept and woke 2.0-3.1
                # times a streamed token against 0.9-1.1 (tests/test_compute_threads.py, docs/results.md)
                uvicorn.Config(make_app(config, worker), host=args.host, port=args.port, log_level="warning",
                               access_log=False, lifespan="off", timeout_graceful_shutdown=10, loop="asyncio"),
                config.model_ids[0], worker.cancel_all)
            try:
                server.run()
            except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled, once it has shut down
                pass
            except SystemExit:  # uvicorn could not start (it logged why: the port is taken, ...)
                print_error(f"cannot serve on {args.host}:{args.port}")
                return EXIT_RUNTIME
        finally:
            worker.stop()
    finally:
        engine.close()
    print("specchat serve: stopped", file=sys.stderr, flush=True)
    return EXIT_OK
