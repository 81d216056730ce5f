"""One request's fields, checked: OpenAI's shapes (and llama-server's extras) into a `GenRequest`.

Everything a client sends is checked here, field by field, and refused in
OpenAI's error shape `{"error": {"message", "type", "param", "code"}}`
(`ApiError`): a field this server cannot honour is a clear 400, never
silently ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Mapping

from app.chat_template import ChatMessage, ToolCall
from app.serve.fields import ApiError, bad, flag, integer, number
from app.serve.thinking import ThinkingRequest, thinking_request
from app.serve.tools import Tool, ToolChoice, ToolError, parse_tool_choice, parse_tools
from app.settings import Settings, with_paths
from backends.config import StrategyOptions
from backends.registry import NEEDS_DRAFT, STRATEGIES, n_seq_needed
from backends.sampling import GenParams
from backends.settings_schema import Knob, json_value, knobs, strategy_flags

MAX_BODY_BYTES = 1 << 20  # 1 MiB: a long conversation fits many times over
MAX_QUEUED = 64  # requests waiting for the engine; more are refused with 503
N_SEQ_MAX = 64  # sequence ids of the engine's contexts: every strategy's settings fit (kv_unified: no extra memory)
MEMORY_KEY = "suffix_cache"  # a request's own switch for the speculation memory (speculation())

Endpoint = Literal["chat", "text"]


# -- request fields -----------------------------------------------------------


def _stop(body: Mapping[str, Any], default: tuple[str, ...]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return default
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
        raise bad("'stop' must be a non-empty string or a list of them", "stop")
    return tuple(values)


def _max_tokens(body: Mapping[str, Any], default: int, n_ctx: int) -> int:
    """max_completion_tokens (OpenAI's current name), max_tokens, or llama-server's n_predict; at most the context."""
    given = {name: integer(body, name, None) for name in ("max_completion_tokens", "max_tokens", "n_predict")}
    given = {k: v for k, v in given.items() if v is not None and not (k == "n_predict" and v == -1)}
    if len(set(given.values())) > 1:
        raise bad(f"{' and '.join(given)} disagree; send one of them", next(iter(given)))
    name, value = next(iter(given.items()), ("max_tokens", min(default, n_ctx)))  # serve -n over -c: the context
    if value < 1:
        raise bad(f"'{name}' must be at least 1", name)
    if value > n_ctx:
        raise bad(f"'{name}' is {value} but the context holds {n_ctx} tokens", name)
    return value


def sampling_params(body: Mapping[str, Any], defaults: GenParams, n_ctx: int) -> GenParams:
    """OpenAI's sampling fields (and llama-server's top_k / min_p) over the server's defaults."""
    seed = integer(body, "seed", defaults.seed)
    if seed is not None and seed < 0:
        if seed != -1:
            raise bad("'seed' must be >= 0, or -1 for a random one", "seed")
        seed = None
    try:
        return GenParams(
            max_tokens=_max_tokens(body, defaults.max_tokens, n_ctx),
            temperature=number(body, "temperature", defaults.temperature),
            top_k=integer(body, "top_k", defaults.top_k),  # type: ignore[arg-type]
            top_p=number(body, "top_p", defaults.top_p),
            min_p=number(body, "min_p", defaults.min_p),
            seed=seed,
            stop=_stop(body, defaults.stop),
            ignore_eos=flag(body, "ignore_eos", defaults.ignore_eos),
        )
    except ValueError as e:
        raise bad(str(e)) from None


def _refuse(name: str, why: str) -> ApiError:
    return bad(f"'{name}' is not supported: {why}", name, "unsupported_parameter")


def refuse_unsupported(body: Mapping[str, Any], endpoint: Endpoint) -> None:
    """Fields whose meaning this server cannot honour: a clear 400 rather than an answer that ignores them."""
    if body.get("best_of") not in (None, 1):
        raise _refuse("best_of", "one completion per request")
    for name in ("functions", "function_call"):
        if body.get(name):
            raise _refuse(name, "OpenAI's deprecated functions API; send 'tools' and 'tool_choice'")
    if endpoint == "text" and (body.get("tools") or body.get("tool_choice") not in (None, "none")):
        raise bad("tools belong to /v1/chat/completions", "tools")
    if endpoint == "text" and body.get("response_format") not in (None, {"type": "text"}):
        raise _refuse("response_format", "it belongs to /v1/chat/completions; a completion takes llama-server's "
                                         "'json_schema' or 'grammar'")
    for name in ("frequency_penalty", "presence_penalty", "repeat_penalty"):
        default = 1.0 if name == "repeat_penalty" else 0.0
        if number(body, name, default) != default:
            raise _refuse(name, "repetition penalties are not implemented (speculative verification "
                                "needs the same distribution at every position)")
    if body.get("logit_bias"):
        raise _refuse("logit_bias", "logit biases are not implemented")
    if body.get("echo"):
        raise _refuse("echo", "the prompt is not echoed")
    if body.get("suffix"):
        raise _refuse("suffix", "no fill-in-the-middle")
    modalities = body.get("modalities")
    if modalities not in (None, ["text"]) or body.get("audio") or body.get("prediction"):
        raise _refuse("modalities" if modalities not in (None, ["text"]) else
                      "audio" if body.get("audio") else "prediction", "text only, no predicted outputs")
    if endpoint == "text" and "messages" in body:
        raise bad("'messages' belongs to /v1/chat/completions; /v1/completions takes 'prompt'", "messages")
    if endpoint == "chat" and "prompt" in body:
        raise bad("'prompt' belongs to /v1/completions; /v1/chat/completions takes 'messages'", "prompt")


# -- structured output and log-probabilities ---------------------------------------


@dataclass(frozen=True)
class GrammarRequest:
    """What a request's output must follow, before it is compiled (backends.grammar): the kind, the source,
    and the request field it came from (named in a 400 when it does not compile)."""

    kind: str
    source: object
    param: str


def grammar_request(body: Mapping[str, Any]) -> GrammarRequest | None:
    """OpenAI's `response_format` (json_object, json_schema) or llama-server's `grammar` (GBNF) and
    `json_schema`; one of them at most."""
    given = [name for name in ("response_format", "grammar", "json_schema") if body.get(name) is not None]
    rf = body.get("response_format")
    if rf is not None and (not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema")):
        raise bad("'response_format' must be {'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', "
                  "'json_schema': {'name': ..., 'schema': {...}}}", "response_format")
    if isinstance(rf, dict) and rf.get("type") == "text":
        given.remove("response_format")
    if len(given) > 1:
        raise bad(f"{' and '.join(repr(g) for g in given)} both constrain the output; send one", given[1])
    if not given:
        return None
    if given[0] == "grammar":
        if not isinstance(body["grammar"], str) or not body["grammar"].strip():
            raise bad("'grammar' must be a GBNF grammar (a string)", "grammar")
        return GrammarRequest("gbnf", body["grammar"], "grammar")
    if given[0] == "json_schema":
        if not isinstance(body["json_schema"], dict):
            raise bad("'json_schema' must be a JSON schema object", "json_schema")
        return GrammarRequest("json_schema", body["json_schema"], "json_schema")
    assert isinstance(rf, dict)
    if rf["type"] == "json_object":
        return GrammarRequest("json_object", "", "response_format")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise bad("'response_format.json_schema' must be {'name': ..., 'schema': {...}, 'strict': ...}",
                  "response_format.json_schema")
    if "name" in spec and not isinstance(spec["name"], str):
        raise bad("'response_format.json_schema.name' must be a string", "response_format.json_schema.name")
    return GrammarRequest("json_schema", spec.get("schema", {}), "response_format.json_schema.schema")


def logprobs_count(body: Mapping[str, Any], endpoint: Endpoint) -> int | None:
    """How many likeliest tokens to list at each place (0: only the chosen one's), or None: no log-probabilities.
    Chat: `logprobs` true and `top_logprobs` 0-20; completions: `logprobs` 0-5 (OpenAI's legacy field)."""
    value = body.get("logprobs")
    if endpoint == "chat":
        top = integer(body, "top_logprobs", None)
        if value not in (None, True, False):
            raise bad("'logprobs' must be true or false", "logprobs")
        if top is not None and not 0 <= top <= 20:
            raise bad("'top_logprobs' must be between 0 and 20", "top_logprobs")
        if top and not value:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (top or 0) if value else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 5:
        raise bad("'logprobs' must be an integer between 0 and 5", "logprobs")
    return value


# -- per-request speculation ------------------------------------------------

def _speculative_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """The `speculative` object merged with llama-server's flat `speculative.X` keys."""
    nested = body.get("speculative") or {}
    if not isinstance(nested, dict):
        raise bad("'speculative' must be an object", "speculative")
    flat = {key.split(".", 1)[1]: value for key, value in body.items() if key.startswith("speculative.")}
    for key in flat.keys() & nested.keys():
        if flat[key] != nested[key]:
            raise bad(f"'speculative.{key}' is given twice with different values", f"speculative.{key}")
    return {**flat, **nested}


def _typed(knob: Knob, value: Any, name: str) -> Any:
    """`value` checked against the field's declared kind (JSON gives no more)."""
    try:
        return json_value(knob, value)
    except ValueError as e:
        raise bad(f"'speculative.{name}' must be of type {e}", f"speculative.{name}") from None


def speculative_keys(options: StrategyOptions) -> tuple[dict[str, tuple[Knob, ...]], dict[str, dict[str, Knob]]]:
    """What a `speculative` object may set besides `strategy` and MEMORY_KEY: llama-server's names for the
    fan-out flags (n_max: --draft-max, p_min: --draft-p-min) with the fields each sets, and each strategy's
    section fields by name."""
    shared = {flag.request_key: ks for flag, ks in strategy_flags(options) if flag.request_key is not None}
    sections: dict[str, dict[str, Knob]] = {}
    for knob in knobs(options):
        sections.setdefault(knob.section, {})[knob.name] = knob
    return shared, sections


def speculation(body: Mapping[str, Any], defaults: Settings, has_draft: bool,
                n_seq_max: int = N_SEQ_MAX) -> tuple[str, StrategyOptions]:
    """The strategy and its settings for one request, over the server's defaults (the CLI flags)."""
    spec = _speculative_fields(body)
    strategy = spec.pop("strategy", None)
    # The request's own switch for the speculation memory (neither consulted nor updated); its key keeps the
    # name clients have sent since the memory came (`memory` is auto's own switch, in auto's section).
    remember = spec.pop(MEMORY_KEY, True)
    if not isinstance(remember, bool):
        raise bad(f"'speculative.{MEMORY_KEY}' must be true or false", f"speculative.{MEMORY_KEY}")
    shared, sections = speculative_keys(defaults.options)
    given = {key: value for key in shared if (value := spec.pop(key, None)) is not None}
    n_max = given.get("n_max")
    n_min = spec.pop("n_min", None)  # llama-server's, checked only: no setting of specchat's matches it
    if n_max is not None and (isinstance(n_max, bool) or not isinstance(n_max, int) or n_max < 0):
        raise bad("'speculative.n_max' must be an integer >= 0", "speculative.n_max")
    if strategy is None:
        strategy = "ar" if n_max == 0 else defaults.strategy
    if strategy not in STRATEGIES:
        raise bad(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}", "speculative.strategy")
    if n_max == 0 and strategy != "ar":
        raise bad(f"'speculative.n_max' 0 means plain decoding, which contradicts strategy {strategy!r}",
                   "speculative.n_max")
    if strategy in NEEDS_DRAFT and not has_draft:
        raise bad(f"strategy {strategy!r} needs a draft model; the server was started without -md",
                   "speculative.strategy")
    _check_n_min(n_min, n_max)
    options = defaults.options
    changes: dict[str, Any] = {}
    for key, value in given.items():  # as the flag does: n_max as --draft-max, p_min as --draft-p-min
        if key != "n_max" or value:  # n_max 0: plain decoding, chosen above
            typed = _typed(shared[key][0], value, key)
            changes.update({knob.path: typed for knob in shared[key]})
    if spec:
        section = sections.get(strategy, {})
        unknown = sorted(set(spec) - set(section))
        if unknown:
            allowed = ", ".join(["strategy", MEMORY_KEY, *sorted([*shared, "n_min"]), *sorted(section)])
            raise bad(f"unknown setting {unknown[0]!r} for strategy {strategy!r}; allowed: {allowed}",
                       f"speculative.{unknown[0]}")
        changes.update({section[name].path: _typed(section[name], value, name) for name, value in spec.items()})
    if not remember:  # this request neither consults nor updates the speculation memory
        changes["memory"] = False
    try:
        options = with_paths(options, changes)  # dataclasses.replace: each config's __post_init__ checks it
    except ValueError as e:
        raise bad(str(e), "speculative") from None
    if n_seq_needed(strategy, options) > n_seq_max:
        raise bad(f"these {strategy} settings need {n_seq_needed(strategy, options)} sequences; "
                   f"the server has {n_seq_max}", "speculative")
    return strategy, options


def _check_n_min(n_min: Any, n_max: int | None) -> None:
    """llama-server drops drafts shorter than n_min (clamped to n_max); specchat never drops one."""
    if n_min is None:
        return
    if isinstance(n_min, bool) or not isinstance(n_min, int) or n_min < 0:
        raise bad("'speculative.n_min' must be an integer >= 0", "speculative.n_min")
    if min(n_min, n_max if n_max is not None else n_min) > 1:
        raise bad("'speculative.n_min' above 1 is not supported: llama-server discards drafts shorter than "
                   "n_min, specchat verifies every draft (its length follows p_min and the adaptive K); "
                   "send 0 or 1", "speculative.n_min", "unsupported_parameter")


# -- prompts --------------------------------------------------------------------

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def _content(message: Mapping[str, Any], i: int) -> str:
    """A message's text: a string, or OpenAI's list of content parts of type text."""
    content = message.get("content")
    if content is None and message.get("role") == "assistant":
        return ""  # an assistant message with only tool calls
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def chat_messages(body: Mapping[str, Any]) -> tuple[ChatMessage, ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", f"messages[{i}]")
        role = _ROLES.get(m["role"]) if isinstance(m.get("role"), str) else None
        if role is None:
            raise bad(f"messages[{i}].role {m.get('role')!r} is not supported (system, developer, user, assistant, "
                      f"tool)", f"messages[{i}].role")
        calls = _tool_calls(m, i) if role == "assistant" else ()
        call_id = m.get("tool_call_id")
        if role == "tool" and not isinstance(call_id, str):
            raise bad(f"messages[{i}]: a tool message needs its 'tool_call_id'", f"messages[{i}].tool_call_id")
        name = m.get("name") if isinstance(m.get("name"), str) else None
        if role == "tool" and name is None:  # the call it answers names the function
            name = next((c.name for earlier in out for c in earlier.tool_calls if c.id == call_id), None)
        reasoning = m.get("reasoning_content")  # an earlier answer's thinking, sent back (llama-server's name)
        if reasoning is not None and not isinstance(reasoning, str):
            raise bad(f"messages[{i}].reasoning_content must be a string", f"messages[{i}].reasoning_content")
        out.append(ChatMessage(role, _content(m, i), calls, call_id if role == "tool" else None,  # type: ignore[arg-type]
                               name if role == "tool" else None, reasoning or ""))
    return tuple(out)


def _tool_calls(message: Mapping[str, Any], i: int) -> tuple[ToolCall, ...]:
    """An assistant message's `tool_calls`, as OpenAI sends them back in the conversation."""
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise bad(f"messages[{i}].tool_calls must be a list", f"messages[{i}].tool_calls")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                not isinstance(fn.get("arguments", "{}"), (str, dict)):
            raise bad(f"messages[{i}].tool_calls[{j}] must be {{'id', 'type': 'function', 'function': "
                      f"{{'name', 'arguments'}}}}", f"messages[{i}].tool_calls[{j}]")
        arguments = fn.get("arguments", "{}")
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        out.append(ToolCall(str(c.get("id") or f"call_{i}_{j}"), fn["name"], text))
    return tuple(out)


def completion_prompt(body: Mapping[str, Any]) -> str | tuple[int, ...]:
    """A completion's prompt: a string, a list of one string, or token ids (as llama-server takes them)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return tuple(prompt)
    raise bad("'prompt' must be a string, or a list of token ids (one prompt per request)", "prompt")


# -- one request, parsed ----------------------------------------------------


@dataclass(frozen=True)
class GenRequest:
    """One generation, as the worker runs it."""

    endpoint: Endpoint
    strategy: str
    options: StrategyOptions
    params: GenParams
    messages: tuple[ChatMessage, ...] = ()
    prompt: str | tuple[int, ...] = ""
    stream: bool = False
    include_usage: bool = False
    n: int = 1  # choices: sequences of the same batch, sharing the prompt's cells
    grammar: GrammarRequest | None = None  # compiled into params.grammar before the worker sees it
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice()
    parallel_tool_calls: bool = False  # asked for explicitly: several calls in one answer
    # A chat's thinking fields (app.serve.thinking): the template's variables, the split, the budget.
    thinking: ThinkingRequest = field(default_factory=ThinkingRequest)

    @property
    def calls_tools(self) -> bool:
        return bool(self.tool_choice.offered(self.tools))

    @property
    def must_call(self) -> bool:
        return self.calls_tools and self.tool_choice.must_call


def _choices(body: Mapping[str, Any], parallel: int) -> int:
    n = integer(body, "n", 1)
    assert n is not None
    if n < 1:
        raise bad("'n' must be at least 1", "n")
    if n > parallel:
        raise bad(f"'n' is {n} but the server decodes {parallel} sequences at once (--parallel); "
                  f"ask for at most {parallel} choices", "n")
    return n


def parse_request(body: Mapping[str, Any], endpoint: Endpoint, defaults: Settings, n_ctx: int,
                  has_draft: bool, n_seq_max: int = N_SEQ_MAX, parallel: int = 1) -> GenRequest:
    refuse_unsupported(body, endpoint)
    n = _choices(body, parallel)
    stream = flag(body, "stream", False)  # null: not given (OpenAI's "boolean or null")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    strategy, options = speculation(body, defaults, has_draft, n_seq_max)
    try:
        tools = parse_tools(body)
        tool_choice = parse_tool_choice(body, tools)
    except ToolError as e:
        raise bad(str(e), e.param) from None
    grammar = grammar_request(body)
    if grammar is not None and tool_choice.offered(tools):
        raise bad(f"'{grammar.param.split('.')[0]}' and 'tools' both shape the answer; this server takes one of "
                  f"them per request", grammar.param.split(".")[0])
    params = sampling_params(body, defaults.params, n_ctx)
    logprobs = logprobs_count(body, endpoint)
    if logprobs is not None:
        params = replace(params, logprobs=logprobs)
    return GenRequest(
        endpoint=endpoint, strategy=strategy, options=options, params=params, grammar=grammar,
        tools=tools, tool_choice=tool_choice, parallel_tool_calls=flag(body, "parallel_tool_calls", False),
        messages=chat_messages(body) if endpoint == "chat" else (),
        prompt=completion_prompt(body) if endpoint == "text" else "",
        stream=stream, include_usage=bool(stream_options.get("include_usage")), n=n,
        thinking=thinking_request(body, endpoint == "chat", defaults),
    )
