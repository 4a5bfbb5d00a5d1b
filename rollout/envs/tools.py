"""ToolEnvironment: a chat-level Environment that runs the Python tools a model calls, one episode at a time.

    env = ToolEnvironment(tokenizer, tools=[add, search], max_calls=4, messages=prompt_messages)
    turn = await env.step(completion_ids)        # the engine awaits it; by hand: asyncio.run(env.step(ids))

Each model turn is parsed with the tokenizer's own `parse_response` (its `response_template`). No tool call: the
episode is done, with `reward_fn(messages)` as its reward. Otherwise every call runs (`async def` tools awaited on the
caller's loop, plain ones in a daemon thread, so neither blocks other episodes), the results are appended as tool
messages, and the observation is the chat template's rendering of them plus the next assistant header: the
conversation rendered before and after appending them, differenced. The model's own tokens are never re-tokenized:
the engine keeps them as generated, and only the tool messages become new tokens. When the template rewrites history
(the later rendering changes tokens before the tool messages, as templates that drop earlier reasoning do), the step
answers the whole new rendering as `Turn(context_ids=...)`: the next turn is generated from exactly what the model
would see at serving time, and starts a new segment (a new row) of the episode.

A malformed call (the parser rejects the turn, an unknown tool, arguments that are not a JSON object or do not fit
the signature, a tool that raises or exceeds `timeout`) becomes a tool message `{"error": "..."}` the model sees,
never an exception. `max_calls` bounds the tool calls per episode: a turn whose calls would pass it ends the
episode (done) without running them. Nothing is held between steps but the conversation, so there is no `close`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from ..base.env import Turn
from ..base.errors import check_int, invalid

Message = dict[str, Any]


class ToolEnvironment:
    """One episode of tool use. Build one per episode (in `make_env`): it keeps the conversation.

    tokenizer: a transformers tokenizer with a tool-aware `chat_template` and a `response_template`.
    tools: Python functions (sync or `async def`) with type hints and an `Args:` docstring (their JSON schema is
        what the chat template shows the model and what `parse_response` types the arguments with).
    max_calls: tool calls allowed per episode.
    messages: the prompt's chat messages (what the first turn was generated from): the parser needs the rendered
        prompt when the template pre-writes part of the assistant message, and `reward_fn` sees the whole chat.
    reward_fn: `reward_fn(messages) -> float` (may be async), called once when the episode is done; 0.0 if None.
        It raising is the episode's error, unlike a tool raising.
    timeout: seconds one tool call may take before it becomes an error message; None waits forever.
    chat_template_kwargs: extra variables for the chat template (e.g. `enable_thinking`).
    """

    def __init__(self, tokenizer, tools: Sequence[Callable], max_calls: int = 8, messages: Sequence[Message] = (),
                 reward_fn: Callable[[list[Message]], float | Awaitable[float]] | None = None,
                 timeout: float | None = None, chat_template_kwargs: dict | None = None) -> None:
        check_int("max_calls", max_calls, 1, "allow at least one tool call per episode")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not math.isfinite(timeout) or timeout <= 0):
            raise invalid("timeout", timeout, "must be a positive number of seconds or None", "pass e.g. 10.0")
        if reward_fn is not None and not callable(reward_fn):
            raise invalid("reward_fn", reward_fn, "must be callable", "pass a function of the messages")
        _check_tokenizer(tokenizer)
        self.tokenizer = tokenizer
        self.tools = {_tool_name(fn): fn for fn in tools}
        if len(self.tools) != len(tools):
            raise invalid("tools", [_tool_name(fn) for fn in tools], "names must be unique", "rename one")
        self.schemas = [_schema(fn) for fn in tools]
        self.max_calls = max_calls
        self.messages: list[Message] = [dict(m) for m in messages]
        self.reward_fn = reward_fn
        self.timeout = timeout
        self.num_calls = 0
        self._template_kwargs = dict(chat_template_kwargs or {})
        self._context = self._render(self.messages, add_generation_prompt=True) if self.messages else []

    async def step(self, completion_ids: list[int]) -> Turn:
        ids = list(completion_ids)
        message, calls = self._parse(ids)
        self.messages.append(message)
        if not calls or self.num_calls + len(calls) > self.max_calls:
            return Turn(reward=await self._reward(), done=True)
        self.num_calls += len(calls)
        results = await asyncio.gather(*(self._call(call) for call in calls))
        observation, context = self._observe(results, ids[-1] if ids else None)
        return Turn(observation_ids=observation) if context is None else Turn(context_ids=context)

    def _parse(self, ids: list[int]) -> tuple[Message, list]:
        """The model's turn as an assistant message and its calls. A turn the parser rejects, or with a call not
        shaped {"name": str, "arguments": object}, is one bad call and a plain-text message (so it renders)."""
        try:
            message = self.tokenizer.parse_response(ids, prefix=self._context, tools=self.schemas)
        except ValueError as error:
            return self._unparsed(ids, f"the tool call could not be parsed: {error}")
        calls = list(message.get("tool_calls") or [])
        misshapen = [call for call in calls if not _well_formed(call)]
        if misshapen:
            shape = '{"name": ..., "arguments": {...}}'
            return self._unparsed(ids, f"a tool call must be {shape}, got {misshapen[0]!r}")
        return message, calls

    def _unparsed(self, ids: list[int], error: str) -> tuple[Message, list]:
        return {"role": "assistant", "content": self.tokenizer.decode(ids, skip_special_tokens=True)}, [_BadCall(error)]

    async def _call(self, call) -> Message:
        """Run one parsed call; anything wrong with it becomes the tool message's error."""
        name = None if isinstance(call, _BadCall) else call["function"]["name"]
        try:
            fn, arguments = self._resolve(call, name)
            result = await asyncio.wait_for(_invoke(fn, arguments), self.timeout)
            content = result if isinstance(result, str) else json.dumps(result, default=str)
        except asyncio.TimeoutError as error:
            late = self.timeout is not None
            content = _error(f"tool {name!r} took longer than timeout={self.timeout} s" if late else repr(error))
        except Exception as error:  # the model sees it: a tool's failure is an observation, not a crash
            content = _error(str(error) if isinstance(error, _BadCall) else f"{type(error).__name__}: {error}")
        return {"role": "tool", "name": name or "", "content": content}

    def _resolve(self, call, name: str | None) -> tuple[Callable, dict]:
        if isinstance(call, _BadCall):
            raise call
        if name not in self.tools:
            raise _BadCall(f"unknown tool {name!r}; the tools are {sorted(self.tools)}")
        arguments = call["function"].get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as error:
                raise _BadCall(f"arguments of {name!r} are not valid JSON: {error}") from None
        arguments = {} if arguments is None else arguments
        if not isinstance(arguments, dict):
            raise _BadCall(f"arguments of {name!r} must be a JSON object, got {type(arguments).__name__}")
        try:
            inspect.signature(self.tools[name]).bind(**arguments)
        except TypeError as error:
            raise _BadCall(f"bad arguments for {name!r}: {error}") from None
        return self.tools[name], arguments

    def _observe(self, tool_messages: list[Message], stop: int | None) -> tuple[list[int], list[int] | None]:
        """(observation, None): the tokens after the model's turn, i.e. the chat rendered with the tool messages and
        the next assistant header, minus the chat rendered up to the end of the model's turn. ([], context): when
        that rendering changed the tokens before the cut (a template that rewrites history, e.g. one dropping
        earlier reasoning), the whole new rendering, which the next turn is generated from."""
        before = self._render(self.messages, add_generation_prompt=False)
        self.messages.extend(tool_messages)
        after = self._render(self.messages, add_generation_prompt=True)
        cut = _end_of_turn(before, len(self._context), stop, set(self.tokenizer.added_tokens_decoder))
        self._context = after
        if after[:cut] != before[:cut]:
            return [], after
        return after[cut:], None

    def _render(self, messages: list[Message], add_generation_prompt: bool) -> list[int]:
        # sanitize_control_tokens: a tool result that contains e.g. "<|end|>" is text, it cannot close the turn
        return list(self.tokenizer.apply_chat_template(
            messages, tools=self.schemas or None, add_generation_prompt=add_generation_prompt, tokenize=True,
            return_dict=False, sanitize_control_tokens=True, **self._template_kwargs))

    async def _reward(self) -> float:
        if self.reward_fn is None:
            return 0.0
        reward = self.reward_fn(self.messages)
        return await reward if inspect.isawaitable(reward) else reward


class _BadCall(Exception):
    """A call the model got wrong: its message is shown to the model as is."""


async def _invoke(fn: Callable, arguments: dict) -> Any:
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
        return await fn(**arguments)
    result = await _in_daemon_thread(fn, arguments)
    return await result if inspect.isawaitable(result) else result


def _in_daemon_thread(fn: Callable, arguments: dict) -> asyncio.Future:
    """Run a sync tool off the event loop. A daemon thread, not an executor: a tool abandoned by `timeout` may run
    on, but it holds no pool worker and never blocks the interpreter's exit."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if future.done():  # wait_for cancelled it on timeout
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def run() -> None:
        try:
            outcome = (True, fn(**arguments))
        except BaseException as error:
            outcome = (False, error)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop closed while the tool ran (it was abandoned)
            pass

    threading.Thread(target=run, name=f"tool-{_tool_name(fn)}", daemon=True).start()
    return future


def _end_of_turn(before: list[int], start: int, stop: int | None, atomic_ids: set[int]) -> int:
    """Where the model's turn ends in the rendering `before`: just after the last occurrence of its stop token
    (the end-of-turn, or a `</tool_call>` it stopped on) past the rendered prompt, when that token is an added token
    (always tokenized alone, so it can be found); else at the end of the rendered assistant message."""
    if stop in atomic_ids:
        for i in range(len(before) - 1, start - 1, -1):
            if before[i] == stop:
                return i + 1
    return len(before)


def _check_tokenizer(tokenizer) -> None:
    template = getattr(tokenizer, "response_template", None)
    if template is None or not callable(getattr(tokenizer, "parse_response", None)):
        raise invalid("tokenizer.response_template", template,
                      "ToolEnvironment parses tool calls with tokenizer.parse_response (transformers >= 5.13)",
                      "set one, e.g. trl.chat_template_utils.add_response_schema(tokenizer)")
    if not getattr(tokenizer, "chat_template", None):
        raise invalid("tokenizer.chat_template", None, "tool results are rendered with the chat template",
                      "use a chat model's tokenizer or set a template that renders tool messages")


def _schema(fn: Callable) -> dict:
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as error:
        raise invalid("tools", _tool_name(fn), f"has no JSON schema ({error})",
                      "give it type hints and a docstring with an Args: section, as transformers requires") from None


def _tool_name(fn: Callable) -> str:
    if not callable(fn):
        raise invalid("tools", fn, "must be callables", "pass Python functions")
    return getattr(fn, "__name__", type(fn).__name__)


def _well_formed(call) -> bool:
    function = call.get("function") if isinstance(call, dict) else None
    return isinstance(function, dict) and isinstance(function.get("name"), str) and \
        isinstance(function.get("arguments", {}), (dict, str, type(None)))


def _error(text: str) -> str:
    return json.dumps({"error": text})
