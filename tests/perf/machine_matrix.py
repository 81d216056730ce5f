"""`auto` against `ar` on the conditions that change a machine's costs (not a test: a measurement).

"Never slower than plain decoding" has to hold on machines unlike the one
`auto` was tuned on, so this runs the default strategy against `-s ar` over
the conditions that move the costs, one cell each, and writes the table:

- threads: `-t 1` and `-t 2`;
- a CPU hog beside it (a busy loop on one core) or not;
- the draft at Q2_K (the bundled `smollm2-draft`), Q8_0 (derived once with
  `specchat models derive`) and F32 (the target itself: a draft as costly as
  the target, with which speculation can only lose);
- 1, 2, 4 and 8 clients kept busy;
- temperatures 0 and 0.8;
- in process (`specchat bench --clients`: the server's scheduler, both
  strategies in one run, interleaved) and over HTTP, streamed (two
  `specchat serve` processes, `-s ar` and the default, both without the
  speculation memory unless `--memory`, driven alternately by
  the `openai` client: tests/perf/serve_vs_llama_server.py's driver).

Each cell is the median over `--repeats` of `auto`'s tokens per second in
all against `ar`'s in the same repeat; who goes first turns by one a repeat
(in process, each repeat a fresh `bench` process with `--rotate`). With
`--control`, `ar` runs a second time in each repeat (an A/A row) and the
table gives its ratio too: the noise a cell is read against (with a busy loop
beside it, wider than the bar: docs/results.md). The whole matrix is 192
cells; pick a part with the flags. Each cell measured is appended to the
record (docs/matrix.jsonl; tests/perf/matrix_record.py), and `--table` draws
the whole matrix from the newest record of each cell on this machine, the
cells not run yet included (docs/matrix.md):

    python tests/perf/machine_matrix.py --threads 2 --hog off --drafts q2,f32 --clients 1,4 --temps 0.8 --modes inproc
    python tests/perf/machine_matrix.py --table

A GPU machine offloads both models (`-ngl 99`) and may take another target
(`--target FILE`, e.g. the Q2_K SmolLM2 where the F32 one cannot travel):
its cells are recorded apart, the GPU named in the machine and the target
in the record (docs/results.md, "A GPU"). There each run lasts at least
`--seconds` (5 by default with `-ngl`): a fast step makes sixteen requests a
run of a second or less, which `auto`'s exploration and the machine's noise
fill (docs/results.md, "A fast step").
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "perf"))

from app.bench.prompts import load_prompt_set  # noqa: E402
from matrix_record import BAR, Cell, append, commit, machine_id, newest, render, runs_text  # noqa: E402
from models.resolve import resolve_model  # noqa: E402

RECORD = ROOT / "docs" / "matrix.jsonl"
TARGET = "smollm2"
TABLE = ROOT / "docs" / "matrix.md"


def hog() -> subprocess.Popen:
    """A busy loop on one core, as another program on the user's laptop."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def draft_path(name: str, target: Path) -> Path:
    """The draft of that quantization: the bundled Q2_K, a Q8_0 derived once into the data dir, or F32 (the
    target itself)."""
    if name == "q2":
        return resolve_model("smollm2-draft")
    if name == "f32":
        return target
    if name == "q8":
        out = Path(tempfile.gettempdir()) / "specchat-matrix-smollm2-Q8_0.gguf"
        if not out.exists():
            subprocess.run([sys.executable, "-m", "app", "models", "derive", str(target), "Q8_0", "-o", str(out)],
                           check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        return out
    raise SystemExit(f"unknown draft {name!r}: q2, q8 or f32")


def offload(args: argparse.Namespace) -> list[str]:
    """The target's and the draft's layers on the GPU (`-ngl`, `-ngld`): a GPU machine's matrix."""
    return ["-ngl", str(args.gpu_layers), "-ngld", str(args.gpu_layers)] if args.gpu_layers else []


def bench_load(target: Path, draft: Path, strategies: str, clients: list[int], requests: int, temp: float,
               threads: int, args: argparse.Namespace, *extra: str) -> list[dict]:
    """One `specchat bench --clients` process (one repeat, the chat prompts at seed 1): its load rows."""
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "-m", "app", "bench", "-m", str(target), "-md", str(draft), "-s", strategies,
                        "--prompts", "chat", "--clients", ",".join(map(str, clients)), "--requests", str(requests),
                        "-n", str(args.n), "--temp", str(temp), "--seed", "1", "--repeats", "1", *extra,
                        "-t", str(threads), *offload(args), "--out", out], check=True, cwd=ROOT,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return json.loads((Path(out) / "bench.json").read_text())["load"]


def requests_for(target: Path, draft: Path, threads: int, clients: list[int], temp: float,
                 args: argparse.Namespace) -> int:
    """Requests a run for `ar` at the most clients to take at least `args.seconds` (never fewer than
    `args.requests`), from a short run of it timed now, on this group's threads, temperature and busy core."""
    if args.seconds <= 0:
        return args.requests
    most = max(clients)
    rate = bench_load(target, draft, "ar", [most], 2 * most, temp, threads, args)[0]["aggregate_tokens_per_second"]
    requests = max(args.requests, math.ceil(args.seconds * rate / args.n))
    print(f"({requests} requests a run: `ar` at {most} client{'s' * (most > 1)} made {rate:.0f} tok/s)",
          file=sys.stderr, flush=True)
    return requests


Ratios = dict[str, dict[int, list[float]]]  # "auto" (and "control": ar's second run) -> clients -> per repeat


def inproc(target: Path, draft: Path, threads: int, clients: list[int], temp: float, args: argparse.Namespace
           ) -> Ratios:
    """auto / ar (and ar / ar) per client count, one figure per repeat, from `specchat bench --clients`."""
    ratios: Ratios = {}
    for rep in range(args.repeats):
        for row in bench_load(target, draft, "ar,auto", clients, args.requests, temp, threads, args, "--rotate",
                              str(rep), *(["--control"] if args.control else [])):
            kind = "auto" if row["strategy"] == "auto" else "control" if row["label"] != "ar" else None
            if kind is not None:
                ratios.setdefault(kind, {}).setdefault(row["clients"], []).append(row["speedup_vs_ar"])
    return ratios


def http(target: Path, draft: Path, threads: int, clients: list[int], temp: float, args: argparse.Namespace
         ) -> Ratios:
    """auto / ar (and ar / ar) per client count over HTTP, streamed: two servers (three), driven in turns."""
    from serve_vs_llama_server import MODEL_ID, Server, load

    MODEL_ID[0] = target.stem
    requests = [[{"role": m.role, "content": m.content} for m in p.messages] or
                [{"role": "user", "content": p.chat_text()}] for p in load_prompt_set("chat", 8)]
    requests = [requests[i % len(requests)] for i in range(args.requests)]
    log_dir = Path(tempfile.mkdtemp(prefix="matrix-"))
    ratios: Ratios = {}
    off = "" if args.memory else " --no-suffix-cache"  # the speculation memory, on by default in a server
    off += "".join(" " + a for a in offload(args))
    specs = [("ar", "-s ar" + off), ("auto", off.strip()), *([("control", "-s ar" + off)] if args.control else [])]
    servers = [Server(name, flags, target, draft, max(clients), 4096, threads, log_dir) for name, flags in specs]
    try:
        for s in servers:  # warm-up
            load(s, requests[:2], 2, 8, temp)
        for c in clients:
            for rep in range(args.repeats):
                turn = rep % len(servers)
                rate = {s.name: load(s, requests, c, args.n, temp)[0] for s in servers[turn:] + servers[:turn]}
                for kind in rate.keys() - {"ar"}:
                    ratios.setdefault(kind, {}).setdefault(c, []).append(rate[kind] / rate["ar"])
    finally:
        for s in servers:
            s.stop()
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--hog", default="off,on")
    ap.add_argument("--drafts", default="q2,q8,f32")
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--temps", default="0,0.8")
    ap.add_argument("--modes", default="inproc,http")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16,
                    help="requests per cell and repeat, the prompts in turn (at least: see --seconds)")
    ap.add_argument("--seconds", type=float,
                    help="runs of at least this many seconds: before each group of cells `ar` is timed at the most "
                         "clients on a short run, and --requests raised to fill them (0 without -ngl, 5 with it: "
                         "on a fast step 16 requests are a run of a second or two, which exploration and the "
                         "machine's noise fill; on an H200, 0.35 s)")
    ap.add_argument("-n", type=int, default=64, help="tokens per request")
    ap.add_argument("--target", default=TARGET,
                    help=f"the target, a name or a GGUF path ({TARGET}, the F32 SmolLM2: the matrix's own); another "
                         "is recorded apart, for a machine that cannot hold that one (the F32 draft is the target)")
    ap.add_argument("-ngl", "--gpu-layers", type=int, default=0,
                    help="layers of the target and of the draft offloaded to the GPU (0: a CPU's matrix); recorded "
                         "apart, the GPU named in the machine")
    ap.add_argument("--control", action="store_true", help="run ar twice in each repeat: an A/A column (the noise)")
    ap.add_argument("--memory", action="store_true",
                    help="over HTTP, the servers with the speculation memory (their default; without it they run "
                         "--no-suffix-cache, as `bench` in process always does): the matrix's requests repeat prompts "
                         "at one seed, which the memory answers from what it kept, so such a run is recorded apart "
                         "and not drawn as the cell's")
    ap.add_argument("--out", type=Path, help="write this run's table here too (markdown)")
    ap.add_argument("--record", type=Path, default=RECORD, help="append each cell measured here (JSON lines)")
    ap.add_argument("--no-record", action="store_true", help="measure without adding to the record")
    ap.add_argument("--table", nargs="?", type=Path, const=TABLE,
                    help=f"measure nothing: draw the whole matrix from the record into this file ({TABLE.name})")
    args = ap.parse_args()
    if args.seconds is None:
        args.seconds = 5.0 if args.gpu_layers else 0.0
    machine = machine_id(gpu=args.gpu_layers != 0)
    other = None if args.target == TARGET else Path(args.target).name  # recorded apart from the matrix's own
    if args.table is not None:
        head = ("# The machine matrix\n\nIssue 42's promise, `auto` at least 0.97× `-s ar`, cell by cell: the newest "
                "record of each cell (docs/matrix.jsonl, appended by every run of tests/perf/machine_matrix.py), drawn "
                "by `python tests/perf/machine_matrix.py --table`. Each repeat's figure is `auto`'s tokens per second "
                "in all against `ar`'s in the same repeat; the A/A column is `ar` against itself (`--control`), the "
                "noise a cell is read against. Cells measured before the record began (2026-11-29) are in "
                "docs/results.md.\n\n")
        args.table.write_text(head + render(newest(args.record, machine, other), machine), encoding="utf-8")
        print(f"wrote {args.table}")
        return
    code, day = commit(ROOT), time.strftime("%Y-%m-%d")
    target = resolve_model(args.target)
    clients = [int(c) for c in args.clients.split(",")]
    lines = ["| threads | hog | draft | temp | mode | clients | auto / ar (median) | repeats | ≥ 0.97 |"
             + (" ar / ar (A/A) |" if args.control else ""),
             "|---:|---|---|---:|---|---:|---:|---|---|" + ("---|" if args.control else "")]
    print("\n".join(lines), flush=True)
    for threads, hogged, draft, temp, mode in itertools.product(
            [int(t) for t in args.threads.split(",")], args.hog.split(","), args.drafts.split(","),
            [float(t) for t in args.temps.split(",")], args.modes.split(",")):
        busy = hog() if hogged == "on" else None
        try:
            run = inproc if mode == "inproc" else http
            dpath = draft_path(draft, target)
            cell_args = argparse.Namespace(**{**vars(args), "requests": requests_for(target, dpath, threads,
                                                                                     clients, temp, args)})
            ratios = run(target, dpath, threads, clients, temp, cell_args)
        finally:
            if busy is not None:
                busy.kill()
        for c in clients:
            got = ratios.get("auto", {}).get(c, [])
            med = statistics.median(got) if got else float("nan")
            line = (f"| {threads} | {hogged} | {draft} | {temp:g} | {mode} | {c} | {med:.2f} | "
                    f"{runs_text(got)} | {'yes' if med >= BAR else '**no**'} |")
            if args.control:
                aa = ratios.get("control", {}).get(c, [])
                line += f" {statistics.median(aa) if aa else float('nan'):.2f} ({runs_text(aa)}) |"
            lines.append(line)
            print(line, flush=True)
            if got and not args.no_record:
                append(args.record, Cell(threads, hogged, draft, temp, mode, c), got,
                       ratios.get("control", {}).get(c, []), code=code, day=day, machine=machine,
                       requests=cell_args.requests, n=args.n, memory=mode == "http" and args.memory, target=other)
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
