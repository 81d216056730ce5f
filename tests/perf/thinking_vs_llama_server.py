"""A thinking model's answers from specchat serve and llama-server, field by field (not a test: a comparison).

Both servers load the same GGUF (SmolLM2-Instruct re-packed with QwQ's
original template, whose prompt opens <think>, with Qwen3's, which takes
enable_thinking, and with gpt-oss's harmony template: tests/conftest.py's
fixtures, written here once into --dir), llama-server with `--jinja`, and are
sent the same requests with the `openai` client at temperature 0: whole and
streamed, a reasoning budget, a budget message, `reasoning_format: "none"`,
thinking off; an answer that opens a second block under a budget; gpt-oss
under a response_format and a required tool call, where the model may write
analysis messages before the answer. For each request it prints both
servers' `reasoning_content`, `content`, tool calls, finish reason and token
counts, and whether they agree.

    python tests/perf/thinking_vs_llama_server.py                 # every request
    python tests/perf/thinking_vs_llama_server.py --only second   # those whose name has "second"

llama-server comes from ../shared/tools/build-llama-cpp-reference.sh. Its
grammar sampler is slow on SmolLM2's 49k vocabulary inside gpt-oss's
analysis (about 3 s a token on a 2-core VM): the gpt-oss requests take
minutes there.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "perf"))

from serve_vs_llama_server import MODEL_ID, Server  # noqa: E402

QUESTION = [{"role": "user", "content": "What is 17 times 3? Think it through."}]
# An answer that opens a second block: after the first block, SmolLM2 writes `<think>` at a line's start, with the
# tag's own tokens, which llama.cpp's budget counts again (common/reasoning-budget.cpp:147-160).
SECOND = [{"role": "user", "content": "Write the tag <think> on its own line, then a thought."}]
JSON_QUESTION = [{"role": "user", "content": "What is 17 times 3? Answer in JSON."}]
WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]
ANSWER_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
REQUESTS = {  # name -> (model, extra body, messages)
    "qwq whole": ("qwq", {}, QUESTION),
    "qwq streamed": ("qwq", {"stream": True}, QUESTION),
    "qwq budget 24": ("qwq", {"reasoning_budget_tokens": 24}, QUESTION),
    "qwq budget 24, message": ("qwq", {"thinking_budget_tokens": 24,
                                       "reasoning_budget_message": "Time to answer."}, QUESTION),
    "qwq budget 0": ("qwq", {"reasoning_budget_tokens": 0}, QUESTION),
    "qwq reasoning_format none": ("qwq", {"reasoning_format": "none", "reasoning_budget_tokens": 24}, QUESTION),
    "qwq second block, budget 8": ("qwq", {"reasoning_budget_tokens": 8}, SECOND),
    "qwq second block, budget 8, streamed": ("qwq", {"reasoning_budget_tokens": 8, "stream": True}, SECOND),
    "qwq second block, no budget": ("qwq", {}, SECOND),
    "qwen3 whole": ("qwen3", {}, QUESTION),
    "qwen3 enable_thinking false": ("qwen3", {"chat_template_kwargs": {"enable_thinking": False}}, QUESTION),
    "qwen3 budget 16": ("qwen3", {"reasoning_budget_tokens": 16}, QUESTION),
    "qwen3 second block, budget 8": ("qwen3", {"reasoning_budget_tokens": 8}, SECOND),
    "gpt-oss schema, budget 16": ("gpt-oss", {"reasoning_budget_tokens": 16, "reasoning_effort": "low",
                                              "response_format": ANSWER_SCHEMA}, JSON_QUESTION),
    "gpt-oss required call, budget 16": ("gpt-oss", {"reasoning_budget_tokens": 16, "tools": TOOLS,
                                                     "tool_choice": "required"}, WEATHER),
}


def fixtures(folder: Path) -> dict[str, Path]:
    from conftest import repack_with_template
    from models.resolve import resolve_model

    folder.mkdir(parents=True, exist_ok=True)
    templates = ROOT / "tests" / "data" / "templates"
    qwq = "".join(line for line in (templates / "Qwen-QwQ-32B.jinja").read_text().splitlines(keepends=True)
                  if "enable_thinking" not in line)
    out = {"qwq": folder / "smollm2-qwq.gguf", "qwen3": folder / "smollm2-qwen3.gguf",
           "gpt-oss": folder / "smollm2-gpt-oss.gguf"}
    texts = {"qwq": qwq, "qwen3": (templates / "Qwen-Qwen3-0.6B.jinja").read_text(),
             "gpt-oss": (templates / "openai-gpt-oss-120b.jinja").read_text()}
    for name, path in out.items():
        if not path.exists():
            repack_with_template(resolve_model("smollm2"), path, texts[name])
    return out


def ask(server: Server, body: dict, messages: list[dict], n: int) -> dict:
    client = server.client()
    stream = body.pop("stream", False)
    extra = dict(body)
    for name in ("tools", "tool_choice", "response_format"):  # the client's own arguments
        if name in extra:
            extra.pop(name)
    own = {name: body[name] for name in ("tools", "tool_choice", "response_format") if name in body}
    if stream:
        reasoning = content = ""
        finish, tokens, calls = None, None, []
        for chunk in client.chat.completions.create(model=MODEL_ID[0], messages=messages, max_tokens=n,
                                                    temperature=0, stream=True, stream_options={"include_usage": True},
                                                    extra_body=extra, **own):
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or (delta.model_extra or {}).get(
                "reasoning_content") or ""
            content += delta.content or ""
            calls += [(c.function.name, c.function.arguments) for c in delta.tool_calls or [] if c.function.name]
            finish = chunk.choices[0].finish_reason or finish
        return {"reasoning_content": reasoning, "content": content, "tool_calls": calls, "finish_reason": finish,
                "completion_tokens": tokens}
    r = client.chat.completions.create(model=MODEL_ID[0], messages=messages, max_tokens=n, temperature=0,
                                       extra_body=extra, **own)
    m = r.choices[0].message
    return {"reasoning_content": (m.model_extra or {}).get("reasoning_content") or "", "content": m.content or "",
            "tool_calls": [(c.function.name, c.function.arguments) for c in m.tool_calls or []],
            "finish_reason": r.choices[0].finish_reason, "completion_tokens": r.usage.completion_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "specchat-thinking")
    ap.add_argument("-n", type=int, default=96)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--only", action="append", default=[], help="the requests whose name has this (repeatable)")
    args = ap.parse_args()
    chosen = {k: v for k, v in REQUESTS.items() if not args.only or any(o in k for o in args.only)}
    models = {k: v for k, v in fixtures(args.dir).items() if any(m == k for m, _, _ in chosen.values())}
    log_dir = Path(tempfile.mkdtemp(prefix="thinking-"))
    results: dict[str, dict[str, dict]] = {}
    for model, path in models.items():
        MODEL_ID[0] = path.stem
        servers = [Server("specchat", "-s ar", path, path, 1, 2048, args.t, log_dir),
                   Server("llama-server", "--jinja", path, path, 1, 2048, args.t, log_dir)]
        try:
            for name, (which, body, messages) in chosen.items():
                if which == model:
                    results[name] = {s.name: ask(s, dict(body), messages, args.n) for s in servers}
        finally:
            for s in servers:
                s.stop()
    for name, by_server in results.items():
        a, b = by_server["specchat"], by_server["llama-server"]
        keys = ("reasoning_content", "content", "tool_calls", "finish_reason", "completion_tokens")
        print(f"## {name}: " + ", ".join(f"{k} {'same' if a.get(k) == b.get(k) else 'DIFFERS'}" for k in keys))
        for server, r in by_server.items():
            print(f"  {server:>12}: {json.dumps(r, ensure_ascii=False)[:600]}")
    print(f"(server logs: {log_dir})")


if __name__ == "__main__":
    main()
