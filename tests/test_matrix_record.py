"""The machine matrix's record (tests/perf/matrix_record.py): cells kept across runs, the whole matrix drawn.

The pure parts on hand-made records; then tests/perf/machine_matrix.py for real, one small cell on the SmolLM2
pair, appending to a record that `--table` draws."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "perf"))

from matrix_record import Cell, all_cells, append, newest, render  # noqa: E402

MATRIX = ROOT / "tests" / "perf" / "machine_matrix.py"


def _add(path: Path, cell: Cell, auto: list[float], control: list[float] = (), machine: str = "m", code: str = "c1",
         memory: bool = False, target: str | None = None):
    return append(path, cell, list(auto), list(control), code=code, day="2026-11-29", machine=machine, requests=16,
                  n=64, memory=memory, target=target)


def test_the_matrix_is_every_condition_once() -> None:
    cells = all_cells()
    assert len(cells) == 2 * 2 * 3 * 2 * 2 * 4 == len(set(cells))


@pytest.mark.parametrize("bad", [dict(threads=0), dict(clients=0), dict(hog="maybe"), dict(draft="q4"),
                                 dict(mode="grpc"), dict(temp=-1.0)])
def test_a_cell_outside_the_matrix_is_refused(bad: dict) -> None:
    fields = dict(threads=2, hog="off", draft="q2", temp=0.8, mode="inproc", clients=4) | bad
    with pytest.raises(ValueError):
        Cell(**fields)


def test_the_newest_record_of_a_cell_on_this_machine_is_the_one_drawn(tmp_path: Path) -> None:
    record = tmp_path / "matrix.jsonl"
    low = Cell(1, "on", "f32", 0.0, "http", 8)
    good = Cell(2, "off", "q2", 0.8, "inproc", 1)
    _add(record, low, [1.20, 1.10, 1.30], code="old")
    _add(record, low, [0.90, 0.95, 0.99], [1.01, 0.97, 1.03], code="new")
    _add(record, good, [1.05])
    _add(record, good, [0.50, 0.50, 0.50], machine="another machine")
    remembered = Cell(2, "off", "q2", 0.8, "http", 2)
    _add(record, remembered, [3.0, 2.0], memory=True)
    _add(record, good, [0.70], target="smollm2-135m-instruct-Q2_K.gguf")  # another target: a matrix apart

    records = newest(record, "m")
    assert set(records) == {low, good}, "a run with the memory is kept, not drawn as the cell's"
    assert records[good]["auto"] == [1.05], "a run on another target is not the matrix's own"
    apart = newest(record, "m", "smollm2-135m-instruct-Q2_K.gguf")
    assert set(apart) == {good} and apart[good]["auto"] == [0.70]
    assert records[low]["commit"] == "new" and records[good]["auto"] == [1.05]

    table = render(records, "m")
    rows = [line for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 192
    assert sum(" not run " in r for r in rows) == 190
    assert ("| 1 | on | F32 | 0 | HTTP | 8 | 0.95 | 0.90 / 0.95 / 0.99 | **no** | 1.01 (1.01 / 0.97 / 1.03) | new | "
            "2026-11-29 | 16 × 64 |") in table
    assert "| 2 | off | Q2_K | 0.8 | in process | 1 | 1.05 | 1.05 | yes |" in table
    assert "| 2 | off | Q2_K | 0.8 | HTTP | 2 | not run |" in table
    first = table.splitlines()[0]
    assert "2 of 192 cells measured (1 over at least 3 repeats)" in first
    assert "1 at or above 0.97 by the median, 1 below: -t 1, busy core on, F32, 0, HTTP, 8 clients 0.95." in first


def test_a_broken_record_names_its_line(tmp_path: Path) -> None:
    record = tmp_path / "matrix.jsonl"
    _add(record, Cell(2, "off", "q2", 0.8, "inproc", 1), [1.0])
    with record.open("a") as f:
        f.write('{"cell": {"threads": 2}}\n')
    with pytest.raises(ValueError, match=r"matrix.jsonl:2: not a matrix record"):
        newest(record, "m")
    with pytest.raises(ValueError, match="no repeat"):
        _add(record, Cell(2, "off", "q2", 0.8, "inproc", 1), [])


@pytest.mark.demo
def test_a_measured_cell_is_appended_and_drawn(instruct_pair, tmp_path: Path) -> None:
    """One real cell (one thread, the Q2_K draft, greedy, in process, one client, short requests): its runs
    sized to last a second (`--seconds`, from a timed run of `ar`), so more than the one request asked for."""
    record, table = tmp_path / "matrix.jsonl", tmp_path / "matrix.md"
    r = subprocess.run([sys.executable, str(MATRIX), "--threads", "1", "--hog", "off", "--drafts", "q2", "--clients",
                        "1", "--temps", "0", "--modes", "inproc", "--repeats", "1", "--requests", "1", "-n", "4",
                        "--seconds", "1", "--record", str(record)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(rows) == 1
    row = rows[0]
    assert row["cell"] == {"threads": 1, "hog": "off", "draft": "q2", "temp": 0.0, "mode": "inproc", "clients": 1}
    assert len(row["auto"]) == 1 and row["auto"][0] > 0 and row["control"] == []
    assert row["requests"] > 1 and row["n"] == 4 and row["commit"] not in ("", "unknown") and not row["memory"]
    assert f"({row['requests']} requests a run: `ar` at 1 client made" in r.stderr, r.stderr
    assert f"| 1 | off | q2 | 0 | inproc | 1 | {row['auto'][0]:.2f} |" in r.stdout

    r = subprocess.run([sys.executable, str(MATRIX), "--table", str(table), "--record", str(record)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    drawn = table.read_text()
    assert "1 of 192 cells measured (0 over at least 3 repeats)" in drawn
    assert f"| 1 | off | Q2_K | 0 | in process | 1 | {row['auto'][0]:.2f} | {row['auto'][0]:.2f} |" in drawn
