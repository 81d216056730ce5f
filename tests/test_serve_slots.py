"""llama-server's manual slot API on the real server (app/serve/slots.py): `--slot-save-path DIR` and
`POST /slots/{id}?action=save|restore|erase`. A slot saved, erased and restored (into another slot, or into a
restarted server with -np 4) serves the same prompt from its cells: the prompt shows as cached and the greedy
text is the same. Files of another model, truncated or missing, and file names with a folder are refused in one
line; a busy slot, a bad slot id or action answer OpenAI's error shape; without the flag the endpoint is 501."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from serve_helpers import API_KEY, Served, assert_error, spec, start_server, stop_server

from app.serve.slots import valid_filename
from backends.device_cost import file_identity

PROMPT = " ".join(["the cat sat on the mat and the dog ran to the tree"] * 8)
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def slot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("slot-files")


@pytest.fixture(scope="module")
def slot_server(tiny, slot_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    served = start_server(["-m", str(tiny.target), "-md", str(tiny.draft), "--api-key", API_KEY, "-np", "4",
                           "--slot-save-path", str(slot_dir)], tmp_path_factory.mktemp("slots") / "server.log")
    yield served
    stop_server(served)


def _complete(served: Served, prompt: str = PROMPT) -> dict:
    """A greedy completion with sps (the draft's cells are in the slot too)."""
    r = served.post("/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0, **spec("sps")})
    assert r.status_code == 200, r.text
    return r.json()


def _slots(served: Served) -> list[dict]:
    r = httpx.get(f"{served.url}/slots", headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def _action(served: Served, slot: object, action: str, filename: object = None) -> httpx.Response:
    body = {} if filename is None else {"filename": filename}
    return served.post(f"/slots/{slot}?action={action}", body)


def _holding(served: Served) -> int:
    """The slot that holds the most cells (the last request's)."""
    return max(_slots(served), key=lambda s: s["cached_tokens"])["id"]


def _saved(served: Served, slot_dir: Path, name: str) -> tuple[dict, dict]:
    """A greedy answer to PROMPT, its slot saved into `name`: (the answer, the save's answer)."""
    first = _complete(served)
    slot = _holding(served)
    r = _action(served, slot, "save", name)
    assert r.status_code == 200, r.text
    return first, r.json()


def test_save_erase_restore_serves_the_prompt_from_the_file(slot_server: Served, slot_dir: Path) -> None:
    prompt = "a story: " + PROMPT  # no other test's prompt starts so
    first = _complete(slot_server, prompt)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] <= 1
    slot = _holding(slot_server)
    held = _slots(slot_server)[slot]["cached_tokens"]
    assert held > first["usage"]["prompt_tokens"]  # the prompt and the answer
    r = _action(slot_server, slot, "save", "conv.bin")
    assert r.status_code == 200, r.text
    saved = r.json()
    path = slot_dir / "conv.bin"
    assert set(saved) == {"id_slot", "filename", "n_saved", "n_written", "timings"}
    assert (saved["id_slot"], saved["filename"], saved["n_saved"]) == (slot, "conv.bin", held)
    assert saved["n_written"] == path.stat().st_size and saved["timings"]["save_ms"] >= 0
    assert path.stat().st_mode & 0o777 == 0o600
    header = json.loads(path.read_bytes().partition(b"\n")[0])
    assert header["draft_bytes"] > 0 and header["draft_tokens"], "the draft's cells are kept too"

    r = _action(slot_server, slot, "erase")
    assert r.status_code == 200 and r.json() == {"id_slot": slot, "n_erased": held}, r.text
    assert all(s["cached_tokens"] == 0 for s in _slots(slot_server))

    other = (slot + 1) % 4  # any slot takes a file
    r = _action(slot_server, other, "restore", "conv.bin")
    assert r.status_code == 200, r.text
    restored = r.json()
    assert set(restored) == {"id_slot", "filename", "n_restored", "n_read", "timings"}
    assert (restored["id_slot"], restored["n_restored"], restored["n_read"]) == (other, held, saved["n_written"])
    assert restored["timings"]["restore_ms"] >= 0
    assert _slots(slot_server)[other]["cached_tokens"] == held

    again = _complete(slot_server, prompt)
    prompt_tokens = again["usage"]["prompt_tokens"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt_tokens - 2
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert _holding(slot_server) == other
    health = slot_server.health()
    assert health["kv_errors"] == 0 and health["kv_cells"] == health["kv_cached"]


def test_files_that_do_not_fit_are_refused_in_one_line(tiny, slot_server: Served, slot_dir: Path) -> None:
    _saved(slot_server, slot_dir, "mine.bin")
    slot = _holding(slot_server)
    before = _slots(slot_server)[slot]["cached_tokens"]
    data = (slot_dir / "mine.bin").read_bytes()
    head, _, body = data.partition(b"\n")
    header = json.loads(head)
    header["key"]["target"] = file_identity(tiny.small_target)
    (slot_dir / "other-model.bin").write_bytes(json.dumps(header).encode() + b"\n" + body)
    (slot_dir / "truncated.bin").write_bytes(data[:len(head) + 1 + len(body) // 2])
    (slot_dir / "damaged.bin").write_bytes(data[:-8] + bytes(8))
    (slot_dir / "not-kv.bin").write_bytes(b"\x00" * 64)
    for name, words in (("other-model.bin", "it was written for another target model file"),
                        ("truncated.bin", "truncated or damaged"), ("damaged.bin", "do not match their checksum"),
                        ("not-kv.bin", "is not a specchat KV file"), ("absent.bin", "cannot read")):
        message = assert_error(_action(slot_server, slot, "restore", name), 400, "slot_restore_failed", "filename")
        assert message.startswith(f"Unable to restore slot: {name}" if name != "absent.bin"
                                  else "Unable to restore slot: cannot read absent.bin"), message
        assert words in message and "\n" not in message and str(slot_dir) not in message, message
    assert _slots(slot_server)[slot]["cached_tokens"] == before, "a refused file leaves the slot as it was"


def test_file_names_are_plain_names(slot_server: Served, slot_dir: Path) -> None:
    for name in ("../escape.bin", "sub/x.bin", "/tmp/x.bin", "..\\x.bin", "..", ".", "", " x.bin", "x.bin ",
                 "x.", "a:b", "a*b", "a?b", 'a"b', "a<b", "a|b", "a\u2215b", "a\uff0eb", "a\x00b", "a\nb",
                 "a\ud800b", "x" * 256):
        for action in ("save", "restore"):
            assert_error(_action(slot_server, 0, action, name), 400, "invalid_filename", "filename")
        assert not valid_filename(name), name
    for body in ({}, {"filename": 3}, {"filename": None}):
        assert_error(slot_server.post("/slots/0?action=save", body), 400, param="filename")
    assert not (slot_dir.parent / "escape.bin").exists()
    for name in ("conv.bin", "a b.bin", "café.kv", ".hidden", "x" * 255):
        assert valid_filename(name), name


def test_bad_slots_and_actions(slot_server: Served) -> None:
    for slot in ("4", "-1", "x", "1.5"):
        assert_error(_action(slot_server, slot, "erase"), 400, "invalid_slot", "id_slot")
    assert_error(_action(slot_server, 0, "load", "conv.bin"), 400, "invalid_action", "action")
    assert_error(slot_server.post("/slots/0", {"filename": "conv.bin"}), 400, "invalid_action", "action")
    assert_error(slot_server.post("/slots/0?action=save", b"{not json"), 400, "invalid_json")
    assert_error(slot_server.post("/slots/0?action=erase", {}, api_key="wrong"), 401, "invalid_api_key")
    assert _action(slot_server, 3, "erase").status_code == 200
    assert_error(_action(slot_server, 3, "save", "empty.bin"), 400, "slot_empty", "id_slot")


def test_a_busy_slot_answers_409(slot_server: Served) -> None:
    body = {"prompt": "the cat sat", "max_tokens": 4000, "temperature": 0, "stream": True, "ignore_eos": True,
            **spec("ar")}
    with httpx.stream("POST", f"{slot_server.url}/v1/completions", json=body, headers=AUTH, timeout=120) as s:
        lines = s.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # it decodes now
        busy = [x["id"] for x in _slots(slot_server) if x["is_processing"]]
        assert len(busy) == 1
        for action, name in (("save", "busy.bin"), ("restore", "conv.bin"), ("erase", None)):
            assert_error(_action(slot_server, busy[0], action, name), 409, "slot_busy", "id_slot")
    deadline = time.monotonic() + 30  # the generation stops once its client has gone
    while any(x["is_processing"] for x in _slots(slot_server)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(x["is_processing"] for x in _slots(slot_server))
    r = _action(slot_server, busy[0], "erase")
    assert r.status_code == 200 and r.json()["n_erased"] > 0, r.text


def test_a_restarted_server_takes_a_saved_slot(tiny, slot_server: Served, slot_dir: Path, tmp_path: Path) -> None:
    first, saved = _saved(slot_server, slot_dir, "restart.bin")
    served = start_server(["-m", str(tiny.target), "-md", str(tiny.draft), "--api-key", API_KEY, "-np", "4",
                           "--slot-save-path", str(slot_dir)], tmp_path / "restarted.log")
    try:
        r = _action(served, 3, "restore", "restart.bin")
        assert r.status_code == 200 and r.json()["n_restored"] == saved["n_saved"], r.text
        again = _complete(served)
        slots = _slots(served)
    finally:
        stop_server(served)
    prompt_tokens = again["usage"]["prompt_tokens"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt_tokens - 2
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert max(slots, key=lambda s: s["cached_tokens"])["id"] == 3


def test_without_slot_save_path_the_endpoint_refuses(server: Served) -> None:
    for action in ("save", "restore", "erase"):
        message = assert_error(_action(server, 0, action, "conv.bin"), 501, "not_supported")
        assert "--slot-save-path" in message
    assert len(_slots(server)) >= 1  # GET /slots answers all the same


def test_slot_save_path_must_be_a_folder(tiny, tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "app", "serve", "-m", str(tiny.target), "--slot-save-path",
                        str(tmp_path / "absent")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "--slot-save-path: not a folder" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
