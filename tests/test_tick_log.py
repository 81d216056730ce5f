"""SPECCHAT_TICK_LOG: the scheduler's ticks as JSON lines, on real llama.cpp (backends.tick_log)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from backends.engine import Engine, EngineConfig
from backends.events import REJECTED, Token
from backends.sampling import GenParams
from backends.tick_log import ENV
from auto_helpers import pool_run

ROOT = Path(__file__).resolve().parents[1]


def test_every_tick_is_logged_with_what_the_realised_check_counted_it_as(tiny, tmp_path: Path, monkeypatch) -> None:
    log = tmp_path / "ticks.jsonl"
    monkeypatch.setenv(ENV, str(log))
    engine = Engine(EngineConfig(target=tiny.target, draft=tiny.draft, n_ctx=512, threads=1, n_seq_max=8,
                                 n_parallel=2, cost_cache=Path("")))
    try:
        prompts = [engine.tokenize("the cat sat on the mat"), engine.tokenize("once upon a time there was")]
        params = GenParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        plain, plain_events = pool_run(engine, [("ar", p) for p in prompts], params)
        ar_lines = log.read_text().splitlines()
        spec, spec_events = pool_run(engine, [("sps", p) for p in prompts], params)
    finally:
        engine.close()
    ticks = [json.loads(line) for line in log.read_text().splitlines()]
    ar_ticks, sps_ticks = ticks[:len(ar_lines)], ticks[len(ar_lines):]
    assert len(ar_ticks) == plain.scheduler.ticks and len(sps_ticks) == spec.scheduler.ticks, "one line a tick"
    assert plain.scheduler._tick_log is spec.scheduler._tick_log is not None, "one open file a process"
    for logged, events in ((ar_ticks, plain_events), (sps_ticks, spec_events)):
        committed = sum(1 for e in sum(events, []) if type(e) is Token and e.kind != REJECTED)
        assert sum(t["tokens"] for t in logged) == committed == 2 * 24, "every committed token, in its tick"
    assert {t["kind"] for t in ar_ticks} == {"prompt", "plain"}, "plain decoding: prompt chunks, then plain ticks"
    assert all(t["rows"] == t["sequences"] == 2 for t in ar_ticks if t["kind"] == "plain")
    counted = [t for t in sps_ticks if t["kind"] == "speculated"]
    assert sum(t["rows"] > t["sequences"] for t in counted) > len(counted) / 2, "sps verifies chains: rows beyond one"
    assert all(t["pid"] > 0 and t["seconds"] > 0 and t["verdict"] in (True, False, None) for t in ticks)
    assert all(0 < t["decode"] < t["seconds"] and t["draft"] == 0 for t in ar_ticks), "ar: the target's decodes only"
    assert all(t["decode"] + t["draft"] < t["seconds"] for t in sps_ticks)
    assert sum(t["draft"] > 0 for t in counted) > len(counted) / 2, "sps drafts in the ticks that verify its chains"

    table = subprocess.run([sys.executable, "tests/perf/tick_log.py", str(log)], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout
    row = next(line for line in table.splitlines() if "| 2 | plain |" in line)
    assert f"| {len([t for t in ar_ticks if t['kind'] == 'plain'])} |" in row, "the summary counts the plain ticks"


def test_a_log_that_cannot_be_written_is_one_warning_and_decoding_goes_on(tiny, tmp_path: Path, monkeypatch,
                                                                          capsys) -> None:
    monkeypatch.setenv(ENV, str(tmp_path / "no such folder" / "ticks.jsonl"))
    engine = Engine(EngineConfig(target=tiny.target, n_ctx=512, threads=1, n_seq_max=4, cost_cache=Path("")))
    try:
        prompt = engine.tokenize("the cat sat on the mat")
        _, events = pool_run(engine, [("ar", prompt)], GenParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        pool_run(engine, [("ar", prompt)], GenParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    finally:
        engine.close()
    assert sum(1 for e in events[0] if type(e) is Token) == 8
    err = capsys.readouterr().err
    assert err.count("SPECCHAT_TICK_LOG") == 1 and "ticks not logged" in err
