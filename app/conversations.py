"""Saved conversations: one JSON file per chat in the data dir, written atomically.

A crash mid-save leaves the previous version intact (models.files.write_atomic);
a file that cannot be read is skipped when listing, never fatal. A thinking
model's answer keeps its reasoning ("reasoning", written only when there is
some: a file saved before it existed reads as answers without reasoning).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from app.chat_template import ChatMessage
from models.files import write_atomic
from models.paths import data_dir

TITLE_CHARS = 60


@dataclass(frozen=True)
class Conversation:
    id: str
    updated: str  # ISO 8601, UTC
    model: str | None
    system_prompt: str
    messages: tuple[ChatMessage, ...]

    @property
    def title(self) -> str:
        first = next((m.content for m in self.messages if m.role == "user"), "(empty)")
        line = " ".join(first.split())
        return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1] + "…"

    @property
    def turns(self) -> str:
        """'1 turn', '3 turns': the user's messages (a turn whose answer was lost still counts)."""
        n = sum(1 for m in self.messages if m.role == "user")
        return f"{n} turn" if n == 1 else f"{n} turns"


def _message_dict(m: ChatMessage) -> dict[str, str]:
    out = {"role": m.role, "content": m.content}
    if m.reasoning:
        out["reasoning"] = m.reasoning
    return out


def new_conversation_id() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


class ConversationStore:
    def __init__(self, folder: Path | None = None) -> None:
        self.folder = folder or data_dir() / "conversations"

    def save(self, conversation: Conversation) -> None:
        data = {
            "id": conversation.id,
            "updated": conversation.updated,
            "model": conversation.model,
            "system_prompt": conversation.system_prompt,
            "messages": [_message_dict(m) for m in conversation.messages],
        }
        write_atomic(self.folder / f"{conversation.id}.json", json.dumps(data, ensure_ascii=False, indent=1) + "\n")

    def load(self, conversation_id: str) -> Conversation:
        """The conversation in `<conversation_id>.json`, whose name is its id (a copy of a file is a conversation of
        its own, saved to its own file). OSError where it cannot be read, ValueError where it is malformed."""
        data = json.loads((self.folder / f"{conversation_id}.json").read_text(encoding="utf-8"))
        try:
            messages = tuple(ChatMessage(m["role"], m["content"], reasoning=m.get("reasoning", ""))
                             for m in data["messages"])
            updated, model, system_prompt = data["updated"], data.get("model"), data.get("system_prompt", "")
        except (KeyError, TypeError, AttributeError) as e:  # not an object, messages not a list of objects, ...
            raise ValueError(f"conversation {conversation_id} is malformed ({type(e).__name__}: {e})") from None
        if any(m.role not in ("user", "assistant", "system") or not isinstance(m.content, str)
               or not isinstance(m.reasoning, str) for m in messages):
            raise ValueError(f"conversation {conversation_id} has a malformed message")
        if not isinstance(updated, str) or not isinstance(system_prompt, str) \
                or not (model is None or isinstance(model, str)):
            raise ValueError(f"conversation {conversation_id} is malformed (its time, model or system prompt)")
        return Conversation(conversation_id, updated, model, system_prompt, messages)

    def list(self) -> list[Conversation]:
        """Saved conversations, newest first; unreadable or malformed files are skipped."""
        out = []
        for path in self.folder.glob("*.json"):
            try:
                out.append(self.load(path.stem))
            except (OSError, ValueError):
                continue
        return sorted(out, key=lambda c: c.updated, reverse=True)


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
