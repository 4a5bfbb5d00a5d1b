"""RequestLimits: how much one request may ask of the server, and the JSON body read within them.

    limits = RequestLimits(max_n=128)              # rollout.serve(..., max_n=...) / rollout serve --max-n
    body = read_json(await http.body(), limits)    # the parsed body, or a 400 naming the rule

Every per-request quantity that holds the engine or the event loop in proportion to what the client wrote is bounded
here, so one request cannot take the server: `n` (rows sampled per prompt; OpenAI caps it at 128), the prompts of one
completions request (rows again), the `stop` strings (each is searched in every streamed chunk), and the nesting of
the JSON body (a body of 5,000 nested arrays would otherwise reach Python's recursion limit in the parser). The token
counts are bounded by the context (completions.service.Limits) and `top_logprobs` by MAX_TOP_LOGPROBS.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ...base.errors import check_int
from .errors import bad_request

FLAGS = {"max_n": "--max-n", "max_prompts": "--max-prompts", "max_stop": "--max-stop",
         "max_json_depth": "--max-json-depth"}


@dataclass(frozen=True)
class RequestLimits:
    """max_n: the largest `n`. max_prompts: the most prompts in one completions request. max_stop: the most `stop`
    strings. max_json_depth: the deepest nesting of arrays and objects in a request body (the body itself is 1)."""

    max_n: int = 128
    max_prompts: int = 2048
    max_stop: int = 64
    max_json_depth: int = 64

    def __post_init__(self) -> None:
        for name in FLAGS:
            check_int(name, getattr(self, name), 1, f"pass a positive limit, e.g. {name}="
                      f"{getattr(RequestLimits, name)}")

    def refuse(self, field: str, value: int, name: str, what: str) -> None:
        """A 400 when `value` (of request field `field`) is above the limit `name`."""
        limit = getattr(self, name)
        if value > limit:
            raise bad_request(field, f"{field}={value} is more than this server allows: at most {limit} {what} per "
                              f"request ({name}). Fix: send at most {limit} (split the request), or start the server "
                              f"with a higher limit ({FLAGS[name]} N, or rollout.serve(..., {name}=N))")


def read_json(raw: bytes, limits: RequestLimits) -> Any:
    """The body parsed as JSON, or a 400: malformed, or nested deeper than `limits.max_json_depth`."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise bad_request(None, f"We could not parse the JSON body of your request ({error}). Fix: send a JSON "
                          "object with Content-Type: application/json") from None
    except RecursionError:  # deeper than the parser's own recursion limit: deeper than any limit allowed here
        body = None
        depth = limits.max_json_depth + 1
    else:
        depth = json_depth(body, limits.max_json_depth + 1)
    if depth > limits.max_json_depth:
        raise bad_request(None, f"the JSON body nests arrays/objects more than {limits.max_json_depth} levels deep "
                          "(max_json_depth). Fix: send a flatter body, or start the server with a higher limit "
                          f"(--max-json-depth N, or rollout.serve(..., max_json_depth=N))")
    return body


def json_depth(value: Any, stop: int) -> int:
    """The nesting depth of arrays/objects in `value` (a scalar is 0), counted level by level (no recursion), at
    most `stop`."""
    depth, level = 0, [value]
    while depth < stop:
        containers = [item for item in level if isinstance(item, (list, dict))]
        if not containers:
            return depth
        depth += 1
        level = [child for c in containers for child in (c.values() if isinstance(c, dict) else c)]
    return depth
