"""llama-server's manual slot API: `--slot-save-path DIR` and `POST /slots/{id}?action=save|restore|erase`.

Follows llama.cpp's tools/server/server-context.cpp (`post_slots`,
`handle_slots_save` / `_restore` / `_erase` and the SERVER_TASK_TYPE_SLOT_*
tasks) and common/common.cpp's `fs_validate_filename`, for clients that
drive the cache by hand: save what a slot holds into DIR/FILENAME, put it
back into a slot (of this server or of a later one), or empty a slot. The
answers are llama-server's (`id_slot`, `filename`, `n_saved`, `n_written`,
`timings.save_ms`; `n_restored`, `n_read`, `timings.restore_ms`;
`n_erased`); errors have OpenAI's shape, as everywhere in this server.

A file holds the slot's target and draft cells in backends.kv_store's format
(a header line with the key and the tokens, then the cells; written
atomically, readable by its owner only), keyed by the engine's `kv_key()`:
a file of another model, context size or llama.cpp build, truncated or
damaged, is refused with one line (`KvStoreError`'s words) and the slot is
left as it was. After a restore, the next request whose prompt starts with
the file's tokens lands in that slot (the pool picks the free slot with the
longest prefix) and decodes only what follows them.

What touches a slot's cells runs on the engine's thread between two steps
(`EngineWorker.call`), never while a slot decodes; reading and writing the
file run on a thread of their own, so the engine never waits for the disk. A
slot that is processing a request answers 409 (llama-server defers the task
until the slot is idle; an immediate answer tells a client driving slots by
hand what happened instead of holding its connection).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from app.serve.fields import ApiError, bad
from backends.kv_store import KvEntry, KvStoreError, read_entry, restore, snapshot, write_entry

if TYPE_CHECKING:
    from app.serve.worker import EngineWorker

ACTIONS = ("save", "restore", "erase")
NOT_SUPPORTED = "This server does not support slots action. Start it with `--slot-save-path`"


def valid_filename(name: str) -> bool:
    """llama.cpp's fs_validate_filename without subfolders: a plain file name of at most 255 bytes, no path
    separator, control character, character Windows forbids (or its Unicode look-alike), surrogate,
    replacement character or byte order mark; no leading or trailing space, no trailing dot, no "..".
    So a name always means a file directly in the slot folder."""
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate (JSON's "\\ud800")
        return False
    if not name or size > 255:
        return False
    for ch in name:
        c = ord(ch)
        if c <= 0x1F or c == 0x7F or 0x80 <= c <= 0x9F or c in (0xFF0E, 0x2215, 0x2216, 0xFFFD, 0xFEFF) \
                or 0xD800 <= c <= 0xDFFF or ch in ':*?"<>|/\\':
            return False
    return not (name[0] == " " or name[-1] in " ." or ".." in name or name == ".")


class SlotFiles:
    """The slot folder of one server and the actions on its worker's slots."""

    def __init__(self, folder: Path, worker: "EngineWorker") -> None:
        self.folder = folder
        self.worker = worker

    # -- on the engine's thread ------------------------------------------------

    def _idle(self, id_slot: int) -> Any:
        """The slot, if it is not processing a request (checked on the engine's thread: it cannot start one
        before the action ends)."""
        pool = self.worker.pool
        if id_slot not in pool.free:
            raise ApiError(409, f"slot {id_slot} is processing a request; retry once it is idle "
                                "(GET /slots: is_processing)", "id_slot", "slot_busy")
        return pool.engine.slots[id_slot]

    def _snapshot(self, id_slot: int) -> tuple[KvEntry, float]:
        """The slot's cells, and the seconds copying them took."""
        slot = self._idle(id_slot)
        t0 = time.perf_counter()
        entry = snapshot(slot.target, slot.draft)
        if entry is None:
            raise bad(f"slot {id_slot} holds no cells to save", "id_slot", "slot_empty")
        return entry, time.perf_counter() - t0

    def _restore(self, id_slot: int, entry: KvEntry) -> tuple[int, float]:
        """The slot holds exactly the entry's cells (what it held goes, as in llama-server): its tokens, and
        the seconds putting them back took."""
        slot = self._idle(id_slot)
        pool = self.worker.pool
        t0 = time.perf_counter()
        slot.reset()
        try:
            n = restore(entry, slot.target, slot.draft, entry.target_tokens)
            if not n:
                slot.reset()
                raise ApiError(400, "Unable to restore slot: no room in the KV cache for its "
                                    f"{len(entry.target_tokens)} tokens", "id_slot", "slot_restore_failed")
            return n, time.perf_counter() - t0
        finally:
            pool.kv_cells, pool.kv_cached = pool.cells()

    def _erase(self, id_slot: int) -> int:
        slot = self._idle(id_slot)
        pool = self.worker.pool
        n = len(slot.target.tokens)
        pool.reset(id_slot)
        pool.kv_cells, pool.kv_cached = pool.cells()
        return n

    # -- the actions, on the event loop ----------------------------------------

    # timings: copying the cells and the file's writing or reading, not the wait for the engine's thread.

    async def save(self, id_slot: int, filename: str) -> dict[str, object]:
        entry, copying = await self.worker.call(lambda: self._snapshot(id_slot))
        path = self.folder / filename
        key = self.worker.engine.kv_key()
        t0 = time.perf_counter()
        try:
            await asyncio.to_thread(write_entry, path, key, entry)
            n_written = path.stat().st_size
        except OSError as e:
            raise ApiError(500, f"Unable to save slot: {filename}: {e.strerror or e}",
                           "filename", "slot_save_failed") from None
        ms = (copying + time.perf_counter() - t0) * 1000
        return {"id_slot": id_slot, "filename": filename, "n_saved": len(entry.target_tokens),
                "n_written": n_written, "timings": {"save_ms": ms}}

    async def restore(self, id_slot: int, filename: str) -> dict[str, object]:
        path = self.folder / filename
        key = self.worker.engine.kv_key()
        t0 = time.perf_counter()
        try:
            entry = await asyncio.to_thread(read_entry, path, key)
            n_read = path.stat().st_size  # the header too
        except KvStoreError as e:  # its own words, the file named as the client named it
            raise ApiError(400, f"Unable to restore slot: {str(e).replace(str(path), filename)}", "filename",
                           "slot_restore_failed") from None
        except OSError as e:  # gone since it was read
            raise ApiError(400, f"Unable to restore slot: cannot read {filename}: {e.strerror or e}", "filename",
                           "slot_restore_failed") from None
        reading = time.perf_counter() - t0
        n, putting = await self.worker.call(lambda: self._restore(id_slot, entry))
        return {"id_slot": id_slot, "filename": filename, "n_restored": n, "n_read": n_read,
                "timings": {"restore_ms": (reading + putting) * 1000}}

    async def erase(self, id_slot: int) -> dict[str, object]:
        n = await self.worker.call(lambda: self._erase(id_slot))
        return {"id_slot": id_slot, "n_erased": n}


async def slot_action(files: SlotFiles | None, n_slots: int, request: Request,
                      body: Callable[[], Awaitable[dict[str, Any]]]) -> Response:
    """POST /slots/{id_slot}?action=...: checked in llama-server's order (the folder, the slot id, the
    action, the file name), then done. `body` reads the request's JSON object (save and restore only)."""
    if files is None:
        raise ApiError(501, NOT_SUPPORTED, code="not_supported", kind="not_supported_error")
    raw = request.path_params.get("id_slot", "")
    try:
        id_slot = int(raw)
    except ValueError:
        id_slot = -1
    if not 0 <= id_slot < n_slots:
        raise bad(f"Invalid slot ID {raw!r}: this server has slots 0..{n_slots - 1}", "id_slot", "invalid_slot")
    action = request.query_params.get("action", "")
    if action not in ACTIONS:
        raise bad(f"Invalid action {action!r}: save, restore or erase", "action", "invalid_action")
    if action == "erase":
        return JSONResponse(await files.erase(id_slot))
    filename = (await body()).get("filename")
    if not isinstance(filename, str):
        raise bad("'filename' must be a string: the file's name in the --slot-save-path folder", "filename")
    if not valid_filename(filename):
        raise bad(f"Invalid filename {filename!r}: a plain file name, without a folder", "filename",
                  "invalid_filename")
    if action == "save":
        return JSONResponse(await files.save(id_slot, filename))
    return JSONResponse(await files.restore(id_slot, filename))
