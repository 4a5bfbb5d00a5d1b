"""The OpenAI request bodies this server takes, parsed and checked before anything is submitted.

`parse(kind, body, headers)` turns the JSON of `POST /v1/chat/completions` (kind "chat") or `POST /v1/completions`
(kind "completion") into a `Request`, or raises an `ApiError` (400) naming the field. Nothing is silently dropped:
an unknown field is refused as OpenAI's API refuses it, and a control the engine cannot honour (`best_of`, `suffix`,
...) is refused unless it holds its neutral value (vLLM's `use_beam_search: false`, which RL frameworks send by
default, is accepted; `true` is refused by name). `model` may be left out (vLLM's is optional, AReaL's
VLLMBackend sends none): the served model. Chat's `response_format`, `tool_choice` and `parallel_tool_calls`
are constrained decoding (formats.py).

Sampling (`SamplingParams`' meaning): `presence_penalty`, `frequency_penalty`, `logit_bias` (OpenAI's), vLLM's
`repetition_penalty`, `min_p` and `min_tokens` (stop ids and stop strings held back until that many tokens), a
`seed` anywhere in int64 (negative too). Text: `skip_special_tokens` (default true), `include_stop_str_in_output`
(default false: the text ends before the stop string). Chat rendering (passed to the chat template as vLLM does):
`add_generation_prompt` (default true), `continue_final_message` (default false: the last assistant message is
continued, not closed), `reasoning_effort` and `chat_template_kwargs` (e.g. `enable_thinking`), each refused by name
when the model's template never reads it. `stream_options.include_obfuscation`: false, or left out (this server's
chunks carry no obfuscation padding).

Extensions (vLLM's names where vLLM has one): `prompt_token_ids` (token ids instead of messages or a prompt),
`top_k` (0 or -1: disabled), `stop_token_ids`, `ignore_eos`, `return_token_ids` (false drops the token-id fields of
the response),
`return_tokens_as_token_ids` (logprobs name each token, alternatives included, "token_id:<id>" instead of its text,
which may be ambiguous: two byte tokens both decode to "\ufffd"), `prompt_logprobs` (k: every prompt token's logprob
and its k most likely alternatives, teacher-forced: prompts.py) and `episode_id` (or the `X-Episode-Id` header:
record the call under that episode). Completions also take `echo` (the prompt returned before the completion, with
its logprobs when `logprobs` is set), and `max_tokens: 0` when only the prompt is scored (`echo` or
`prompt_logprobs`). `n`, the number of prompts and of `stop` strings are bounded by the server's RequestLimits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ...base.params import MAX_TOP_LOGPROBS, TOP_K_OFF
from ..transport.errors import bad_request
from ..transport.limits import RequestLimits
from .formats import Format

# Controls other servers take that this one cannot apply per request: accepted only at these values.
NEUTRAL = {"best_of": (1,), "use_beam_search": (False,), "echo": (False,), "suffix": ("",),
           "parallel_tool_calls": (True,), "store": (False,),
           "response_format": ({"type": "text"},)}
# the request's sampling adjustments, by SamplingParams' name (min_tokens is SamplingParams.min_new_tokens)
ADJUSTMENTS = {"presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
               "repetition_penalty": "repetition_penalty", "min_p": "min_p", "min_tokens": "min_new_tokens",
               "logit_bias": "logit_bias"}
TEXT = {"skip_special_tokens", "include_stop_str_in_output"}
TEMPLATE = {"add_generation_prompt", "continue_final_message", "reasoning_effort", "chat_template_kwargs"}
# chat_template_kwargs the server sets itself when it renders (tools come from the request's own field)
RENDERING = {"tokenize", "return_dict", "return_tensors", "conversation", "tools", "documents", "chat_template",
             "return_assistant_tokens_mask", "tokenizer_kwargs", "padding", "truncation", "max_length"}
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
SEED_BOUNDS = (-2**63, 2**63 - 1)  # OpenAI's seed is an int64
# Fields that change nothing about the tokens: accepted and, as OpenAI's API does with them, not acted upon.
INERT = ("user", "metadata", "service_tier")
COMMON = {"model", "n", "temperature", "top_p", "max_tokens", "stop", "seed", "stream", "stream_options", "logprobs",
          "prompt_token_ids", "top_k", "stop_token_ids", "ignore_eos", "return_token_ids", "return_tokens_as_token_ids",
          "episode_id", "prompt_logprobs",
          *NEUTRAL, *INERT, *ADJUSTMENTS, *TEXT}
FIELDS = {"chat": COMMON | TEMPLATE | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice"},
          "completion": COMMON | {"prompt"}}
# NEUTRAL fields a kind does honour (chat's: formats.py)
ACTED_ON = {"completion": {"echo"}, "chat": {"response_format", "parallel_tool_calls"}}
EPISODE_HEADER = "x-episode-id"


@dataclass(frozen=True)
class Request:
    """One parsed request. `prompts`: one entry per prompt, text or token ids (a chat request from messages has
    none: `messages` is rendered later). `max_tokens` None: whatever the context leaves."""

    kind: str
    model: str | None  # None: left out (vLLM's and AReaL's completions omit it): the served model
    messages: list[dict] | None
    prompts: list[Any] | None
    n: int
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int | None
    max_tokens_param: str  # the field it came from (errors name it)
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...] | None
    ignore_eos: bool
    seed: int | None
    logprobs: bool
    top_logprobs: int  # alternatives per token (chat: top_logprobs; completions: the integer logprobs); 0: none
    stream: bool
    include_usage: bool
    tools: list[dict] | None
    tool_choice: str  # "auto", "none", "required" or "function" (a named one: `format.tool_name`)
    episode_id: str | None
    return_token_ids: bool
    tokens_as_ids: bool  # return_tokens_as_token_ids
    echo: bool = False  # completions: the prompt comes back before the completion (and its logprobs, if asked)
    prompt_logprobs: int | None = None  # alternatives per prompt token (vLLM's prompt_logprobs); None: not asked
    adjustments: dict[str, Any] = field(default_factory=dict)  # SamplingParams keywords: penalties, min_p, ...
    skip_special_tokens: bool = True
    include_stop: bool = False  # include_stop_str_in_output
    template: dict[str, Any] = field(default_factory=dict)  # chat: keywords for the chat template (add_generation_
    # prompt, continue_final_message, reasoning_effort, chat_template_kwargs); {} renders as it always did
    prompt_param: str = "prompt_token_ids"  # the field the prompt came from (errors about it name it)
    format: Format = Format()  # chat: response_format, tool_choice and parallel_tool_calls (formats.py)

    @property
    def scores_prompt(self) -> bool:
        """The prompt's own logprobs are part of the answer (teacher-forced: prompts.py)."""
        return self.prompt_logprobs is not None or (self.echo and self.logprobs)

    @property
    def parses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def parse(kind: str, body: Any, headers: dict[str, str] | None = None,
          limits: RequestLimits | None = None) -> Request:
    limits = limits or RequestLimits()
    if not isinstance(body, dict):
        raise bad_request(None, "the request body must be a JSON object")
    unknown = sorted(set(body) - FIELDS[kind])
    if unknown:
        raise bad_request(unknown[0], f"Unrecognized request argument supplied: {unknown[0]}")
    for name, neutral in NEUTRAL.items():
        if name in ACTED_ON[kind]:
            continue
        value = body.get(name)
        if name in body and value is not None and not any(value == v and type(value) is type(v) for v in neutral):
            raise bad_request(name, f"{name}={value!r} is not supported: this engine cannot apply it per request. "
                              f"Fix: leave it out (or at {neutral[0]!r}).")
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise bad_request("model", f"model={model!r} is invalid: must be the name GET /v1/models lists (or left out)")
    messages, prompts = _inputs(kind, body)
    stream = flag(body, "stream", False)
    logprobs, top_logprobs = _logprobs(kind, body)
    echo, prompt_logprobs = flag(body, "echo", False), _top(body, "prompt_logprobs")
    n = _int(body, "n", 1, 1)
    limits.refuse("n", n, "max_n", "samples")
    if prompts is not None:
        limits.refuse("prompt", len(prompts), "max_prompts", "prompts")
    if stream and (echo or prompt_logprobs is not None):
        name = "echo" if echo else "prompt_logprobs"
        raise bad_request(name, f"{name} is not supported with stream=true: the prompt's logprobs are scored after "
                          "the completion. Fix: send stream=false")
    stop = _stop(body)
    limits.refuse("stop", len(stop), "max_stop", "stop strings")
    template = _template(body)
    tools = _tools(body)
    fmt = Format.parse(body, tools) if kind == "chat" else Format()
    if template and messages is None:
        name = next(n for n in ("chat_template_kwargs", *sorted(TEMPLATE)) if body.get(n) is not None)
        raise bad_request(name, f"{name} shapes how messages are rendered, and this request sends "
                          "prompt_token_ids. Fix: send messages, or leave it out")
    return Request(
        kind=kind, model=model, messages=messages, prompts=prompts, n=n,
        temperature=_number(body, "temperature", 1.0, 0.0, math.inf),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, open_low=True), top_k=_top_k(body),
        max_tokens=_max_tokens(kind, body, scores_only=echo or prompt_logprobs is not None),
        max_tokens_param="max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens",
        stop=stop, stop_token_ids=_ids(body, "stop_token_ids"),
        ignore_eos=flag(body, "ignore_eos", False), seed=_seed(body), logprobs=logprobs,
        top_logprobs=top_logprobs, stream=stream, include_usage=_include_usage(body, stream), tools=tools,
        tool_choice=fmt.tool_choice, episode_id=_episode_id(body, headers or {}),
        return_token_ids=flag(body, "return_token_ids", True),
        tokens_as_ids=flag(body, "return_tokens_as_token_ids", False), echo=echo, prompt_logprobs=prompt_logprobs,
        adjustments=_adjustments(body), skip_special_tokens=flag(body, "skip_special_tokens", True),
        include_stop=flag(body, "include_stop_str_in_output", False), template=template,
        prompt_param=_prompt_param(kind, body), format=fmt)


def _prompt_param(kind: str, body: dict) -> str:
    if body.get("prompt_token_ids") is not None:
        return "prompt_token_ids"
    return "messages" if kind == "chat" else "prompt"


def messages_of(body: dict) -> list[dict]:
    """The checked `messages` of a body (POST /tokenize's chat form)."""
    return _inputs("chat", {"messages": body.get("messages")})[0]


def _inputs(kind: str, body: dict) -> tuple[list[dict] | None, list[Any] | None]:
    ids = body.get("prompt_token_ids")
    source = "messages" if kind == "chat" else "prompt"
    given = body.get(source)
    if ids is not None:
        if given is not None:
            raise bad_request("prompt_token_ids", f"pass {source} or prompt_token_ids, not both")
        lists = ids if ids and isinstance(ids[0], list) and kind == "completion" else [ids]
        return None, [_token_list(x, "prompt_token_ids") for x in lists]
    if kind == "chat":
        if not isinstance(given, list) or not given or not all(isinstance(m, dict) for m in given):
            raise bad_request("messages", "messages must be a non-empty list of message objects (or pass "
                              "prompt_token_ids)")
        for i, message in enumerate(given):
            if not isinstance(message.get("role"), str):
                raise bad_request(f"messages[{i}].role", f"messages[{i}] has no role")
        return given, None
    return None, _completion_prompts(given)


def _completion_prompts(prompt: Any) -> list[Any]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(_is_int(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) for p in prompt):
            return [_token_list(p, "prompt") for p in prompt]
    raise bad_request("prompt", "prompt must be a string, a list of strings, a list of token ids, or a list of "
                      "token-id lists (non-empty)")


def _token_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not value or not all(_is_int(t) for t in value):
        raise bad_request(name, f"{name} must be a non-empty list of integer token ids")
    return list(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(body: dict, name: str, default: int | None, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value) or value < minimum:
        raise bad_request(name, f"{name}={value!r} is invalid: must be an integer >= {minimum}")
    return value


def _top_k(body: dict) -> int:
    """top_k >= 0, or -1 (vLLM's and SGLang's "disabled", which verl, SkyRL and OpenRLHF send) taken as 0."""
    if body.get("top_k") == TOP_K_OFF and _is_int(body["top_k"]):
        return 0
    value = body.get("top_k")
    if value is not None and (not _is_int(value) or value < 0):
        raise bad_request("top_k", f"top_k={value!r} is invalid: must be an integer >= 0, or -1. Fix: 0 or -1 "
                          "disables top-k, a positive k keeps the k most likely tokens")
    return 0 if value is None else value


def _seed(body: dict) -> int | None:
    seed = _int(body, "seed", None, SEED_BOUNDS[0])
    if seed is not None and seed > SEED_BOUNDS[1]:
        raise bad_request("seed", f"seed={seed} is invalid: must be a 64-bit signed integer")
    return seed


def _adjustments(body: dict) -> dict[str, Any]:
    """The penalties, min_p, min_tokens and logit_bias a body sets, as SamplingParams keywords (their values are
    checked there: an error names the request's field)."""
    out = {ours: body[name] for name, ours in ADJUSTMENTS.items() if body.get(name) is not None}
    bias = out.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict) or not all(isinstance(k, str) and k.isdigit() or _is_int(k) for k in bias):
            raise bad_request("logit_bias", "logit_bias must be an object mapping token ids (as strings, e.g. "
                              "\"50256\") to a bias in [-100, 100]")
        out["logit_bias"] = {int(k): v for k, v in bias.items()}
        if not out["logit_bias"]:
            del out["logit_bias"]
    return out


def _template(body: dict) -> dict[str, Any]:
    """Keywords for the chat template: vLLM's fields, then chat_template_kwargs (which may override them)."""
    template = {name: flag(body, name, False) for name in ("add_generation_prompt", "continue_final_message")
                if body.get(name) is not None}
    if template.get("add_generation_prompt", True) and template.get("continue_final_message"):
        raise bad_request("continue_final_message", "continue_final_message=true continues the last assistant "
                          "message, so no generation prompt can follow it. Fix: also send add_generation_prompt=false")
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad_request("reasoning_effort", f"reasoning_effort={effort!r} is invalid: must be one of "
                              f"{', '.join(REASONING_EFFORTS)}")
        template["reasoning_effort"] = effort
    extra = body.get("chat_template_kwargs")
    if extra is not None:
        if not isinstance(extra, dict):
            raise bad_request("chat_template_kwargs", "chat_template_kwargs must be an object of keyword arguments "
                              "for the chat template, e.g. {\"enable_thinking\": false}")
        reserved = sorted(set(extra) & RENDERING)
        if reserved:
            raise bad_request(f"chat_template_kwargs.{reserved[0]}", f"chat_template_kwargs.{reserved[0]} is set by "
                              "the server when it renders. Fix: leave it out (tools go in the request's tools)")
        template |= extra
    return template


def _number(body: dict, name: str, default: float, low: float, high: float, open_low: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and (value > low if open_low else value >= low) and value <= high
    if not ok:
        bounds = f"{'(' if open_low else '['}{low}, {high}]" if high != math.inf else f">= {low}"
        raise bad_request(name, f"{name}={value!r} is invalid: must be a finite number in {bounds}")
    return float(value)


def flag(body: dict, name: str, default: bool) -> bool:
    """A boolean field: `default` where it is null or left out, a 400 naming it where it is not a boolean."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(name, f"{name}={value!r} is invalid: must be true or false")
    return value


def _max_tokens(kind: str, body: dict, scores_only: bool) -> int | None:
    """0 only when the prompt itself is what is asked for (`scores_only`: echo or prompt_logprobs)."""
    low = 0 if scores_only else 1
    for name in ("max_tokens", "max_completion_tokens"):
        if body.get(name) == 0 and not scores_only:
            raise bad_request(name, f"{name}=0 is invalid: must be an integer >= 1 (0 only scores the prompt). Fix: "
                              f"ask for at least one token, or send echo=true with logprobs (completions) or "
                              "prompt_logprobs")
    legacy = _int(body, "max_tokens", None, low)
    if kind == "completion":
        return 16 if legacy is None else legacy  # OpenAI's (and vLLM's) default for completions
    new = _int(body, "max_completion_tokens", None, low)
    if legacy is not None and new is not None and legacy != new:
        raise bad_request("max_completion_tokens", f"max_tokens={legacy} and max_completion_tokens={new} disagree. "
                          "Fix: pass max_completion_tokens only")
    return new if new is not None else legacy


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("stop", "stop must be a non-empty string or a list of non-empty strings")
    return tuple(stops)


def _ids(body: dict, name: str) -> tuple[int, ...] | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or not all(_is_int(t) and t >= 0 for t in value):
        raise bad_request(name, f"{name} must be a list of non-negative token ids")
    return tuple(value)


def _logprobs(kind: str, body: dict) -> tuple[bool, int]:
    """(whether logprobs are returned, how many alternatives per token)."""
    if kind == "chat":
        wanted = flag(body, "logprobs", False)
        top = _top(body, "top_logprobs")
        if top is not None and not wanted:
            raise bad_request("top_logprobs", "top_logprobs needs logprobs=true")
    else:
        top = _top(body, "logprobs")
        wanted = top is not None
    return wanted, top or 0


def _top(body: dict, name: str) -> int | None:
    """An alternatives count in [0, MAX_TOP_LOGPROBS], or None when absent."""
    top = _int(body, name, None, 0)
    if top is not None and top > MAX_TOP_LOGPROBS:
        raise bad_request(name, f"{name}={top} is more than this server returns: at most {MAX_TOP_LOGPROBS} "
                          f"alternatives per token (OpenAI's limit). Fix: use {name} <= {MAX_TOP_LOGPROBS}")
    return top


def _include_usage(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise bad_request("stream_options", "stream_options is only allowed with stream=true")
    if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
        raise bad_request("stream_options", "stream_options must be {\"include_usage\": true|false, "
                          "\"include_obfuscation\": false}")
    if flag(options, "include_obfuscation", False):
        raise bad_request("stream_options.include_obfuscation", "include_obfuscation=true is not supported: this "
                          "server adds no obfuscation padding to its chunks. Fix: send false or leave it out")
    return flag(options, "include_usage", False)


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools", "tools must be a list of {\"type\": \"function\", \"function\": {...}} objects")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            raise bad_request(f"tools[{i}]", "each tool must be {\"type\": \"function\", \"function\": {\"name\": "
                              "..., \"parameters\": {...}}}")
    return tools or None


def _episode_id(body: dict, headers: dict[str, str]) -> str | None:
    value = body.get("episode_id", headers.get(EPISODE_HEADER))
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise bad_request("episode_id", "episode_id must be a non-empty string")
    return value
