"""llama-server's generation loop with chained MTP heads, replayed in process for one slot at temperature 0.

A reference for what `llama-server --spec-type draft-mtp` drafts and accepts on a file with several MTP heads
(`chain_heads`), on the same llama.cpp build as specchat (llama-cpp-python's), call for call:
  - every target decode is followed by the driver's process() (tools/server/server-context.cpp:3725-3729):
    for each head, the sequence's MTP cells from the batch's first position are removed and the batch's rows
    decoded again under that head, row k paired with the target's hidden row k - 1, the first with
    `pending_h` (common/speculative.cpp:1507-1557); `pending_h` becomes the batch's last row (:1562-1579);
  - the prompt is decoded whole and the first token sampled from its logits, with no draft
    (server-context.cpp:3827-3837);
  - then each step drafts (pos0 the slot's cached tokens, id_last the token sampled last,
    server-context.cpp:2983-3016) at most min(n_max, n_mtp_layers) tokens (speculative.cpp:1421-1431), cut to
    the tokens left less one (`get_n_draft_max`, server-context.cpp:453-471; speculative.cpp:2832-2836):
    step i removes the MTP cells from pos0 and decodes the whole prefix again under head i, row t paired with
    chain_h[t] (pending_h, then each step's output at its last row), and keeps the top token (p_min 0)
    (speculative.cpp:1584-1731);
  - the server removes the draft's MTP cells past the target's (server-context.cpp:3044), the target
    verifies [id_last, drafts] (:488-511), the longest agreeing prefix and the target's next token are kept
    (common_sampler_sample_and_accept_n at temperature 0, :3897), accept(n) sets pending_h to the target's
    row n (speculative.cpp:1733-1746) and the target's cells past the kept tokens go (:3979). The counts
    are the server's `n_draft_tokens` and `n_draft_accepted` (:3034, 3961).
`draft_first=True` runs specchat's schedule instead: the prompt less its last token is decoded and the first
step drafts for the first output token too (backends/strategies/sps.py, prefill then step).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from backends.llama import Batch, ContextConfig, LlamaContext, LlamaModel
from backends.llama_ext import HiddenBatch, enable_hidden, hidden_row, hidden_rows, set_nextn_layer_offset


@dataclass(frozen=True)
class Generation:
    tokens: list[int]
    drafted: int
    accepted: int


class ChainedMtpServer:
    """One slot of llama-server with `--spec-type draft-mtp --spec-draft-n-max K --spec-draft-p-min 0` on a
    file whose MTP heads chain (n_layer_nextn > 1)."""

    def __init__(self, path: Path, k: int = 3, n_ctx: int = 512, threads: int = 1) -> None:
        self.model = LlamaModel(path, load_mtp=True)
        assert self.model.n_layer_nextn > 1, "a file whose heads chain"
        config = ContextConfig(n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=threads)
        self.target = LlamaContext(self.model, config)
        self.mtp = LlamaContext(self.model, config, other=self.target, mtp=True)
        enable_hidden(self.target, masked=False)  # speculative.cpp:1417-1418
        enable_hidden(self.mtp, masked=True)
        self.heads = self.model.n_layer_nextn
        self.n_max = min(k, self.heads)
        self.pending = np.zeros(self.model.n_embd, dtype=np.float32)  # the constructor's zeros (:1433)
        self.verify_h = self.pending[None, :]
        self.rows = HiddenBatch(self.mtp)
        self.n_ctx = n_ctx

    def close(self) -> None:
        for closable in (self.rows, self.mtp, self.target, self.model):
            closable.close()

    def _decode(self, tokens: list[int], pos0: int) -> list[np.ndarray]:
        """A target decode of `tokens` from pos0, logits on every row, then process()."""
        batch = Batch(len(tokens))
        for i, tok in enumerate(tokens):
            batch.add(tok, pos0 + i, (0,), True)
        self.target.decode(batch)
        logits = [self.target.logits(i).copy() for i in range(len(tokens))]
        batch.close()
        h = hidden_rows(self.target, len(tokens)).copy()
        paired = np.concatenate([self.pending[None, :], h[:-1]])
        for head in range(self.heads):
            self.mtp.seq_rm(0, pos0, -1)
            set_nextn_layer_offset(self.mtp, head)
            self.rows.fill([(tok, pos0 + i, (0,), False) for i, tok in enumerate(tokens)], paired)
            self.rows.process()
        set_nextn_layer_offset(self.mtp, 0)
        self.verify_h, self.pending = h, h[-1].copy()
        return logits

    def _draft(self, id_last: int, pos0: int, n_max: int, stop_at_eos: bool = False) -> list[int]:
        tokens, feats, result = [id_last], [self.pending.copy()], []
        for head in range(self.n_max):
            self.mtp.seq_rm(0, pos0, -1)
            set_nextn_layer_offset(self.mtp, head)
            self.rows.fill([(t, pos0 + j, (0,), j == len(tokens) - 1) for j, t in enumerate(tokens)],
                           np.stack(feats))
            self.rows.process()
            result.append(int(np.argmax(self.mtp.logits(len(tokens) - 1))))
            if len(result) >= self.n_max or (stop_at_eos and result[-1] == self.model.eos):
                break
            feats.append(hidden_row(self.mtp, len(tokens) - 1).copy())
            tokens.append(result[-1])
        set_nextn_layer_offset(self.mtp, 0)
        return result[:n_max]

    def generate(self, prompt: list[int], n: int, draft_first: bool = False, stop_at_eos: bool = False) -> Generation:
        """Up to n tokens after `prompt` (a request with cache_prompt off: the slot's cells go first); the
        drafted and accepted counts as `timings.draft_n` / `draft_n_accepted` report them. `draft_first`: draft
        for the first output token too; `stop_at_eos`: end a chain at the end-of-generation token (specchat's
        loop does both; llama-server's neither)."""
        self.target.seq_rm(0, -1, -1)
        self.mtp.seq_rm(0, -1, -1)
        drafted = accepted = 0
        if draft_first:
            self._decode(prompt[:-1], 0)
            out: list[int] = []
            id_last, pos0 = prompt[-1], len(prompt) - 1
        else:
            out = [int(np.argmax(self._decode(prompt, 0)[-1]))]
            id_last, pos0 = out[-1], len(prompt)
        while len(out) < n and (not out or out[-1] != self.model.eos):
            n_draft_max = min(self.n_ctx - pos0 - 2, n - len(out) - 1)
            drafts = self._draft(id_last, pos0, n_draft_max, stop_at_eos) if n_draft_max > 0 else []
            self.mtp.seq_rm(0, pos0, -1)
            logits = self._decode([id_last] + drafts, pos0)
            ids = []
            for i, row in enumerate(logits):
                ids.append(int(np.argmax(row)))
                if i == len(drafts) or ids[-1] != drafts[i]:
                    break
            if drafts:
                self.pending = self.verify_h[min(len(ids) - 1, len(self.verify_h) - 1)].copy()
                drafted += len(drafts)
                accepted += len(ids) - 1
            self.target.seq_rm(0, pos0 + len(ids), -1)
            out += ids
            id_last, pos0 = ids[-1], pos0 + len(ids)
        end = next((i + 1 for i, t in enumerate(out) if t == self.model.eos), len(out))
        return Generation(out[:min(n, end)], drafted, accepted)
