"""A thinking model's tags where its vocabulary has them as control tokens, on real llama.cpp.

llama.cpp renders a control token as nothing (`llama_token_to_piece` without
`special`). A format whose end tag is one control token would then never end
the thinking phase as a stop string, nor be seen by the splitter: its tokens
are rendered as their text where a format is in use (backends.text.rendering),
as llama-server renders a format's `preserved_tokens`. gpt-oss needs none of
it: llama.cpp 0.3.36 itself makes its header tokens and `<|end|>` ordinary
(src/llama-vocab.cpp, the "quick hack for gpt-oss" and the o200k_harmony
workaround that takes `<|end|>` off the end-of-generation list): checked here
too, on a vocabulary of the same shape.
"""

from __future__ import annotations

from pathlib import Path

from backends.events import TARGET
from backends.llama import LlamaModel
from backends.reasoning import ReasoningFormat
from backends.run import Run
from backends.sampling import GenParams
from gguf_factory import spm_vocab, write_llama_gguf

THINK = ReasoningFormat("<think>", "</think>")


def test_a_control_token_end_tag_ends_the_thinking_phase(tmp_path: Path) -> None:
    model = LlamaModel(write_llama_gguf(tmp_path / "think.gguf", vocab=spm_vocab(control=("<think>", "</think>"))))
    try:
        (end,) = model.tokenize(THINK.end, add_special=False, parse_special=True)
        assert model.piece(end) == b"" and model.piece(end, special=True) == b"</think>"
        words = model.tokenize("the cat sat", add_special=False)

        def thinking_phase(reasoning: ReasoningFormat | None) -> Run:
            params = GenParams(max_tokens=4 * len(words), stop=(THINK.end,), reasoning=reasoning, reasoning_phase=True)
            run = Run("ar", model, params, [1, *words], 512)
            for t in (*words, end, *words):
                run.commit(t, TARGET)
                if run.reason is not None:
                    break
            return run

        run = thinking_phase(THINK)
        assert run.reason == "stop" and run.output == [*words, end]
        assert run.done().text == b"".join(model.piece(t) for t in words).decode()
        plain = thinking_phase(None)  # rendered as nothing, the tag cannot stop anything
        assert plain.reason is None and len(plain.output) == 2 * len(words) + 1
    finally:
        model.close()


def test_llama_cpp_renders_gpt_oss_header_tokens_and_end_as_text(tmp_path: Path) -> None:
    tags = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")
    model = LlamaModel(write_llama_gguf(tmp_path / "oss.gguf", vocab=spm_vocab(control=tags)))
    try:
        ids = {tag: model.tokenize(tag, add_special=False, parse_special=True) for tag in tags}
        assert all(len(v) == 1 for v in ids.values()), ids
        for tag in ("<|start|>", "<|channel|>", "<|message|>", "<|end|>"):
            assert model.piece(ids[tag][0]) == tag.encode(), tag
        assert not model.is_eog(ids["<|end|>"][0]), "a message's end, not the generation's"
        assert model.is_eog(ids["<|return|>"][0]) and model.piece(ids["<|return|>"][0]) == b""
    finally:
        model.close()


def test_reasoning_format_none_shows_control_token_tags_as_text(tmp_path: Path) -> None:
    """`reasoning_format: "none"` is the output as written: a thinking model's tags that are control tokens (Gemma 4's
    <|channel>, Command R7B's <|START_THINKING|>) are in it as their text, as llama-server renders a format's
    preserved tokens (they rendered as nothing, and the client could not tell the reasoning from the answer)."""
    from serve_helpers import start_server, stop_server

    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content.split('</think>')[-1] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")  # QwQ's way
    path = write_llama_gguf(tmp_path / "think.gguf", vocab=spm_vocab(control=("<think>", "</think>")),
                            chat_template=template)
    served = start_server(["-m", str(path), "-np", "1", "--temp", "0", "-n", "12"], tmp_path / "server.log")
    try:
        body = {"messages": [{"role": "user", "content": "the cat"}], "reasoning_budget_tokens": 3}
        split = served.post("/v1/chat/completions", body).json()["choices"][0]["message"]
        raw = served.post("/v1/chat/completions", {**body, "reasoning_format": "none"}).json()["choices"][0]["message"]
        assert raw["content"].startswith("<think>\n") and "</think>" in raw["content"], raw
        thought, _, answer = raw["content"].removeprefix("<think>\n").partition("</think>")
        assert (thought.strip(), answer.strip()) == (split["reasoning_content"].strip(), split["content"].strip())
    finally:
        stop_server(served)
