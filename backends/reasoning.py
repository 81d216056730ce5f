"""Models that think: the reasoning block split from the answer, and a budget that ends it.

Thinking models (Qwen3, QwQ, the DeepSeek-R1 distills, SmolLM3, Magistral,
Command R7B) write a reasoning block before their answer, between a start
and an end tag (`<think>` … `</think>`), and several templates open the
block in the generation prompt themselves (QwQ, DeepSeek-R1: the output
starts inside it). llama.cpp's common/chat.cpp recognises the formats by
their templates and splits the output into `reasoning_content` and
`content`; this module is that, for specchat's event stream:

- `ReasoningFormat`: the tags, and whether the prompt opened the block
  (`detect_format` finds them from the template and how it renders); gpt-oss's
  harmony channels are a format too, with the analysis channel's header and
  `<|end|>` for tags (backends.harmony);
- `Splitter` (backends.splitter): a streaming splitter of released text into reasoning and
  answer, robust to tags split across tokens or spelled as several, to a
  model that skips thinking, and to a block never closed (at the end of the
  output, all of it is reasoning, as llama.cpp's parser has it), and to Gemma
  4's stray channel tags, as its parser reads them (common/parsers/gemma4.cpp).
  Like llama.cpp's, it trims the reasoning and the start of the answer
  (`new_splitter` gives harmony's its own, backends.harmony.HarmonySplitter);
- `Thinking`: a strategy wrapper (every strategy, alone or under the
  scheduler: it is a step machine too, backends.steps.relay) that labels
  each token's text by channel and ends the thinking at a budget, as
  llama-server's `reasoning_budget_tokens` does (common/reasoning-budget.cpp
  forces the end tag once the budget is spent).

The budget runs as two phases of one answer. The thinking phase generates
until the end tag (a stop string), the budget, or the answer's end; when the
budget ends it inside the block, the end tag (after the budget message, if
any) is forced, and the answer phase continues from the prompt, the thinking
and the tag, every token of which is in the caches already (only the forced
tag is decoded). So strategies need know nothing of it: each phase is an
ordinary generation, token for token what one generation would give at
temperature 0, and a grammar (structured output, tools) constrains the
answer phase only, never the thinking, as llama.cpp's lazy grammars start at
the end tag; where the grammar needs an answer (a JSON schema, a required tool
call), the turn cannot end inside the thinking (its end-of-generation tokens
are masked there), as llama.cpp's eager grammar for these spans the thinking
and the answer. Where the model opens the block itself (Qwen3's prompt
leaves `<think>` to it), a budget or a grammar adds a phase before the
thinking, up to the start tag: the budget counts from the tag wherever the
model writes it (after text of the answer's too), as llama.cpp's budget
sampler waits for it (common/reasoning-budget.cpp), and under a grammar that
phase may open the block or answer at once (backends.grammar.opening_grammar),
as llama.cpp's grammar has the block optional before the answer
(common/chat-auto-parser-generator.cpp). Under a budget, each block gets
one of its own: a start tag after the block has ended opens a new count, as
llama.cpp's budget goes back to counting there (reasoning-budget.cpp:147-160),
so the answer phase too runs up to a start tag (where no grammar holds it). The speculation memory and prompt
lookup see the thinking text (it quotes the question and repeats itself)
like any other.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Generator, Iterator, Sequence

from backends.errors import PromptError
from backends.events import Event, Token
from backends.harmony import ANALYSIS, END, FINAL, HarmonySplitter, is_harmony
from backends.sampling import GenParams
from backends.splitter import CONTENT, Splitter
from backends.steps import Steps, run_solo
from backends.text import rendering
from backends.thinking_phases import PhaseRun

if TYPE_CHECKING:  # not at run time: app.prompt_format imports this, and `specchat --help` must not load llama.cpp
    from backends.grammar import Grammar
    from backends.llama import LlamaModel
    from backends.strategies.base import Strategy

# The tag pairs of the thinking formats llama.cpp's common/chat.cpp knows, by the end tag that marks them in a
# template: DeepSeek-R1, QwQ, Qwen3, SmolLM3, GLM (<think>); Magistral ([THINK]); Command R7B; Seed-OSS; Gemma 4.
TAGS: tuple[tuple[str, str], ...] = (
    ("<think>", "</think>"),
    ("<|channel>thought", "<channel|>"),
    ("[THINK]", "[/THINK]"),
    ("<|START_THINKING|>", "<|END_THINKING|>"),
    ("<seed:think>", "</seed:think>"),
)


@dataclass(frozen=True)
class ReasoningFormat:
    """A thinking model's tags; `opened`: its generation prompt opens the block (the output starts inside it);
    `can_disable`: its template turns thinking off (`enable_thinking: false` renders the block closed); `after`:
    what its template writes after the end tag, which a budget forces with it (and, where it is more than
    whitespace, a grammar on the answer: the grammar would not let the model write it); `channels`: gpt-oss's
    harmony, whose output is messages on channels (backends.harmony)."""

    start: str
    end: str
    opened: bool = False
    can_disable: bool = False
    after: str = ""  # what the template writes after the end tag (Qwen3's, QwQ's: "\n\n"), forced with it
    channels: bool = False

    def __post_init__(self) -> None:
        if not self.start or not self.end or self.start == self.end:
            raise ValueError("a reasoning format needs two different, non-empty tags")

    @property
    def tags(self) -> tuple[str, ...]:
        """What the output's text must show, even where the vocabulary has it as control tokens (backends.text)."""
        return self.start, self.end, self.after


# gpt-oss: its analysis channel is the reasoning, ended by <|end|>, and the final channel's header follows.
# llama.cpp's gpt-oss handler has the same thinking_start_tag and thinking_end_tags (common/parsers/gpt-oss.cpp).
HARMONY = ReasoningFormat(ANALYSIS, END, after=FINAL, channels=True)


def template_thinks(template: str | None) -> bool:
    """Whether a chat template is a thinking model's, read without rendering it (for listings of many files): it
    names one of TAGS' end tags, or is gpt-oss's. `detect_format`'s first test; it renders the template to say
    more (whether the block opens in the prompt, whether it can be turned off)."""
    return template is not None and (is_harmony(template) or any(end in template for _start, end in TAGS))


def detect_format(template: str, render: Callable[[dict], str]) -> ReasoningFormat | None:
    """The thinking format of a chat template, or None for a model that does not think.

    `render(kwargs)` is a one-message conversation's text with the
    assistant's turn opened, the template given `kwargs` (as
    chat_template_kwargs): whether the block is left open there says
    whether the output starts inside it, and whether `enable_thinking:
    false` closes it says whether thinking can be turned off.
    """
    if is_harmony(template):  # gpt-oss takes reasoning_effort (low, medium, high), never enable_thinking
        on = render({"enable_thinking": True})
        return replace(HARMONY, opened=on.rfind(HARMONY.start) > on.rfind(HARMONY.end))
    for start, end in TAGS:
        if end not in template:
            continue
        on = render({"enable_thinking": True})
        opened = on.rfind(start) > on.rfind(end)
        can_disable = False
        if "enable_thinking" in template:
            off = render({"enable_thinking": False})
            can_disable = off != on and off.rfind(end) > off.rfind(start) >= 0
        # What the model writes after the end tag: the newlines the template writes there itself (Qwen3's two,
        # SmolLM3's one), or strips from earlier answers (QwQ: `.lstrip('\n')` after splitting at the tag).
        written = re.findall(re.escape(end) + r"((?:\\n|\n)+)", template)
        if written:
            after = "\n" * max(w.count("\\n") + w.count("\n") for w in written)  # escaped or literal newlines
        elif re.search(r"""lstrip\(\s*['"]\\n['"]\s*\)""", template):
            after = "\n\n"
        else:
            after = ""
        return ReasoningFormat(start, end, opened, can_disable, after)
    return None


def new_splitter(fmt: ReasoningFormat, opened: bool | None = None) -> Splitter | HarmonySplitter:
    """The streaming splitter for a format: harmony's channels, or a block between tags."""
    return HarmonySplitter(fmt, opened) if fmt.channels else Splitter(fmt, opened)


def opening(fmt: ReasoningFormat, prompt: str) -> str:
    """What the generation prompt wrote of the thinking block: the prompt's text from its last start tag on, where
    the output goes on inside that block (QwQ's and the R1 distills' `<think>\n`, a reasoning continued) or the
    prompt ends with it closed (Qwen3's thinking off: `<think>\n\n</think>\n\n`); "" where the prompt leaves
    the block to the model. llama.cpp parses the generation prompt and the output as one text, the prompt's
    head before the start tag consumed (common/chat.cpp:1459, chat-peg-parser.cpp:869's prefix(),
    chat-auto-parser-generator.cpp:134; its gemma4 and gpt-oss parsers likewise): under reasoning_format none,
    where nothing is taken out as reasoning, its content starts with this (test-chat.cpp:2159, 2707). `prompt` is
    the generation prompt (app.prompt_format.PromptFormat.generation_prompt), as llama.cpp's: in the whole
    conversation, a message that writes a tag ("What does `<think>` do?") would look like an opened block."""
    i = prompt.rfind(fmt.start)
    if i < 0:
        return ""
    j = prompt.rfind(fmt.end)
    if j < i or not prompt[j + len(fmt.end):].strip():
        return prompt[i:]
    return ""


def split(fmt: ReasoningFormat, text: str) -> tuple[str, str]:
    """A whole output's (reasoning, answer)."""
    s = new_splitter(fmt)
    s.push(text)
    s.flush()
    return s.reasoning, s.content


class Thinking:
    """A strategy whose output a thinking model splits into reasoning and answer (GenParams.reasoning), with
    the thinking ended at GenParams.reasoning_budget tokens. Without a format, the strategy's own machine."""

    def __init__(self, inner: "Strategy", model: "LlamaModel") -> None:
        self.inner = inner
        self.model = model

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def steps(self, prompt: Sequence[int], params: GenParams, should_stop: Callable[[], bool] = lambda: False) -> Steps:
        if params.reasoning is None:
            return self.inner.steps(prompt, params, should_stop)
        return self._phases(list(prompt), params, should_stop)

    def generate(self, prompt: Sequence[int], params: GenParams,
                 should_stop: Callable[[], bool] = lambda: False) -> Iterator[Event]:
        return run_solo(self.steps(prompt, params, should_stop))

    def _tokens(self, text: str) -> list[int]:
        return self.model.tokenize(text, add_special=False, parse_special=True)

    def _answer_required(self, params: GenParams) -> bool:
        """Whether the answer's grammar needs an answer (it does not take an empty one: a JSON schema, a required
        tool call). Then the turn may not end inside the thinking: llama.cpp's grammar for these is eager
        (chat-auto-parser-generator.cpp:79, test-chat.cpp:1220) and spans the thinking (`root ::= ... ("<think>"
        until "</think>")? ... response-format`), so no end-of-generation token gets in before the answer."""
        if params.grammar is None:
            return False
        allowed = params.grammar.start().allowed()
        return not any(allowed[t] for t in self.model.eog_ids if t < len(allowed))

    @staticmethod
    def _unwritten(text: str, prompt: list[int], piece: Callable[[int], bytes]) -> str:
        """`text` less its beginning that the prompt ends with (gpt-oss's prompt ends in `<|start|>assistant`)."""
        tail = b"".join(piece(t) for t in prompt[-32:]).decode("utf-8", errors="replace")
        return text[next((k for k in range(len(text), 0, -1) if tail.endswith(text[:k])), 0):]

    def _phases(self, prompt: list[int], params: GenParams, should_stop: Callable[[], bool]) -> Steps:
        fmt = params.reasoning
        assert fmt is not None
        # The tags as the output's text shows them, control tokens included (backends.text.rendering; the
        # strategies' runs render them so too, so that the end tag ends the thinking phase as a stop string).
        run = PhaseRun(self.inner, prompt, params, should_stop, new_splitter(fmt), rendering(self.model, fmt.tags))
        if params.grammar is not None and fmt.channels:
            yield from self._harmony(run)
            return
        answer, tagged = params, False
        if not fmt.opened and not fmt.channels and (params.grammar is not None or params.reasoning_budget is not None):
            from backends.grammar import opening_grammar  # here: llguidance only where a grammar is in use

            grammar = None if params.grammar is None else \
                opening_grammar(params.grammar, fmt.start, self._tokens(fmt.start))
            opened = yield from self._opening(run, grammar)
            if opened is None:
                return
            tagged, answer = opened
        spent, header = False, ""
        if answer is params:
            # harmony's analysis header, which the model writes, is not counted (it opens no pre-phase)
            counted = len(self._tokens(fmt.start)) if fmt.channels and not fmt.opened else 0
            ended = yield from self._thinking(run, params.reasoning_budget, tagged, counted)
            if ended is None:
                return
            spent, header = ended
        forced = yield from self._end(run, spent, header)
        while params.reasoning_budget is not None and answer.grammar is None:
            # A start tag after the block has ended opens a block with a budget of its own: llama.cpp's budget
            # goes back to counting there (common/reasoning-budget.cpp:147-160, "some models emit multiple <think>
            # blocks per response"). So the answer runs up to the next start tag, as the opening phase does.
            run.add_forced(forced)
            again = yield from self._opening(run, None)
            if again is None:
                return
            ended = yield from self._thinking(run, params.reasoning_budget, again[0])
            if ended is None:
                return
            forced = yield from self._end(run, *ended)
        yield from self._answer(run, answer, forced)

    def _harmony(self, run: PhaseRun) -> Steps:
        """gpt-oss under a grammar (a response_format, a required or named call): analysis messages first, free
        text, then the answer's header (`fmt.after`: the final channel's, or the call's) and the answer under the
        grammar, as llama.cpp's grammar has it (common/parsers/gpt-oss.cpp:97-135, `(start analysis)* start
        answer`, not lazy). At each message's start the model writes an analysis header or the answer's
        (backends.harmony.opening_grammar); an analysis it ends itself (`<|end|>`) is followed by another such
        start; under a budget, one spent inside an analysis forces its end and the answer's header (llama-server
        forces `<|end|>` alone: docs/serve.md), and each analysis has a budget of its own, counted from its
        header's own tokens as llama.cpp's budget sampler counts (reasoning-budget.cpp:78-160)."""
        from backends.harmony import START, marker_terminal, opening_grammar  # llguidance only under a grammar

        params, fmt = run.params, run.params.reasoning
        assert fmt is not None and params.grammar is not None
        marker = marker_terminal(self.model)
        header = fmt.after[len(START):] if fmt.after.startswith(START) else fmt.after
        thinking = fmt.opened  # the prompt opened the analysis: llama.cpp's budget saw its header (the prefill)
        if not thinking and not self._unwritten(fmt.after, run.prompt, run.piece):
            # The prompt wrote the answer's header itself (a continued answer): the grammar holds the rest.
            yield from run.relay(self.inner.steps(run.prompt, params, run.should_stop))
            run.first = run.ends[-1]
            yield run.done([], None)
            return
        tagged = thinking
        while True:
            if not thinking:
                # What of `<|start|>assistant` is the model's: none after the generation prompt, all of it after an
                # analysis it ended itself.
                lead = self._unwritten(START, run.prompt + run.written, run.piece)
                opened = yield from self._opening(run, opening_grammar(params.grammar, header, marker, lead))
                if opened is None:
                    return  # the answer, at once
                tagged, answer = opened
                if answer is not params:  # the analysis header inside the answer (a JSON string): it goes on
                    yield from self._answer(run, answer, [])
                    return
            ended = yield from self._thinking(run, params.reasoning_budget, tagged)
            if ended is None:
                return
            spent = ended[0]
            if spent:
                break
            thinking = False  # the model ended its analysis: another message follows
        yield from self._answer(run, params, (yield from self._end(run, spent, "")))

    def _opening(self, run: PhaseRun,
                 grammar: "Grammar | None") -> Generator[Event, object, tuple[bool, GenParams] | None]:
        """Where the model opens the block itself (Qwen3), under a budget or a grammar: the phases up to its start
        tag. llama.cpp's budget counts from the start tag wherever the model writes it as its tokens
        (common/reasoning-budget.cpp:78-118: idle until the output's tokens end with the tag's own, then one less
        per token), and its grammar lets the block come first, optionally, then the answer (`grammar`,
        backends.grammar.opening_grammar). The budget here counts from those tags too, and from a block the parser
        reads as the thinking however the model spelt its tag (harmony's `analy`+`sis`, `<`+`think`+`>` at the
        start: llama.cpp's token matcher misses these and lets such a block run to max_tokens); a tag spelt
        otherwise after text of the answer's (" <" after a word in SmolLM2's vocabulary) is the answer's text,
        left alone as llama-server leaves it. After a block, the answer up to the next one. Returns (whether
        the budget counts the block, the answer phase's parameters: the grammar continued past a tag inside the
        answer), or None where the answer ended before a block (its Done handed on)."""
        params, fmt, splitter = run.params, run.params.reasoning, run.splitter
        assert fmt is not None
        tag = self._tokens(fmt.start)
        begun = len(run.written)  # what the phases before this one wrote (the grammar starts after it)
        while True:
            steps = run.start(replace(params, stop=(fmt.start, *params.stop), grammar=grammar))
            if steps is None:
                yield from run.cut_short()
                return None
            yield from run.relay(steps)
            phase = run.ended()
            rest = run.after_tag(phase, fmt.start)
            if rest is None:  # no block: that was the answer (or its end: eos, a stop, the length)
                yield run.done([], None)
                return None
            run.carried(splitter.push(fmt.start + rest))  # the tag (and what its last token wrote after it)
            written = run.written
            tagged = not rest and written[-len(tag):] == tag
            if len(written) >= params.max_tokens:
                yield run.done([], None, "length")
                return None
            if tagged or splitter.thinking or grammar is not None:
                break  # else: a tag in the answer's text that the budget does not see; on to the next
        if grammar is not None and not splitter.thinking:
            # The tag inside the answer (a JSON string): the answer goes on under its grammar, which the opening
            # phase began.
            return tagged, replace(params, grammar=grammar.after(written[begun:]))
        return tagged or splitter.thinking, params

    def _thinking(self, run: PhaseRun, budget: int | None, tagged: bool,
                  counted: int = 0) -> Generator[Event, object, tuple[bool, str] | None]:
        """The thinking: free text (no grammar) up to the end tag, within the budget (and `counted` tokens the
        phase writes before the block). Returns (whether the budget was spent inside the block: its end is forced;
        what a grammar on the answer needs forced before it), or None where the answer ended inside the block (its
        Done handed on)."""
        params, fmt, splitter = run.params, run.params.reasoning, run.splitter
        assert fmt is not None
        room = params.max_tokens - len(run.written)
        cap = room if budget is None else min(room, budget + counted)
        if cap <= 0:
            return True, ""  # a budget of 0: the block ends as soon as it is open
        thinking = replace(params, max_tokens=cap, stop=(fmt.end, *params.stop), grammar=None, reasoning_phase=True,
                           ignore_eos=params.ignore_eos or self._answer_required(params))
        phase = yield from run.phase(thinking)
        rest = run.after_tag(phase, fmt.end)
        if rest is not None:
            # The end tag ends the block; one that text of the answer's came before (the block is the answer's,
            # as llama.cpp's parser reads it: the optional block must come first) is text. What the tag's last
            # token wrote after it goes on (SmolLM2's `><` ends harmony's `<|end|>` and starts the next header).
            run.carried((splitter.close(), "") if splitter.thinking else splitter.push(fmt.end))
            run.carried(splitter.push(rest))
            return False, fmt.after if params.grammar is not None and fmt.after.strip() else ""
        if phase.reason != "length" or len(run.written) >= params.max_tokens:
            yield run.done([], None)  # the answer's end: eos, a stop, an error
            return None
        # The budget, spent: inside a block, its end is forced (harmony's analysis not begun yet: none to end).
        return splitter.thinking or tagged, ""

    def _end(self, run: PhaseRun, spent: bool, header: str) -> Generator[Event, object, list[int]]:
        """What is forced after a block: the budget's end of it, or the header a grammar would not let the model
        write (harmony's final header, not whitespace); handed on, and returned."""
        params, fmt, splitter, carry = run.params, run.params.reasoning, run.splitter, run.carry
        assert fmt is not None
        forced: list[int] = []
        if spent or header:
            content = ""
            if spent:  # the budget is spent inside the block: its end is forced
                message = params.reasoning_message
                # The message, then the tag, as llama-server forces them; then what the template writes after the
                # tag (llama-server leaves that to the model, and a small one may end its answer there, empty).
                header = message + fmt.end + fmt.after
                if splitter.thinking:
                    reasoning, _ = splitter.push(message)
                    reasoning, carry[0] = carry[0] + reasoning + splitter.close(), ""
                    splitter.push(fmt.after)  # nothing to show: whitespace, or harmony's final header
                else:  # a block after text of the answer's: what is forced is the answer's text too
                    reasoning, carry[0] = carry[0], ""
                    content, carry[1] = carry[1] + splitter.push(header)[1], ""
            else:
                reasoning, carry[0] = carry[0], ""
                splitter.push(header)
            # Counted in max_tokens, as llama.cpp's forced tokens are sampled ones: cut at the limit (the answer then
            # ends "length"), not written past it.
            forced = self._tokens(header)[:max(params.max_tokens - len(run.written), 1)]
            yield from run.hand_on([Token(tok, content if i == 0 else "", "accepted", source="grammar",
                                          reasoning=reasoning if i == 0 else "", channel=CONTENT)
                                    for i, tok in enumerate(forced)])
        return forced

    def _answer(self, run: PhaseRun, answer: GenParams, forced: list[int]) -> Steps:
        """The answer's phase under `answer`, after the `forced` tokens."""
        room = run.params.max_tokens - len(run.written) - len(forced)
        steps = None
        if room >= 1 and not run.should_stop():
            try:
                steps = self.inner.steps(run.prompt + run.written + forced, replace(answer, max_tokens=room),
                                         run.should_stop)
            except PromptError:  # the context is full
                steps = None
        if steps is None:
            yield from run.cut_short(forced)
            return
        yield from run.relay(steps)
        yield run.done(forced, run.ends[-1])
