"""The three drafters a model carries, on vocabularies a grammar can run on: an MTP head inside a glm4moe target,
an EAGLE-3 draft (with a reduced `d2t` vocabulary) beside a llama target, and a DFlash block draft beside another.

Each is built to agree with its target often (tests/drafter_factory.py, eagle3_factory.py, dflash_factory.py), so
drafts are both accepted and rejected, and each vocabulary spells a space as SentencePiece does (`space=True`):
llguidance can then read the output back, which grammars need (tests/test_grammar.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflash_factory import MASK_PIECE, DFlashPair, write_dflash_pair
from drafter_factory import MtpModel, write_mtp_target
from eagle3_factory import Eagle3Pair, write_eagle3_pair
from gguf_factory import spm_vocab

DRAFTERS = ("mtp", "eagle3", "dflash")  # their labels: Token.source, `--json`'s "source", the stats bar


@dataclass(frozen=True)
class DrafterFiles:
    target: Path
    draft: Path | None  # None: the target's own MTP head drafts

    def cli_args(self) -> list[str]:
        return ["-m", str(self.target)] + (["-md", str(self.draft)] if self.draft else [])


def write_drafter_files(d: Path) -> dict[str, DrafterFiles]:
    """The files of each drafter under `d`, by the drafter's label."""
    d.mkdir(parents=True, exist_ok=True)
    write_mtp_target(d / "mtp-target.gguf", MtpModel(residual=0.1, head_noise=0.1), vocab=spm_vocab(space=True))
    write_eagle3_pair(d / "eagle3-target.gguf", d / "eagle3-draft.gguf",
                      model=Eagle3Pair(residual=0.02, head_noise=0.1), vocab=spm_vocab(space=True))
    write_dflash_pair(d / "dflash-target.gguf", d / "dflash-draft.gguf",
                      model=DFlashPair(residual=0.02, sharpness=3.0, noise=0.1, ffn_noise=0.1, mix=8.0),
                      vocab=spm_vocab(control=(MASK_PIECE,), space=True))
    return {"mtp": DrafterFiles(d / "mtp-target.gguf", None),
            "eagle3": DrafterFiles(d / "eagle3-target.gguf", d / "eagle3-draft.gguf"),
            "dflash": DrafterFiles(d / "dflash-target.gguf", d / "dflash-draft.gguf")}
