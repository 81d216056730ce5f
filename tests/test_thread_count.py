"""A lane's thread count follows the machine (backends.thread_count): the rule on decode times, then real llama.cpp."""

from __future__ import annotations

from pathlib import Path

from backends.engine import Engine, EngineConfig
from backends.events import REJECTED, Token
from backends.sampling import GenParams
from backends.thread_count import (PROBE_DECODES, PROBE_FIRST, PROBE_MAX, PROBE_ROWS, PROBE_SOON, PROBE_UP_MAX,
                                   FollowingCount, ThreadCount)
from auto_helpers import pool_run

# Decode times of 8 rows on the developers' 2-core VM (docs/results.md): quiet, and beside a busy loop, where two
# threads' times turn bimodal (a thread waiting out the loop's time slice).
QUIET = {1: [0.077], 2: [0.041]}
BUSY = {1: [0.078], 2: [0.080, 0.200, 0.080, 0.160]}


def _run(count: ThreadCount, times: dict[int, list[float]], decodes: int, rows: int = 8) -> list[int]:
    """Decode `decodes` times at the counts `count` picks, each taking the machine's next time at that count."""
    used, turn = [], {n: 0 for n in times}
    for _ in range(decodes):
        n = count.next(rows)
        used.append(n)
        count.observe(n, rows, times[n][turn[n] % len(times[n])])
        turn[n] += 1
    return used


def test_a_quiet_machine_keeps_its_threads_and_probes_ever_less_often() -> None:
    count = ThreadCount(2)
    used = _run(count, QUIET, 6000)
    assert count.current == 2 and used[:PROBE_FIRST] == [2] * PROBE_FIRST, "no probe before PROBE_FIRST decodes"
    probes = used.count(1) // PROBE_DECODES
    assert 3 <= probes <= 6 and count.wait == PROBE_MAX, "each probe found one thread clearly slower: waits double"
    assert used.count(1) / len(used) < 0.01, "probing costs under 1% of the decodes"


def test_beside_a_busy_core_the_lane_drops_a_thread_soon_and_takes_it_back_when_the_core_frees() -> None:
    count = ThreadCount(2)
    used = _run(count, QUIET, 3000)
    assert count.current == 2
    busy_from = len(used)
    used += _run(count, BUSY, 200)
    assert count.current == 1, "one thread decodes faster beside the busy loop"
    dropped = next(i for i in range(busy_from, len(used)) if used[i:i + 20] == [1] * 20) - busy_from
    assert dropped < 100, f"the spread of two threads' times brought a probe soon (dropped after {dropped})"
    _run(count, BUSY, 2000)
    assert count.current == 1 and count.wait <= PROBE_UP_MAX, "below the most threads, probes up stay frequent"
    freed_from = count.decodes
    _run(count, QUIET, PROBE_UP_MAX + 2 * PROBE_SOON)
    assert count.current == 2, f"back to two threads within {count.decodes - freed_from} decodes of the core freeing"


def test_a_probe_runs_on_decodes_of_a_size_the_current_count_decoded_lately_never_on_a_prompt_chunk() -> None:
    count = ThreadCount(2, next_probe=0)
    assert count.next(4) == 2, "a probe is due, but nothing of 4 rows at two threads would judge it"
    for _ in range(3):
        count.observe(2, 4, 0.03)
        count.observe(2, 16, 0.30)
        count.observe(2, PROBE_ROWS + 1, 0.9)
    assert count.next(PROBE_ROWS + 1) == 2, "a prompt chunk decodes at the current count"
    assert count.next(5) == 2, "a size not decoded lately: not a probe's"
    assert count.next(4) == 1, "a probe"
    count.observe(1, 4, 0.05)
    assert count.next(16) == 1
    count.observe(1, 16, 0.20)  # slower than 4 rows at two threads, faster than 16: each compared with its size
    assert count.current == 1 and count.probe is None, "0.25 s against 0.33 s: one thread is the count"


def test_more_threads_move_one_at_a_time_to_the_fastest_count() -> None:
    def times(n: int) -> list[float]:  # four of eight cores busy: the fifth thread on makes every barrier wait
        return [0.1 / n if n <= 4 else 0.12]
    count = ThreadCount(8, next_probe=PROBE_SOON)
    _run(count, {n: times(n) for n in range(1, 9)}, 2000)
    assert count.current == 4


def test_the_lane_decodes_at_the_count_it_picks_and_greedy_output_does_not_change(tiny) -> None:
    prompts = ["the cat sat on the mat", "once upon a time there was"]
    params = GenParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outputs, picked = [], []
    for threads in (1, 2):
        engine = Engine(EngineConfig(target=tiny.target, draft=tiny.draft, n_ctx=512, threads=threads, n_seq_max=8,
                                     n_parallel=2, cost_cache=Path("")))
        try:
            lane = engine.target_lane
            if threads == 1:
                assert lane.threads is None, "one thread: nothing to choose"
            else:
                draft = engine.draft_lane
                assert isinstance(lane.threads, ThreadCount) and draft is not None \
                    and isinstance(draft.threads, FollowingCount) and draft.threads.leader is lane.threads, \
                    "the target's lane chooses its count, the draft's follows it"
                lane.threads.next_probe = lane.threads.decodes  # a probe is due
                set_threads = lane.ctx.set_threads
                lane.ctx.set_threads = lambda n: picked.append(n) or set_threads(n)  # type: ignore[method-assign]
            _, events = pool_run(engine, [("sps", engine.tokenize(p)) for p in prompts], params)
        finally:
            engine.close()
        outputs.append([[e.id for e in ev if type(e) is Token and e.kind != REJECTED] for ev in events])
    probe = picked.index(1)
    assert 0 < probe and picked[probe:probe + PROBE_DECODES] == [1] * PROBE_DECODES and set(picked) == {1, 2}, \
        "a probe's decodes ran at one thread, once the size it decodes had been decoded at two"
    assert outputs[0] == outputs[1] and all(len(o) == 32 for o in outputs[0]), "thread counts do not change logits"
