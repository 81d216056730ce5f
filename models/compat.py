"""Can this draft speculate for this target? llama.cpp's rules
(`common_speculative_are_compatible` in common/speculative.cpp): same
vocabulary type, same BOS/EOS ids and add-BOS/add-EOS flags, vocabulary sizes
within 128 of each other, and identical token text from id 5 on.

Works on `GGUFInfo`, so it runs on headers alone (before loading, or before a
download when the header was fetched remotely).
"""

from __future__ import annotations

from dataclasses import dataclass

from models.errors import incompatible_pair
from models.gguf_info import GGUFInfo

VOCAB_MAX_SIZE_DIFFERENCE = 128
VOCAB_CHECK_START_TOKEN_ID = 5


@dataclass(frozen=True)
class PairCheck:
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def check_pair(target: GGUFInfo, draft: GGUFInfo) -> PairCheck:
    problems: list[str] = []
    if target.tokenizer_model != draft.tokenizer_model:
        problems.append(f"vocabulary type differs (target {target.tokenizer_model}, draft {draft.tokenizer_model})")
    for label, t, d in (
        ("BOS id", target.bos_id, draft.bos_id),
        ("EOS id", target.eos_id, draft.eos_id),
        ("add-BOS flag", target.add_bos, draft.add_bos),
        ("add-EOS flag", target.add_eos, draft.add_eos),
    ):
        if t != d:
            problems.append(f"{label} differs (target {t}, draft {d})")
    diff = abs(target.vocab_size - draft.vocab_size)
    if diff > VOCAB_MAX_SIZE_DIFFERENCE:
        problems.append(
            f"vocabulary sizes differ by {diff} (target {target.vocab_size}, draft {draft.vocab_size}; "
            f"at most {VOCAB_MAX_SIZE_DIFFERENCE} allowed)"
        )
    for i in range(VOCAB_CHECK_START_TOKEN_ID, min(target.vocab_size, draft.vocab_size)):
        if target.tokens[i] != draft.tokens[i]:
            problems.append(
                f"token {i} differs (target {target.tokens[i]!r}, draft {draft.tokens[i]!r})"
            )
            break
    if draft.architecture == "eagle3":
        from models.drafters import eagle3_problems

        problems += eagle3_problems(target, draft)
    if draft.architecture == "dflash":
        from models.drafters import dflash_problems

        problems += dflash_problems(target, draft)
    if draft.architecture == "gemma4-assistant":
        from models.drafters import assistant_problems

        problems += assistant_problems(target, draft)
    return PairCheck(tuple(problems))


def require_compatible(target: GGUFInfo, draft: GGUFInfo) -> None:
    result = check_pair(target, draft)
    if not result.ok:
        raise incompatible_pair(target.path.name, draft.path.name, result.problems)
