"""A long conversation stays fast: 1,000 chat turns on one `ChatSession`.

Not a test: a measurement. A chat that outgrows its context keeps only its
newest turns in the prompt, but the session still sees the whole transcript
every turn; this shows that assembling the prompt (choosing the cut, rendering
the chat template, tokenizing) costs about the same at turn 1,000 as at turn
10, and that memory does not grow with the conversation beyond its text.

Runs the tiny test models written by tests/gguf_factory.py (a chat-template
target and a noisy draft of it) with a 512-token context and 16-token
answers, cycling through the strategies (ar, sps, lookahead, lookup, tree),
and prints, at turns 10, 100 and 1,000: the prompt-assembly time of that turn
and the median over the turns since the last report, the process's RSS,
and, for comparison, the time of the simple rule (trying suffixes from the
whole conversation, one render and tokenization per pair dropped) on the same
conversation at that turn (it must drop the same messages).

    python tests/perf/chat_soak.py                 # 1,000 turns
    python tests/perf/chat_soak.py --turns 200 --no-reference
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from app.chat_template import ChatMessage  # noqa: E402
from app.session import ChatSession, TurnRequest  # noqa: E402
from app.settings import CHAT_N_SEQ_MAX  # noqa: E402
from backends.config import StrategyOptions  # noqa: E402
from backends.engine import Engine, EngineConfig  # noqa: E402
from backends.events import until_done  # noqa: E402
from backends.sampling import GenParams  # noqa: E402
from gguf_factory import WORDS, write_llama_gguf  # noqa: E402

STRATEGIES = ("ar", "sps", "lookahead", "lookup", "tree")
REPORT_AT = (10, 100, 1000)
N_CTX = 512
ANSWER_TOKENS = 16
# The Gemma-style template of tests/test_chat_session.py: BOS from the template, turns as plain-text tags.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}</{{ m['role'] }}>\n"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


def rss_mib() -> float:
    """Resident memory of this process now (Linux), in MiB."""
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * 4096 / 2**20


def simple_rule_seconds(messages: list[ChatMessage], session: ChatSession, user_text: str,
                        reserve: int) -> tuple[float, int]:
    """Time of the quadratic rule on `messages`, and how many of them it drops."""
    n_ctx = session.engine.target.n_ctx
    started = time.perf_counter()
    history = messages
    while True:
        tokens = session.format.tokens([*history, ChatMessage("user", user_text)], session.system_prompt)
        if len(tokens) + reserve <= n_ctx or not history:
            return time.perf_counter() - started, len(messages) - len(history)
        history = history[2:]


def write_models(folder: Path) -> tuple[Path, Path]:
    target = write_llama_gguf(folder / "chat-target.gguf", chat_template=TEMPLATE)
    draft = write_llama_gguf(folder / "chat-draft.gguf", noise=0.3, chat_template=TEMPLATE)
    return target, draft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=1000)
    ap.add_argument("--no-reference", action="store_true", help="skip timing the simple rule at the reports")
    args = ap.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as folder:
        target, draft = write_models(Path(folder))
        engine = Engine(EngineConfig(target=target, draft=draft, n_ctx=N_CTX, threads=1, n_seq_max=CHAT_N_SEQ_MAX,
                                     cost_cache=""))
        try:
            session = ChatSession(engine, system_prompt="Answer briefly.")
            assembly: list[float] = []
            failures: list[str] = []
            assemble = session.prompt_tokens

            def timed_prompt_tokens(user_text: str, reserve: int = 0, **kwargs: object) -> list[int]:
                started = time.perf_counter()
                tokens = assemble(user_text, reserve, **kwargs)
                assembly.append(time.perf_counter() - started)
                return tokens

            session.prompt_tokens = timed_prompt_tokens  # what session.turn calls
            params = GenParams(max_tokens=ANSWER_TOKENS)
            reserve = session.answer_reserve(ANSWER_TOKENS)  # what session.turn keeps free for the answer
            print(f"{args.turns} turns, n_ctx {N_CTX}, {ANSWER_TOKENS}-token answers, strategies {', '.join(STRATEGIES)}")
            print(f"RSS before the first turn: {rss_mib():.1f} MiB")
            last_report = 0
            started = time.perf_counter()
            for turn in range(1, args.turns + 1):
                user_text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 20)))
                request = TurnRequest(STRATEGIES[(turn - 1) % len(STRATEGIES)], params, StrategyOptions())
                report = turn in REPORT_AT or turn == args.turns
                before = list(session.messages) if report else []  # the conversation this turn assembles from
                done = until_done(session.turn(user_text, request))
                rss = rss_mib()  # before the simple rule's timing below (it allocates whole-conversation prompts)
                if done.reason == "error":  # the turn is left out of the conversation; counted, shown at the end
                    failures.append(f"turn {turn} ({request.strategy}): {done.error}; prompt {done.stats.prompt_tokens} "
                                    f"tokens, {done.stats.generated_tokens} generated, n_ctx {engine.target.n_ctx}")
                if report:
                    since = assembly[last_report:turn]
                    line = (f"turn {turn:5d}: prompt assembly {1e3 * assembly[-1]:6.2f} ms "
                            f"(median of turns {last_report + 1}-{turn}: {1e3 * statistics.median(since):6.2f} ms), "
                            f"{len(session.messages)} messages, {session.dropped} left out of the prompt, "
                            f"RSS {rss:.1f} MiB")
                    if not args.no_reference:  # on the conversation the turn's own assembly saw
                        reference_seconds, reference_dropped = simple_rule_seconds(before, session, user_text, reserve)
                        line += f"; simple rule: {1e3 * reference_seconds:.1f} ms"
                        if reference_dropped != session.dropped:
                            raise SystemExit(f"turn {turn}: the simple rule drops {reference_dropped} messages, "
                                             f"the session {session.dropped}")
                    print(line, flush=True)
                    last_report = turn
            print(f"{args.turns} turns in {time.perf_counter() - started:.1f} s; {len(failures)} failed")
            for failure in failures[:10]:
                print(f"  {failure}")
        finally:
            engine.close()


if __name__ == "__main__":
    main()
