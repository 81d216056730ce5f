"""Sum a tick log (SPECCHAT_TICK_LOG, backends.tick_log) by process, batch size and kind (not a test: a reading).

    SPECCHAT_TICK_LOG=/tmp/ticks.jsonl python -m app serve ...   # or bench --clients; drive it, stop it
    python tests/perf/tick_log.py /tmp/ticks.jsonl [--since T] [--until T]

Per process (pid) and batch size: the ticks of each kind the realised check
counted them as, their tokens, seconds (less the catch-ups left out), tokens
per second, the median and 90th percentile of a tick's time (beside a busy
core a tick's time is bimodal: a thread waiting out the other program's time
slice), the host's milliseconds a tick (its time outside llama_decode); then
the verdicts `Realised.pays` gave, and how many ticks were decoded before any
verdict (None: speculation unjudged at that batch size).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def read(path: Path, since: float | None = None, until: float | None = None) -> list[dict]:
    """The log's ticks within [since, until]; a line that is not a tick (a write cut short) is skipped."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            tick = json.loads(line)
            t = float(tick["t"])
        except (ValueError, KeyError, TypeError):
            continue
        if (since is None or t >= since) and (until is None or t <= until):
            out.append(tick)
    return out


def summary(ticks: list[dict]) -> str:
    """The table: one row per process, batch size and kind."""
    groups: dict[tuple[int, int, str], list[dict]] = defaultdict(list)
    verdicts: dict[tuple[int, int], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for t in ticks:
        groups[(t["pid"], t["sequences"], t["kind"] or "-")].append(t)
        if t["kind"] != "prompt":
            verdicts[(t["pid"], t["sequences"])][str(t["verdict"])] += 1
    lines = ["| pid | batch | kind | ticks | rows/tick | tokens | seconds | tok/s | s/tick p50 | p90 | host ms/tick | "
             "verdicts |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for (pid, batch, kind), group in sorted(groups.items()):
        secs = sorted(t["seconds"] - t["switching"] for t in group)
        tokens, seconds = sum(t["tokens"] for t in group), sum(secs)
        rate = tokens / seconds if seconds > 0 else 0.0
        said = ", ".join(f"{k} {n}" for k, n in sorted(verdicts[(pid, batch)].items()))
        host = 1000 * sum(t["seconds"] - t.get("decode", 0.0) - t.get("draft", 0.0) for t in group) / len(group)
        lines.append(f"| {pid} | {batch} | {kind} | {len(group)} | {sum(t['rows'] for t in group) / len(group):.1f} | "
                     f"{tokens} | {seconds:.2f} | {rate:.1f} | {statistics.median(secs):.4f} | "
                     f"{secs[min(len(secs) - 1, 9 * len(secs) // 10)]:.4f} | {host:.2f} | {said} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log", type=Path)
    ap.add_argument("--since", type=float, help="ticks from this time on (seconds since the epoch)")
    ap.add_argument("--until", type=float, help="ticks up to this time")
    args = ap.parse_args()
    ticks = read(args.log, args.since, args.until)
    if not ticks:
        sys.exit(f"{args.log}: no ticks")
    print(summary(ticks))


if __name__ == "__main__":
    main()
