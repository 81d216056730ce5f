"""What the chat app's UI costs: idle CPU, and generation tokens/s in the app vs `specchat run`.

Drives the real app in a real terminal (tmux: send-keys / capture-pane) on the
demo pair, interleaving app turns with headless `specchat run` on the same
prompt and settings, and reports medians. Not a test (timings are never
asserted); run it on a quiet machine:

    python tests/perf/tui_overhead.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

SESSION = "specchat-perf"
TOKS = re.compile(r"tokens/forward\s+│\s+([\d.]+) tok/s")
PROMPT = "Once upon a time, in a small village,"


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=True).stdout


def screen() -> str:
    return tmux("capture-pane", "-t", SESSION, "-p")


def wait_for(pattern: str, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = screen()
        if re.search(pattern, text):
            return text
        time.sleep(0.2)
    raise TimeoutError(f"{pattern!r} did not appear:\n{screen()}")


def app_pid() -> int:
    pane_pid = tmux("display-message", "-t", SESSION, "-p", "#{pane_pid}").strip()
    out = subprocess.run(["pgrep", "-P", pane_pid], capture_output=True, text=True).stdout.split()
    return int(out[0]) if out else int(pane_pid)


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_cli(flags: list[str]) -> float:
    out = subprocess.run([sys.executable, "-m", "app", "run", PROMPT, "-m", "demo", "-md", "demo-draft", "--json",
                          *flags], capture_output=True, text=True, check=True).stdout
    done = json.loads(out.strip().splitlines()[-1])
    return done["stats"]["tokens_per_second"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--strategy", default="sps")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--idle-seconds", type=float, default=10.0)
    args = ap.parse_args()
    flags = ["-s", args.strategy, "-n", str(args.n), "-t", str(args.t)]
    # A fresh config dir: the saved settings of the user do not leak in.
    command = f"env SPECCHAT_CONFIG_DIR={tempfile.mkdtemp()} {sys.executable} -m app chat -m demo -md demo-draft " \
              + " ".join(flags)
    subprocess.run(["tmux", "kill-session", "-t", SESSION], capture_output=True)
    tmux("new-session", "-d", "-s", SESSION, "-x", "120", "-y", "40", command)
    try:
        wait_for(r"plain decoding here: [\d.]+ tok/s")  # loaded and calibrated
        pid = app_pid()
        time.sleep(1.0)
        before = cpu_seconds(pid)
        time.sleep(args.idle_seconds)
        idle = (cpu_seconds(pid) - before) / args.idle_seconds
        print(f"idle app: {100 * idle:.2f}% of one core over {args.idle_seconds:.0f} s")
        cli_rates, app_rates = [], []
        for i in range(args.repeats):
            cli_rates.append(run_cli(flags))
            tmux("send-keys", "-t", SESSION, "C-n")  # new chat: every turn answers the same prompt
            wait_for(r"·  new chat")
            tmux("send-keys", "-t", SESSION, "-l", PROMPT)
            tmux("send-keys", "-t", SESSION, "Enter")
            text = wait_for(r"done: (length|eos|stop)")
            app_rates.append(float(TOKS.search(text).group(1)))
            print(f"repeat {i + 1}: specchat run {cli_rates[-1]:.2f} tok/s, app {app_rates[-1]:.2f} tok/s")
        ratio = statistics.median(a / c for a, c in zip(app_rates, cli_rates))
        print(f"median: specchat run {statistics.median(cli_rates):.2f} tok/s, app {statistics.median(app_rates):.2f} "
              f"tok/s; app / run = {ratio:.3f} (median of per-repeat ratios)")
    finally:
        subprocess.run(["tmux", "kill-session", "-t", SESSION], capture_output=True)


if __name__ == "__main__":
    main()
