"""KV cells kept on disk (backends.kv_store, `specchat run --prompt-cache FILE`): a later run restores the prompt
instead of decoding it and continues token for token as after decoding it, with every strategy, target and draft
restored; a file of another model or context, truncated or damaged, is refused in one line and the prompt is
decoded as before; files are their owner's only."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backends.config import StrategyOptions
from backends.engine import Engine
from backends.registry import STRATEGIES
from backends.kv_store import KvKey, KvStoreError, read_entry, restore, snapshot, write_entry
from backends.sampling import GenParams
from app.prompt_format import PromptFormat
from engine_helpers import DEMO_NOISE, assert_strategy_greedy, run_to_done

ROOT = Path(__file__).resolve().parents[1]
LONG = "Summarize: " + " ".join(f"Item {i} is a {['red', 'blue', 'green'][i % 3]} box." for i in range(40))


def _prompt(engine: Engine, extra: str = "") -> list[int]:
    return PromptFormat(engine).prompt(LONG + extra)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_restored_prompt_continues_as_the_decoded_one(instruct_pair, instruct_engine: Engine, strategy: str,
                                                        tmp_path: Path) -> None:
    """The prompt decoded, its cells (target and draft) written; the slot emptied, the file read back into it:
    the generation decodes only the prompt's last token and gives the same greedy tokens."""
    engine = instruct_engine
    prompt = _prompt(engine)
    params = GenParams(max_tokens=24)
    slot = engine.slots[0]
    slot.reset()
    ref = run_to_done(engine, strategy, prompt, params)
    slot.target.sync(prompt, logits=False)
    if slot.draft is not None:
        slot.draft.sync(prompt, logits=False)
    path = tmp_path / "prompt.kv"
    write_entry(path, engine.kv_key(), snapshot(slot.target, slot.draft, upto=len(prompt)))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    slot.reset()
    n = restore(read_entry(path, engine.kv_key()), slot.target, slot.draft, prompt)
    assert n == len(prompt) and slot.draft is not None and len(slot.draft.tokens) == len(prompt)
    got = run_to_done(engine, strategy, prompt, params)
    assert got.stats.prompt_cached == len(prompt) - 1
    assert_strategy_greedy(engine, strategy, prompt, ref.tokens, got.tokens, noise=DEMO_NOISE)


def test_a_longer_prompt_restores_the_shared_part_and_a_shorter_one_cuts_it(instruct_engine: Engine,
                                                                            tmp_path: Path) -> None:
    engine, slot = instruct_engine, instruct_engine.slots[0]
    prompt = _prompt(engine)
    slot.reset()
    slot.target.sync(prompt, logits=False)
    path = tmp_path / "p.kv"
    write_entry(path, engine.kv_key(), snapshot(slot.target, None))
    entry = read_entry(path, engine.kv_key())
    longer = prompt + engine.tokenize(" And then?")[1:]
    slot.reset()
    assert restore(entry, slot.target, None, longer) == len(prompt)
    slot.reset()
    assert restore(entry, slot.target, None, prompt[:50]) == 50 and slot.target.tokens == prompt[:50]
    assert restore(entry, slot.target, None, prompt[:50]) == 0, "the cache holds as much already"


def test_files_that_do_not_match_or_parse_are_refused_in_words(instruct_pair, instruct_engine: Engine,
                                                              tmp_path: Path) -> None:
    engine, slot = instruct_engine, instruct_engine.slots[0]
    slot.reset()
    slot.target.sync(_prompt(engine), logits=False)
    path = tmp_path / "p.kv"
    key = engine.kv_key()
    write_entry(path, key, snapshot(slot.target, None))
    other_model = KvKey.of(instruct_pair.draft, instruct_pair.draft, key.n_ctx, key.build)
    with pytest.raises(KvStoreError, match="another target model"):
        read_entry(path, other_model)
    with pytest.raises(KvStoreError, match="another context size"):
        read_entry(path, KvKey(key.target, key.draft, key.n_ctx * 2, key.build))
    data = path.read_bytes()
    (tmp_path / "cut.kv").write_bytes(data[:len(data) // 2])
    with pytest.raises(KvStoreError, match="truncated"):
        read_entry(tmp_path / "cut.kv", key)
    flipped = bytearray(data)
    flipped[-100] ^= 0xFF
    (tmp_path / "bad.kv").write_bytes(bytes(flipped))
    with pytest.raises(KvStoreError, match="checksum"):
        read_entry(tmp_path / "bad.kv", key)
    (tmp_path / "junk.kv").write_bytes(b"not a kv file")
    with pytest.raises(KvStoreError, match="not a specchat KV file"):
        read_entry(tmp_path / "junk.kv", key)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", "run", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "SPECCHAT_MEMORY_DIR": ""})


def test_run_prompt_cache_restores_a_later_run_and_refuses_another_models_file(instruct_pair, tmp_path: Path) -> None:
    path = tmp_path / "prompt.kv"
    common = ["-m", str(instruct_pair.target), "-md", str(instruct_pair.draft), LONG, "-n", "16", "--temp", "0",
              "-t", "2", "--json", "--prompt-cache", str(path)]
    first = _run(*common)
    assert first.returncode == 0, first.stderr
    assert path.exists() and stat.S_IMODE(path.stat().st_mode) == 0o600
    second = _run(*common)
    assert second.returncode == 0 and "restored" in second.stderr
    events = [[json.loads(line) for line in out.stdout.splitlines()] for out in (first, second)]
    assert events[1][0]["n_cached"] == events[1][0]["n_tokens"] - 1 and events[0][0]["n_cached"] == 0
    assert events[0][-1]["tokens"] == events[1][-1]["tokens"]
    other = _run("-m", str(instruct_pair.draft), LONG, "-n", "4", "-t", "2", "--prompt-cache", str(path))
    assert other.returncode == 0
    refused = [line for line in other.stderr.splitlines() if "prompt cache" in line]
    assert len(refused) == 1 and "another target model" in refused[0]
    notes = tmp_path / "notes.md"  # a mistyped name: no KV file of ours, never overwritten
    notes.write_text("my notes\n")
    mistyped = _run("-m", str(instruct_pair.draft), LONG, "-n", "4", "-t", "2", "--prompt-cache", str(notes))
    assert mistyped.returncode == 1 and mistyped.stdout == "" and notes.read_text() == "my notes\n"
    assert mistyped.stderr.strip().splitlines()[-1].startswith("specchat: error: --prompt-cache:")


# -- the chat app's store ---------------------------------------------------------------------------------------------

def _turns(engine: Engine, store, first: str, second: str):
    from app.session import ChatSession, TurnRequest
    from backends.events import Prefilled, until_done

    # Plain decoding, so that "the same answer" holds token for token: auto's batches follow live timings, and a
    # verification batch may flip a near-tie.
    request = TurnRequest(strategy="ar", params=GenParams(max_tokens=32), options=StrategyOptions())
    session = ChatSession(engine, kv_store=store)
    until_done(session.turn(first, request))
    history = list(session.messages)
    engine.slots[0].reset()  # the app closed: nothing in RAM
    reopened = ChatSession(engine, kv_store=store)
    reopened.reset(history)
    events = list(reopened.turn(second, request))
    prefilled = next(e for e in events if isinstance(e, Prefilled))
    return reopened, prefilled, events[-1]


def test_a_reopened_conversation_restores_its_cells_and_answers_the_same(instruct_engine: Engine,
                                                                        tmp_path: Path) -> None:
    """A turn's cells are kept on disk after it; the conversation reopened in a fresh slot restores them and
    decodes only the new message, and answers greedily as without the store."""
    from backends.kv_store import KvDiskStore

    engine = instruct_engine
    store = KvDiskStore(tmp_path / "kv", engine.kv_key())
    try:
        with_store, prefilled, done = _turns(engine, store, LONG, "Which box is item 7?")
        assert with_store.restored is not None and with_store.restored[0] > 100
        assert prefilled.n_cached >= with_store.restored[0] - 1
        _, cold, reference = _turns(engine, None, LONG, "Which box is item 7?")
        assert cold.n_cached == 0 and done.tokens == reference.tokens
        assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in (tmp_path / "kv").glob("*.kv"))
    finally:
        store.close()


def test_a_recurrent_targets_cells_restore_whole_or_not_at_all(tmp_path: Path) -> None:
    """Qwen3.5's recurrent state read back from a file has no snapshots to cut back with: a prompt that leaves the
    entry inside it (a conversation edited since; a template that drops earlier reasoning) restores nothing and
    decodes as without the file, where it raised on every turn; one that extends it restores all. A run's cells
    cut to its prompt (`--prompt-cache`) are none rather than an error after the answer."""
    from backends.engine import EngineConfig
    from qwen35_factory import Qwen35Model, write_qwen35_mtp_target

    path = write_qwen35_mtp_target(tmp_path / "qwen35.gguf", Qwen35Model(residual=0.1, head_noise=0.1))
    engine = Engine(EngineConfig(target=path, n_ctx=512, threads=1, cost_cache=Path(""), memory=False))
    try:
        slot, params = engine.slots[0], GenParams(max_tokens=12)
        prompt = list(range(5, 45))
        slot.target.sync(prompt, logits=False)
        entry = snapshot(slot.target, None)
        edited = prompt[:20] + list(range(60, 80))
        want = run_to_done(engine, "ar", edited, params).tokens
        slot.reset()
        assert restore(entry, slot.target, None, edited) == 0 and slot.target.tokens == []
        assert run_to_done(engine, "ar", edited, params).tokens == want
        slot.reset()
        assert restore(entry, slot.target, None, prompt + [7, 8]) == len(prompt)
        run_to_done(engine, "ar", prompt, GenParams(max_tokens=48))  # past the state's snapshots
        assert snapshot(slot.target, None, upto=len(prompt)) is None  # the answer cannot be cut off its prompt
    finally:
        engine.close()


def test_the_store_stays_within_its_bound_over_10000_turns_and_survives_a_kill(tmp_path: Path) -> None:
    """Synthetic cells (the bookkeeping, not llama.cpp): 10,000 turns of conversations that grow and start over
    never leave more than the bound on disk, an entry that extends another replaces it, and a writer killed
    with -9 in the middle of writing leaves every file readable (written beside, then renamed)."""
    from backends.kv_store import MIN_TOKENS, KvDiskStore, KvEntry

    key = KvKey(("t",), (), 512, "test")
    folder = tmp_path / "kv"
    store = KvDiskStore(folder, key, max_bytes=200_000)
    try:
        for turn in range(10_000):
            conversation, length = divmod(turn, 20)
            tokens = tuple([conversation] + list(range(MIN_TOKENS + length)))
            store.put(KvEntry(tokens, bytes([turn % 256]) * 1000))
        store.wait()
        assert sum(p.stat().st_size for p in folder.glob("*.kv")) <= 200_000
        last = tuple([499] + list(range(MIN_TOKENS + 19)))
        assert store.best(last + (1, 2)).target_tokens == last, "the longest turn of the last conversation"
        assert len([t for t in store._entries().values() if t[0] == 499]) == 1, "extended entries are replaced"
        # What a killed write leaves goes once it is old (a fresh one may be another process's write in progress),
        # and files set aside count in the bound.
        stale, fresh, aside = folder / ".x.kv.ab12.tmp", folder / ".y.kv.cd34.tmp", folder / "z.bad"
        for path in (stale, fresh, aside):
            path.write_bytes(b"\0" * 1000)
        os.utime(stale, (time.time() - 3600, time.time() - 3600))
        os.utime(aside, (0, 0))
        store.put(KvEntry(tuple([500] + list(range(MIN_TOKENS))), b"\1" * 1000))
        store.wait()
        assert not stale.exists() and fresh.exists() and not aside.exists()
    finally:
        store.close()
    script = (f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
              "from pathlib import Path\n"
              "from backends.kv_store import KvKey, KvEntry, write_entry\n"
              f"key = KvKey(('t',), (), 512, 'test')\n"
              "i = 0\n"
              "while True:\n"
              f"    write_entry(Path({str(folder)!r}) / 'big.kv', key, KvEntry(tuple(range(100)), bytes([i % 256]) * 20_000_000))\n"
              "    i += 1\n")
    writer = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 120
    while not (folder / "big.kv").exists() and time.monotonic() < deadline:  # one whole write, then more
        time.sleep(0.05)
    time.sleep(0.5)  # in the middle of a later write
    writer.kill()
    writer.wait()
    entry = read_entry(folder / "big.kv", key)
    assert len(entry.target_state) == 20_000_000
    reread = KvDiskStore(folder, key)
    try:
        assert reread.best(last + (1,)) is not None, "the other entries are still there and readable"
    finally:
        reread.close()


def test_cache_stats_and_clear_cover_the_kv_cells(tmp_path: Path) -> None:
    from backends.kv_store import KvEntry

    folder = tmp_path / "kv"
    write_entry(folder / "a.kv", KvKey(("t",), (), 512, "test"), KvEntry(tuple(range(80)), b"x" * 5000))
    (folder / "b.bad").write_bytes(b"junk")
    (folder / ".c.kv.x1y2.tmp").write_bytes(b"a write killed midway")
    env = {**os.environ, "SPECCHAT_KV_DIR": str(folder), "SPECCHAT_MEMORY_DIR": str(tmp_path / "mem")}

    def cache(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "app", "cache", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=120, env=env)

    stats = cache("stats", "--json")
    assert stats.returncode == 0, stats.stderr
    kv = json.loads(stats.stdout.splitlines()[0])["kv"]
    assert (kv["entries"], kv["set_aside"]) == (1, 2) and kv["bytes"] > 5000
    cleared = cache("clear")
    assert cleared.returncode == 0 and "cleared 3 KV files" in cleared.stdout
    assert not list(folder.iterdir())


def test_sizes_read_as_people_write_them() -> None:
    from app.units import parse_size

    assert [parse_size(t) for t in ("2G", "500M", "64k", "1.5GB", "0", "123")] == \
        [2 * 10**9, 5 * 10**8, 64_000, 15 * 10**8, 0, 123]
    for text in ("lots", "inf", "nan", "1e999G"):
        with pytest.raises(ValueError, match="not a size"):
            parse_size(text)


def test_cells_are_keyed_by_the_files_as_loaded_and_long_names_write(tiny, tmp_path: Path) -> None:
    """A model file replaced on disk while it runs keys nothing of the one in memory (a server's /slots save after a
    re-quantization would otherwise file the old model's cells under the new file's key), and a file name near the
    file system's limit still writes (its temporary name once added 14 bytes: a 250-byte /slots name failed)."""
    import shutil

    from backends.engine import EngineConfig
    from models.files import write_atomic

    path = tmp_path / "model.gguf"
    shutil.copy(tiny.target, path)
    engine = Engine(EngineConfig(target=path, n_ctx=256, threads=1, cost_cache=Path(""), memory=False))
    try:
        loaded = engine.kv_key()
        os.utime(path, (time.time() + 100, time.time() + 100))  # what a copy over it does
        assert KvKey.of(path, None, engine.target.n_ctx, loaded.build) != loaded
        assert engine.kv_key() == loaded
    finally:
        engine.close()
    long = tmp_path / ("a" * 250)
    write_atomic(long, b"cells")
    assert long.read_bytes() == b"cells"
