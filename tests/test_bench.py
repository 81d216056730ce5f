"""`specchat bench` on the tiny pair: the table, the JSON report, the plot, and greedy agreement."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from app.bench.prompts import BUILTIN, load_prompt_set
from app.bench.solo import first_difference, format_table, mismatch_lines
from app.commands.bench import build_configs
from backends.config import StrategyOptions
from backends.device_cost import BatchCost
from backends.pricing import best_chain_speedup, expected_tokens

RESULT_KEYS = {
    "label", "strategy", "tokens_per_second", "tokens_per_second_min", "tokens_per_second_max", "speedup",
    "speedup_by_category", "acceptance_rate", "tokens_per_forward", "accepted_per_position",
    "greedy_matches_ar", "greedy_mismatches", "predicted_speedup",
}


@pytest.fixture(scope="module")
def bench_run(tiny, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("bench")
    r = subprocess.run(
        [sys.executable, "-m", "app", "bench", "-m", str(tiny.target), "-md", str(tiny.draft), "--repeats", "1",
         "-n", "24", "-t", "1", "--cost-k-max", "6", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    return r, out


def test_bench_table_and_files(bench_run) -> None:
    r, out = bench_run
    assert r.returncode == 0, r.stderr
    header = r.stdout.splitlines()[0].split()
    for column in ("configuration", "tok/s", "min-max", "vs", "ar", "accept", "tok/fwd", "limit", "greedy=ar"):
        assert column in header
    labels = [line.split()[0] for line in r.stdout.splitlines()[2:6]]
    assert labels == ["ar", "sps", "lookahead", "lookup"]
    png = out / "bench.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_bench_json_schema(bench_run) -> None:
    r, out = bench_run
    report = json.loads((out / "bench.json").read_text())
    assert {"target", "draft", "device", "max_tokens", "repeats", "prompts", "batch_cost", "draft_cost",
            "results", "best"} <= set(report)
    assert len(report["batch_cost"]) == 6 and report["batch_cost"][0] == 1.0
    assert report["draft_cost"] > 0
    assert len(report["prompts"]) == len(BUILTIN)
    for row in report["results"]:
        assert RESULT_KEYS <= set(row), RESULT_KEYS - set(row)
        assert set(row["speedup_by_category"]) == {p.category for p in BUILTIN}
    for row in report["results"][1:]:
        assert row["greedy_matches_ar"], f"{row['label']} differs from ar at temperature 0"
        assert row["greedy_mismatches"] == [], row["greedy_mismatches"]
    assert report["results"][0]["speedup"] == 1.0


def test_bench_rejects_bad_input(tiny, tmp_path: Path) -> None:
    bad = tmp_path / "p.jsonl"
    bad.write_text("not json\n")
    r = subprocess.run([sys.executable, "-m", "app", "bench", "-m", str(tiny.target), "--prompts", str(bad),
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "expected a JSON object" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_bench_without_matplotlib_prints_its_table_and_an_out_file_is_refused_first(tiny, tmp_path: Path) -> None:
    """The quick start installs no matplotlib (the `bench` extra): the table and bench.json still come, the plot is
    one line on stderr (it was an exit 1 after the whole measuring, the table never printed). An --out that is a
    file is refused before anything is measured."""
    args = ["bench", "-m", str(tiny.target), "-s", "ar,lookup", "--repeats", "1", "-n", "8", "-t", "1",
            "--cost-k-max", "0", "--limit", "2"]
    blocked = "import sys; sys.modules['matplotlib'] = None; from app.cli import main; sys.exit(main(sys.argv[1:]))"
    r = subprocess.run([sys.executable, "-c", blocked, *args, "--out", str(tmp_path / "out")], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].split()[0] == "configuration" and "lookup" in r.stdout
    assert "bench.png not drawn: the plot needs matplotlib" in r.stderr and (tmp_path / "out" / "bench.json").exists()
    (tmp_path / "file").write_text("x")
    r = subprocess.run([sys.executable, "-m", "app", *args, "--out", str(tmp_path / "file")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"specchat: error: --out {tmp_path / 'file'} is a file; it names the folder for bench.json and bench.png"]


def test_custom_prompt_file(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hello", "category": "greeting"}\n\n{"prompt": "bye"}\n')
    prompts = load_prompt_set(str(f))
    assert [(p.category, p.text) for p in prompts] == [("greeting", "hello"), ("custom", "bye")]


def test_sweep_builds_distinct_settings() -> None:
    configs = build_configs(["sps", "lookahead", "lookup", "tree"], StrategyOptions(), sweep=True)
    labels = [c.label for c in configs]
    assert labels[0] == "ar" and len(labels) == len(set(labels))
    assert any("W=15 N=5 G=15" in label for label in labels) and any("K=8" in label for label in labels)
    tree = [c.label for c in configs if c.strategy == "tree"]
    assert len(tree) == 9 and any("static" in t for t in tree) and any("M=auto" in t for t in tree)


def test_cost_model_matches_leviathan_formula() -> None:
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    flat = BatchCost(tuple([1.0] * 9))  # verifying k tokens costs the same as one
    speedup, k = best_chain_speedup(0.8, 0.0, flat, k_max=8)
    assert k == 8 and speedup == pytest.approx(expected_tokens(0.8, 8))
    linear = BatchCost(tuple(float(i) for i in range(1, 10)))  # no batching gain: speculation cannot win
    assert best_chain_speedup(0.9, 0.1, linear)[0] < 1.0


def test_table_formats_rows() -> None:
    row = {"label": "sps", "tokens_per_second": 10.0, "tokens_per_second_min": 9.0, "tokens_per_second_max": 11.0,
           "speedup": 1.5, "acceptance_rate": 0.7, "tokens_per_forward": 2.5, "predicted_speedup": 1.6,
           "greedy_matches_ar": False, "accepted_per_position": [0.9, 0.5]}
    line = format_table([row]).splitlines()[2]
    assert "1.50" in line and "NO" in line and "0.90 0.50" in line


def test_a_greedy_mismatch_says_where() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2, "an output ending early differs where it ends"
    rows = [{"label": "ar", "greedy_mismatches": []},
            {"label": "auto", "greedy_mismatches": [{"category": "qa", "repeat": 2, "token": 28}]}]
    assert mismatch_lines(rows) == ["auto: greedy output differs from ar's on qa (repeat 2) from token 28"]
    assert mismatch_lines([{"label": "sps"}]) == [], "sampling runs are not compared"


def test_bench_rotates_the_order_and_runs_an_aa_control(tiny, tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "app", "bench", "-m", str(tiny.target), "-s", "ar,lookup", "--control", "--repeats", "1",
         "--limit", "3", "-n", "8", "-t", "1", "--cost-k-max", "0", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stderr
    runs = re.findall(r"^\[\d+/9\] repeat 1, (\w+), (.+): [\d.]+ tok/s$", r.stderr, re.MULTILINE)
    assert len(runs) == 9
    orders = [[label for _c, label in runs[i:i + 3]] for i in range(0, 9, 3)]
    # Each prompt runs every configuration once; a different one goes first each time.
    assert [sorted(o) for o in orders] == [sorted(["ar", "lookup K=10 n<=3", "ar (control)"])] * 3
    assert len({o[0] for o in orders}) == 3
    rows = {row["label"]: row for row in json.loads((tmp_path / "bench.json").read_text())["results"]}
    control = rows["ar (control)"]
    assert control["strategy"] == "ar" and control["greedy_matches_ar"] is True and control["speedup"] > 0
    assert "ar (control)" in r.stdout and rows["ar"]["speedup"] == 1.0


@pytest.mark.parametrize("rotate", [1, 2])
def test_load_bench_rotate_starts_the_turns_further_on(tiny, tmp_path: Path, rotate: int) -> None:
    """`--rotate K`: repeats run as separate processes (each `--repeats 1`) take turns going first, as repeats in
    one process do (tests/perf/machine_matrix.py runs repeat K with `--rotate K`)."""
    r = subprocess.run(
        [sys.executable, "-m", "app", "bench", "-m", str(tiny.target), "-s", "ar,lookup", "--control", "--clients", "2",
         "--repeats", "1", "--rotate", str(rotate), "--limit", "2", "-n", "4", "-t", "1", "--cost-k-max", "0",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stderr
    runs = re.findall(r"^\[\d+/3\] repeat 1, 2 clients, (.+): [\d.]+ tok/s in all$", r.stderr, re.MULTILINE)
    configs = ["ar", "lookup K=10 n<=3", "ar (control)"]
    assert runs == configs[rotate:] + configs[:rotate]


def test_load_bench_with_clients(tiny, tmp_path: Path) -> None:
    """`bench --clients 1,3`: every configuration at each client count, aggregate tok/s, TTFT and the ratio to
    ar at the same count, in the table, the JSON and the plot; greedy outputs are checked against ar's."""
    r = subprocess.run(
        [sys.executable, "-m", "app", "bench", "-m", str(tiny.target), "-md", str(tiny.draft), "-s", "ar,sps,auto",
         "--clients", "1,3", "--repeats", "2", "--limit", "4", "-n", "16", "-t", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["clients"] == [1, 3] and len(report["prompts"]) == 4
    rows = {(row["label"], row["clients"]): row for row in report["load"]}
    assert set(rows) == {(label, c) for label in ("ar", "sps K=6 p_min=0.4", "auto") for c in (1, 3)}
    for (label, clients), row in rows.items():
        assert row["aggregate_tokens_per_second"] > 0 and 0 < row["ttft_p50"] <= row["ttft_p95"]
        assert row["request_tokens_per_second"] > 0
        if label == "ar":
            assert row["speedup_vs_ar"] == 1.0 and row["tokens_per_forward"] == pytest.approx(1.0, abs=0.05)
    assert rows[("sps K=6 p_min=0.4", 1)]["acceptance_rate"] > 0
    assert rows[("sps K=6 p_min=0.4", 1)]["greedy_differing_requests"] == 0, "alone, sps gives ar's text"
    lines = r.stdout.splitlines()
    assert lines[0].split()[:2] == ["clients", "configuration"] and len(lines) == 2 + len(rows)
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_load_bench_refuses_bad_client_lists(tiny, tmp_path: Path) -> None:
    for bad in ("0", "two", ","):
        r = subprocess.run([sys.executable, "-m", "app", "bench", "-m", str(tiny.target), "--clients", bad,
                            "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "--clients" in r.stderr, r.stderr
    for bad in (["--prompts", "extract", "--clients", "2"], ["--unmasked-drafts", "--clients", "2"]):
        r = subprocess.run([sys.executable, "-m", "app", "bench", "-m", str(tiny.target), *bad, "--out", str(tmp_path)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "schemas" in r.stderr, r.stderr
    for bad in (["--requests", "0", "--clients", "2"], ["--requests", "4"]):
        r = subprocess.run([sys.executable, "-m", "app", "bench", "-m", str(tiny.target), *bad, "--out", str(tmp_path)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "--requests" in r.stderr, r.stderr


def test_load_bench_requests_take_the_prompts_in_turn(tiny, tmp_path: Path) -> None:
    """`--requests 5` with 2 prompts: five requests in all (a steady load instead of one wave); the run fails
    unless every one of them ends (app.bench.load.run_load), and ar steps one token per forward."""
    r = subprocess.run(
        [sys.executable, "-m", "app", "bench", "-m", str(tiny.target), "-md", str(tiny.draft), "-s", "ar,sps",
         "--clients", "2", "--requests", "5", "--repeats", "1", "--limit", "2", "-n", "12", "-t", "1",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["requests"] == 5 and len(report["prompts"]) == 2
    rows = {row["label"]: row for row in report["load"]}
    assert rows["ar"]["tokens_per_forward"] == pytest.approx(1.0, abs=0.05)
    assert all(row["aggregate_tokens_per_second"] > 0 for row in rows.values())
