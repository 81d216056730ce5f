"""The model's own drafters, specchat serve beside llama-server on the synthetic fixtures (not a test).

Issue 44 asks that the synthetic drafter files load in llama-server (the
reference build of the same vendored llama.cpp) and give the same greedy
tokens there as in specchat. For each fixture of tests/perf/drafter_fixtures.py
(written to a temporary folder unless --dir names one that has them):

    mtp           mtp-target.gguf, glm4moe with one MTP head    --spec-type draft-mtp
    mtp-hy_v3     mtp-chain-hy_v3.gguf, 3 chained heads         --spec-type draft-mtp
    mtp-step35    mtp-chain-step35.gguf, 3 chained heads        --spec-type draft-mtp
    eagle3        eagle3-target.gguf -md eagle3-draft.gguf      --spec-type draft-eagle3
    dflash        dflash-target.gguf -md dflash-draft.gguf      --spec-type draft-dflash
    gemma4        gemma4-target.gguf -md gemma4-assistant.gguf  --spec-type draft-mtp

it starts llama-server with that spec type and `--spec-draft-n-max K
--spec-draft-p-min 0`, then `specchat serve -m TARGET [-md DRAFT] -s sps
--draft-max K --draft-p-min 0 --no-adaptive --no-memory` (one server at a
time, both with -np 1, the same -c and -t; tests/perf/serve_vs_llama_server.py's
Server starts and stops them), sends each the same raw prompts at temperature
0 with max_tokens N, and prints a table: whether each server loaded the files
(else its one-line error), whether the prompts tokenize alike (`/tokenize` on
both), whether the greedy tokens and texts are identical, and each server's
draft acceptance summed over the prompts (`timings.draft_n` /
`draft_n_accepted`, which both servers report). specchat's `sps` drafts for
the first token too, where llama-server samples it from the prompt's logits:
with none of those accepted, specchat drafts K more per prompt.

How the token ids are compared. llama-server: its own `/completion` with
`return_tokens` (the ids it generated, exactly). specchat gives no ids over
HTTP, so its tokens are read from log-probabilities: the completions API's
legacy logprobs list each token's text only, and this vocabulary has 128 byte
tokens (0x80-0xFF) that each render as U+FFFD alone, besides "a" , . ! ? as
both a word and a byte token; chat's logprobs give each token's exact bytes.
These tiny models have no chat template, so specchat's chat renders the one
user message as the raw text (app/prompt_format.py, `PromptFormat.render`
when plain; the prompt token counts are checked equal). So specchat is asked
through /v1/chat/completions with logprobs (the `openai` client), and its
per-token bytes are compared with the pieces of llama-server's ids
(llama.cpp's `llama_token_to_piece` through backends.llama.LlamaModel); a
position whose bytes two vocabulary entries share is counted as ambiguous
(the ids there agree up to that pair). specchat's /v1/completions with the
same raw prompt is sent too, and its text must equal the chat's. A trailing
end-of-generation token (llama-server lists it, it renders as nothing) is
dropped before comparing.

    .venv/bin/python tests/perf/drafters_vs_llama_server.py [--dir DIR] [-k 3] [-n 32] [-t 2] [--only mtp,eagle3]
        [--plain] [-v]

--plain adds a row per fixture with each target alone (llama-server without
--spec-type, specchat -s ar --no-mtp): where the drafted tokens differ, it
says whether the targets already do.

llama-server comes from ../shared/tools/build-llama-cpp-reference.sh
(SPECCHAT_REF_DIR, default ~/.cache/specchat-reference). Logs of every server
are kept in a temporary folder, named at the end.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from drafter_fixtures import main as write_fixtures  # noqa: E402
from serve_vs_llama_server import Server  # noqa: E402

PROMPTS = ("once upon a time the cat", "the cat sat on the", "def hello world return print",
           "a big red dog ran to the house")


@dataclass(frozen=True)
class Fixture:
    name: str
    target: str
    draft: str | None
    spec_type: str


FIXTURES = (
    Fixture("mtp", "mtp-target.gguf", None, "draft-mtp"),
    Fixture("mtp-hy_v3", "mtp-chain-hy_v3.gguf", None, "draft-mtp"),
    Fixture("mtp-step35", "mtp-chain-step35.gguf", None, "draft-mtp"),
    Fixture("eagle3", "eagle3-target.gguf", "eagle3-draft.gguf", "draft-eagle3"),
    Fixture("dflash", "dflash-target.gguf", "dflash-draft.gguf", "draft-dflash"),
    Fixture("gemma4", "gemma4-target.gguf", "gemma4-assistant.gguf", "draft-mtp"),  # Gemma 4's assistant file
)


@dataclass
class Answer:
    """One server's answer to one prompt: the prompt's ids, the output's pieces (bytes per token), the text."""
    prompt_ids: list[int]
    pieces: list[bytes]
    text: str
    draft_n: int
    accepted: int
    ids: list[int] = field(default_factory=list)  # llama-server's only
    other_text: str | None = None  # specchat's /v1/completions text, to match its chat's


@dataclass
class Run:
    """One server on one fixture: its answers, or why it did not load or answer."""
    answers: list[Answer] = field(default_factory=list)
    error: str | None = None


class Started(Server):
    """serve_vs_llama_server.Server that stops its process when it never became healthy (the base leaves it
    running on a timeout)."""

    def __init__(self, *args: object) -> None:
        try:
            super().__init__(*args)  # type: ignore[arg-type]
        except SystemExit:
            proc = getattr(self, "proc", None)
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
            raise


_ERROR_LINE = re.compile(r"error|fail|refus|abort|cannot|can't|not supported|unknown|invalid|exception", re.I)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def one_line(log: Path) -> str:
    """The line of a server's log that says why it stopped: the last that reads like an error, else the last."""
    lines = [_ANSI.sub("", ln).strip() for ln in log.read_text(errors="replace").splitlines()]
    lines = [ln for ln in lines if ln]
    errors = [ln for ln in lines if _ERROR_LINE.search(ln) and "is normal during memory fitting" not in ln]
    return (errors or lines or ["(empty log)"])[-1][:200]


def start(name: str, flags: str, target: Path, draft: Path | None, args: argparse.Namespace,
          log_dir: Path) -> Started | str:
    """The started server, or the one line that says why it did not start. Server passes specchat `-md
    DRAFT` always: an empty string is no draft there (app/loading.py reads it as none)."""
    try:
        return Started(name, flags, target, draft if draft is not None else "", 1, args.c, args.t, log_dir)
    except SystemExit as e:
        log = log_dir / f"{name.replace(' ', '_')}.log"
        why = one_line(log) if log.exists() else str(e)
        return f"did not start in 300 s ({why})" if "did not start" in str(e) else why


def tokenize(port: int, text: str) -> list[int]:
    r = httpx.post(f"http://127.0.0.1:{port}/tokenize", json={"content": text, "add_special": True}, timeout=60)
    r.raise_for_status()
    return r.json()["tokens"]


def ask_llama_server(server: Server, prompt: str, n: int, piece: dict[int, bytes], eos: set[int]) -> Answer:
    r = httpx.post(f"http://127.0.0.1:{server.port}/completion", timeout=600, json={
        "prompt": prompt, "n_predict": n, "temperature": 0, "return_tokens": True, "cache_prompt": False})
    r.raise_for_status()
    body = r.json()
    ids = list(body["tokens"])
    if ids and body.get("stop_type") == "eos" and ids[-1] in eos:
        ids = ids[:-1]
    t = body.get("timings", {})
    return Answer(tokenize(server.port, prompt), [piece[i] for i in ids], body["content"],
                  int(t.get("draft_n", 0)), int(t.get("draft_n_accepted", 0)), ids=ids)


def ask_specchat(server: Server, model: str, prompt: str, n: int) -> Answer:
    client = server.client()
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                          max_tokens=n, temperature=0, logprobs=True, top_logprobs=0)
    choice = chat.choices[0]
    pieces = [bytes(c.bytes or []) for c in (choice.logprobs.content if choice.logprobs else None) or []]
    if pieces and choice.finish_reason == "stop" and pieces[-1] == b"":
        pieces = pieces[:-1]  # an end-of-generation token, if listed
    t = (chat.model_extra or {}).get("timings") or {}
    text = client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0).choices[0].text
    prompt_ids = tokenize(server.port, prompt)
    if chat.usage is not None and chat.usage.prompt_tokens != len(prompt_ids):
        raise RuntimeError(f"chat read {chat.usage.prompt_tokens} prompt tokens, /tokenize gives {len(prompt_ids)}: "
                           "the chat is not the raw prompt (a chat template?)")
    return Answer(prompt_ids, pieces, choice.message.content or "", int(t.get("draft_n", 0)),
                  int(t.get("draft_n_accepted", 0)), other_text=text)


def run_server(name: str, flags: str, fixture: Fixture, folder: Path, args: argparse.Namespace, log_dir: Path,
               ask) -> Run:  # type: ignore[no-untyped-def]
    target = folder / fixture.target
    draft = folder / fixture.draft if fixture.draft else None
    server = start(name, flags, target, draft, args, log_dir)
    if isinstance(server, str):
        return Run(error=server)
    run = Run()
    try:
        for prompt in args.prompts:
            run.answers.append(ask(server, prompt))
    except Exception as e:  # noqa: BLE001 - a server that loads but fails a request: its line
        dead = server.proc.poll() is not None
        run.error = (f"request failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
                     + (f"; it exited: {one_line(Path(server.log.name))}" if dead else ""))
    finally:
        server.stop()
    return run


def vocabulary(target: Path) -> tuple[dict[int, bytes], set[int], set[bytes]]:
    """Every id's piece as llama.cpp renders it (control tokens as nothing), the end-of-generation ids, and
    the pieces that more than one id renders as."""
    from backends.llama import LlamaModel
    model = LlamaModel(target)
    try:
        piece = {i: model.piece(i) for i in range(model.n_vocab)}
        eos = {model.eos}
    finally:
        model.close()
    seen: dict[bytes, int] = {}
    for p in piece.values():
        seen[p] = seen.get(p, 0) + 1
    return piece, eos, {p for p, k in seen.items() if k > 1}


def compare(ls: Run, sc: Run, shared: set[bytes]) -> tuple[str, str, str, list[str]]:
    """(prompt ids, tokens, text) cells and the lines that say where they differ."""
    notes: list[str] = []
    if ls.error or sc.error or not ls.answers or not sc.answers:
        return "-", "-", "-", notes
    n = len(ls.answers)
    same_prompt = sum(a.prompt_ids == b.prompt_ids for a, b in zip(ls.answers, sc.answers))
    same_tokens = same_text = ambiguous = 0
    for i, (a, b) in enumerate(zip(ls.answers, sc.answers)):
        if a.pieces == b.pieces:
            same_tokens += 1
            ambiguous += sum(p in shared for p in a.pieces)
        else:
            j = next((k for k, (x, y) in enumerate(zip(a.pieces, b.pieces)) if x != y), min(len(a.pieces),
                                                                                           len(b.pieces)))
            ls_at = f"id {a.ids[j]} {a.pieces[j]!r}" if j < len(a.ids) else "end"
            sc_at = repr(b.pieces[j]) if j < len(b.pieces) else "end"
            notes.append(f"prompt {i + 1}: tokens differ at output token {j} (llama-server {ls_at}, specchat "
                         f"{sc_at}); llama-server {len(a.pieces)} tokens, specchat {len(b.pieces)}")
        if a.text == b.text == b.other_text:
            same_text += 1
        elif b.text != b.other_text:
            notes.append(f"prompt {i + 1}: specchat's chat text {b.text!r} is not its completions text "
                         f"{b.other_text!r}")
        else:
            notes.append(f"prompt {i + 1}: texts differ: llama-server {a.text!r}, specchat {b.text!r}")
    tokens = f"same {same_tokens}/{n}" + (f" ({ambiguous} tok. byte-ambiguous)" if ambiguous else "")
    return f"same {same_prompt}/{n}", tokens, f"same {same_text}/{n}", notes


def acceptance(run: Run) -> str:
    if run.error or not run.answers:
        return "-"
    drafted, accepted = sum(a.draft_n for a in run.answers), sum(a.accepted for a in run.answers)
    return f"{accepted}/{drafted}" + (f" ({accepted / drafted:.2f})" if drafted else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=None, help="folder with the fixtures (default: write them anew)")
    ap.add_argument("-k", type=int, default=3, help="most drafted tokens per step, both servers (default: 3, "
                                                    "llama-server's --spec-draft-n-max default)")
    ap.add_argument("-n", type=int, default=32, help="max_tokens per request (default: 32)")
    ap.add_argument("-t", type=int, default=2, help="threads (default: 2)")
    ap.add_argument("-c", type=int, default=512, help="context (default: 512)")
    ap.add_argument("--only", default=None, help="comma-separated fixture names (default: all)")
    ap.add_argument("--prompt", dest="prompts", action="append", default=None, help="a raw prompt (repeatable)")
    ap.add_argument("--plain", action="store_true",
                    help="also each target alone: llama-server without --spec-type, specchat -s ar --no-mtp")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every answer's ids / pieces")
    args = ap.parse_args()
    args.prompts = args.prompts or list(PROMPTS)
    fixtures = [f for f in FIXTURES if args.only is None or f.name in args.only.split(",")]
    folder = args.dir
    if folder is None or not all((folder / f.target).exists() for f in fixtures):
        folder = folder or Path(tempfile.mkdtemp(prefix="drafter-fixtures-"))
        with open("/dev/null", "w") as null:  # the factory prints the paths
            stdout, sys.stdout = sys.stdout, null
            try:
                write_fixtures([str(folder)])
            finally:
                sys.stdout = stdout
    logs = Path(tempfile.mkdtemp(prefix="drafters-vs-"))
    k = args.k
    rows, notes = [], []
    plans = [(fx, False) for fx in fixtures] + ([(fx, True) for fx in fixtures] if args.plain else [])
    for fx, plain in plans:
        piece, eos, shared = vocabulary(folder / fx.target)
        name = f"{fx.name} (plain)" if plain else fx.name
        log_dir = logs / name.replace(" ", "_")
        log_dir.mkdir()
        ls_flags = "" if plain else f"--spec-type {fx.spec_type} --spec-draft-n-max {k} --spec-draft-p-min 0" + \
            (" -md DRAFT" if fx.draft else "")
        sc_flags = "-s ar --no-mtp --no-memory --temp 0 --seed 0" if plain else \
            f"-s sps --draft-max {k} --draft-p-min 0 --no-adaptive --no-memory --temp 0 --seed 0"
        fx = Fixture(name, fx.target, None if plain else fx.draft, fx.spec_type)
        print(f"{fx.name}: llama-server {ls_flags}", file=sys.stderr)
        ls = run_server("llama-server", ls_flags, fx, folder, args, log_dir,
                        lambda s, p: ask_llama_server(s, p, args.n, piece, eos))
        print(f"{fx.name}: specchat serve {sc_flags}", file=sys.stderr)
        sc = run_server("specchat", sc_flags, fx, folder, args, log_dir,
                        lambda s, p: ask_specchat(s, Path(fx.target).stem, p, args.n))
        prompt_cell, tokens_cell, text_cell, differ = compare(ls, sc, shared)
        rows.append((fx.name, "loaded" if ls.error is None else f"refused: {ls.error}",
                     "loaded" if sc.error is None else f"refused: {sc.error}",
                     prompt_cell, tokens_cell, text_cell, acceptance(ls), acceptance(sc)))
        notes += [f"{fx.name}: {line}" for line in differ]
        if args.verbose:
            for i, (a, b) in enumerate(zip(ls.answers, sc.answers)):
                print(f"{fx.name} prompt {i + 1}: llama-server ids {a.ids} (draft {a.accepted}/{a.draft_n}); "
                      f"specchat pieces {[p.decode('utf-8', 'replace') for p in b.pieces]} "
                      f"(draft {b.accepted}/{b.draft_n})", file=sys.stderr)
    head = ("fixture", "llama-server", "specchat", "prompt ids", "greedy tokens", "text",
            f"llama-server accepted/drafted (K {k})", f"specchat sps accepted/drafted (K {k})")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    for line in notes:
        print(f"- {line}")
    print(f"{len(args.prompts)} prompts, {args.n} tokens each, temperature 0; fixtures in {folder}; logs in {logs}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
