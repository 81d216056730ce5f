"""The README's commands exist as written: every `specchat ...` line in it names a command whose --help works, and
every flag it passes is one that command takes; the docs it links to exist; it stays a front door (short)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _specchat_lines() -> list[list[str]]:
    """Every `specchat ...` invocation in the README's examples (its indented command lines), split into words
    (up to a comment, `&&`, `|`)."""
    out = []
    for line in README.splitlines():
        if not line.startswith("    ") or "specchat" not in line:
            continue
        for part in re.split(r"&&|\|", line):
            part = part.split("#")[0].strip().strip("`")
            if part.startswith("specchat"):
                out.append(part.split())
    return out


def _help(command: str) -> str:
    args = [command, "--help"] if command else ["--help"]
    if command == "cache":
        args = ["cache", "stats", "--help"]
    r = subprocess.run([sys.executable, "-m", "app", *args], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, f"specchat {command} --help failed: {r.stderr}"
    return r.stdout


def test_the_readme_is_a_front_door() -> None:
    assert len(README.splitlines()) <= 400
    for link in re.findall(r"\]\((docs/[^)#]+)", README):
        assert (ROOT / link).is_file(), f"the README links to {link}, which does not exist"


def test_every_command_in_the_readme_exists_and_takes_its_flags() -> None:
    lines = _specchat_lines()
    commands = {words[1] if len(words) > 1 and not words[1].startswith("-") else "" for words in lines}
    assert {"chat", "run", "demo", "models", "bench", "serve", "cache", "rpc-server"} <= commands
    helps = {c: _help(c) for c in commands}
    for words in lines:
        command = words[1] if len(words) > 1 and not words[1].startswith("-") else ""
        for flag in (w for w in words[2:] if w.startswith("-") and w != "-"):
            name = flag.split("=")[0]
            assert re.search(rf"(^|[\s,\[]){re.escape(name)}([\s,=\]]|$)", helps[command], re.M), \
                f"`{' '.join(words)}`: specchat {command} has no flag {name}"
