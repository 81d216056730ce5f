"""A thinking model's answers from specchat serve and llama-server, field by field (not a test: a comparison).

Both servers load the same GGUF (SmolLM2-Instruct re-packed with QwQ's
original template, whose prompt opens <think>, and with Qwen3's, which takes
enable_thinking: tests/conftest.py's fixture, written here once into
--dir), llama-server with `--jinja`, and are sent the same requests with the
`openai` client at temperature 0: whole and streamed, a reasoning budget, a
budget message, `reasoning_format: "none"`, thinking off. For each request it
prints both servers' `reasoning_content`, `content`, finish reason and token
counts, and whether they agree.

    python tests/perf/thinking_vs_llama_server.py

llama-server comes from ../shared/tools/build-llama-cpp-reference.sh.
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
REQUESTS = {  # name -> (model, extra body)
    "qwq whole": ("qwq", {}),
    "qwq streamed": ("qwq", {"stream": True}),
    "qwq budget 24": ("qwq", {"reasoning_budget_tokens": 24}),
    "qwq budget 24, message": ("qwq", {"thinking_budget_tokens": 24,
                                       "reasoning_budget_message": "Time to answer."}),
    "qwq budget 0": ("qwq", {"reasoning_budget_tokens": 0}),
    "qwq reasoning_format none": ("qwq", {"reasoning_format": "none", "reasoning_budget_tokens": 24}),
    "qwen3 whole": ("qwen3", {}),
    "qwen3 enable_thinking false": ("qwen3", {"chat_template_kwargs": {"enable_thinking": False}}),
    "qwen3 budget 16": ("qwen3", {"reasoning_budget_tokens": 16}),
}


def fixtures(folder: Path) -> dict[str, Path]:
    from conftest import repack_with_template
    from models.resolve import resolve_model

    folder.mkdir(parents=True, exist_ok=True)
    templates = ROOT / "tests" / "data" / "templates"
    qwq = "".join(line for line in (templates / "Qwen-QwQ-32B.jinja").read_text().splitlines(keepends=True)
                  if "enable_thinking" not in line)
    out = {"qwq": folder / "smollm2-qwq.gguf", "qwen3": folder / "smollm2-qwen3.gguf"}
    texts = {"qwq": qwq, "qwen3": (templates / "Qwen-Qwen3-0.6B.jinja").read_text()}
    for name, path in out.items():
        if not path.exists():
            repack_with_template(resolve_model("smollm2"), path, texts[name])
    return out


def ask(server: Server, body: dict, n: int) -> dict:
    client = server.client()
    stream = body.pop("stream", False)
    extra = dict(body)
    if stream:
        reasoning = content = ""
        finish = None
        for chunk in client.chat.completions.create(model=MODEL_ID[0], messages=QUESTION, max_tokens=n,
                                                    temperature=0, stream=True, extra_body=extra):
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or (delta.model_extra or {}).get(
                "reasoning_content") or ""
            content += delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        return {"reasoning_content": reasoning, "content": content, "finish_reason": finish}
    r = client.chat.completions.create(model=MODEL_ID[0], messages=QUESTION, max_tokens=n, temperature=0,
                                       extra_body=extra)
    m = r.choices[0].message
    return {"reasoning_content": (m.model_extra or {}).get("reasoning_content") or "", "content": m.content or "",
            "finish_reason": r.choices[0].finish_reason, "completion_tokens": r.usage.completion_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "specchat-thinking")
    ap.add_argument("-n", type=int, default=96)
    ap.add_argument("-t", type=int, default=2)
    args = ap.parse_args()
    models = fixtures(args.dir)
    log_dir = Path(tempfile.mkdtemp(prefix="thinking-"))
    results: dict[str, dict[str, dict]] = {}
    for model, path in models.items():
        MODEL_ID[0] = path.stem
        servers = [Server("specchat", "-s ar", path, path, 1, 2048, args.t, log_dir),
                   Server("llama-server", "--jinja", path, path, 1, 2048, args.t, log_dir)]
        try:
            for name, (which, body) in REQUESTS.items():
                if which == model:
                    results[name] = {s.name: ask(s, dict(body), args.n) for s in servers}
        finally:
            for s in servers:
                s.stop()
    for name, by_server in results.items():
        a, b = by_server["specchat"], by_server["llama-server"]
        same = {k: a.get(k) == b.get(k) for k in ("reasoning_content", "content", "finish_reason")}
        print(f"## {name}: " + ", ".join(f"{k} {'same' if v else 'DIFFERS'}" for k, v in same.items()))
        for server, r in by_server.items():
            print(f"  {server:>12}: {json.dumps(r, ensure_ascii=False)[:400]}")
    print(f"(server logs: {log_dir})")


if __name__ == "__main__":
    main()
