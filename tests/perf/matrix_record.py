"""The machine matrix's record: every cell measured, kept, and the whole matrix drawn from it.

Issue 42's matrix is 192 cells (threads × a busy core × draft × temperature ×
mode × clients); one session's machine time runs a few dozen of them, so
tests/perf/machine_matrix.py appends each cell it measures here as one JSON
line (its repeats, the A/A control's, the commit, the day, the machine), and
`render` draws all 192 from the newest record of each cell on one machine,
saying which cells have no record yet. A table that only ever showed the
cells of its last run would hide the ones nobody ran.

    python tests/perf/machine_matrix.py --table          # docs/matrix.md from docs/matrix.jsonl
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import statistics
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

BAR = 0.97  # the promise: auto at least this share of ar's tokens per second in every cell
THREADS = (1, 2)
HOGS = ("off", "on")
DRAFTS = ("q2", "q8", "f32")
TEMPS = (0.0, 0.8)
MODES = ("inproc", "http")
CLIENTS = (1, 2, 4, 8)
DRAFT_NAMES = {"q2": "Q2_K", "q8": "Q8_0", "f32": "F32"}
MODE_NAMES = {"inproc": "in process", "http": "HTTP"}


@dataclass(frozen=True)
class Cell:
    """One condition of the matrix."""

    threads: int
    hog: str
    draft: str
    temp: float
    mode: str
    clients: int

    def __post_init__(self) -> None:
        if self.threads < 1 or self.clients < 1:
            raise ValueError(f"threads and clients must be at least 1: {self}")
        if self.hog not in HOGS or self.draft not in DRAFTS or self.mode not in MODES:
            raise ValueError(f"unknown condition in {self}: hog {HOGS}, draft {DRAFTS}, mode {MODES}")
        if self.temp < 0:
            raise ValueError(f"temperature must be at least 0: {self}")


def all_cells() -> list[Cell]:
    """The whole matrix, in the order the table reads it."""
    return [Cell(t, h, d, temp, m, c) for t, h, d, temp, m, c in
            itertools.product(THREADS, HOGS, DRAFTS, TEMPS, MODES, CLIENTS)]


def machine_id(gpu: bool = False) -> str:
    """The CPU's model and how many CPUs this process may use, and with `gpu` the GPUs nvidia-smi names: what
    makes one machine's records one set."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {cpus} CPUs" + (f", {_gpus()}" if gpu else "")


def _gpus() -> str:
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, check=True, timeout=30).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return "a GPU"
    names = [n.strip() for n in names if n.strip()]
    return " + ".join(names) if names else "a GPU"


def commit(root: Path) -> str:
    """The code measured: HEAD's short hash, marked when the product's code (app/, backends/, models/) has
    changes not committed (the measurement scripts' own do not change what is measured)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "app", "backends",
                                "models"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def append(path: Path, cell: Cell, auto: list[float], control: list[float], *, code: str, day: str, machine: str,
           requests: int, n: int, memory: bool = False, target: str | None = None) -> dict:
    """Add one measured cell to the record (one JSON line) and return it. `memory`: the servers ran with the
    speculation memory (a server's default), which answers the matrix's prompts, repeated at one seed, from
    what it kept: a figure of the memory, kept in the record but not drawn as the cell's. `target`: the target's
    file, where it is not the matrix's own (the F32 SmolLM2), a record apart."""
    if not auto:
        raise ValueError(f"no repeat measured for {cell}")
    row = {"cell": asdict(cell), "auto": [round(r, 4) for r in auto], "control": [round(r, 4) for r in control],
           "commit": code, "day": day, "machine": machine, "requests": requests, "n": n, "memory": memory}
    if target is not None:
        row["target"] = target
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(row, sort_keys=True) + "\n")
    return row


def newest(path: Path, machine: str, target: str | None = None) -> dict[Cell, dict]:
    """The last record of each cell measured on `machine` with `target` (None: the matrix's own) and without the
    memory (a later run of a cell replaces an earlier one)."""
    out: dict[Cell, dict] = {}
    if not path.exists():
        return out
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            cell = Cell(**row["cell"])
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"{path}:{number}: not a matrix record ({e})") from None
        if row.get("machine") == machine and row.get("target") == target and not row.get("memory"):
            out[cell] = row
    return out


def runs_text(values: list[float]) -> str:
    """Each repeat's figure, as the tables print them: `1.02 / 0.97 / 1.05`."""
    return " / ".join(f"{v:.2f}" for v in values)


def render(records: dict[Cell, dict], machine: str) -> str:
    """Markdown: a count of the cells at the bar, below it and not run, then one row per cell of the matrix."""
    cells = all_cells()
    medians = {c: statistics.median(records[c]["auto"]) for c in cells if c in records}
    enough = {c for c in medians if len(records[c]["auto"]) >= 3}
    below = sorted((c for c in medians if medians[c] < BAR), key=cells.index)
    lines = [
        f"Machine: {machine}. {len(medians)} of {len(cells)} cells measured ({len(enough)} over at least 3 repeats); "
        f"{len(medians) - len(below)} at or above {BAR} by the median, {len(below)} below"
        + (": " + "; ".join(_name(c) + f" {medians[c]:.2f}" for c in below) if below else "") + ".",
        "",
        "| threads | busy core | draft | temp | mode | clients | `auto` / `ar` (median) | by repeat | "
        f"≥ {BAR} | `ar` / `ar` (A/A) | commit | day | requests × tokens |",
        "|---:|---|---|---:|---|---:|---:|---|---|---|---|---|---|",
    ]
    for c in cells:
        head = (f"| {c.threads} | {c.hog} | {DRAFT_NAMES[c.draft]} | {c.temp:g} | {MODE_NAMES[c.mode]} | "
                f"{c.clients} |")
        row = records.get(c)
        if row is None:
            lines.append(head + " not run | | | | | | |")
            continue
        aa = row["control"]
        lines.append(
            head + f" {medians[c]:.2f} | {runs_text(row['auto'])} | {'yes' if medians[c] >= BAR else '**no**'} | "
            + (f"{statistics.median(aa):.2f} ({runs_text(aa)})" if aa else "")
            + f" | {row['commit']} | {row['day']} | {row['requests']} × {row['n']} |")
    return "\n".join(lines) + "\n"


def _name(c: Cell) -> str:
    return (f"-t {c.threads}, busy core {c.hog}, {DRAFT_NAMES[c.draft]}, {c.temp:g}, {MODE_NAMES[c.mode]}, "
            f"{c.clients} client{'s' if c.clients > 1 else ''}")
