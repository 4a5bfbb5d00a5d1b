"""ApiError: a failed request, as OpenAI's API reports it.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

Every 4xx names the field (`param`) when one is at fault, and says the rule and the fix in `message`, as the rest of
rollout's errors do. Raised anywhere while a request is parsed or run; the app turns it into the response.
"""

from __future__ import annotations

import re

INVALID = "invalid_request_error"
FIELD = re.compile(r"^(?:[^:=]*: )?([A-Za-z_][\w.]*)=")  # "[where: ]field=value is invalid: ..."


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = INVALID) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(param: str | None, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


def from_value_error(error: ValueError, names: dict[str, str] | None = None) -> ApiError:
    """A rollout ValueError ("prompt 0: max_new_tokens=9 is invalid: ... Fix: ...") as a 400 naming the request's
    field: rollout's field names are mapped to the API's (`names`, e.g. max_new_tokens -> max_tokens)."""
    text = str(error)
    match = FIELD.match(text)
    field = match.group(1) if match else None
    names = names or {}
    param = names.get(field, field) if field is not None else None
    if field is not None and param != field:
        text = text.replace(f"{field}=", f"{param}=", 1)
    return bad_request(param, text)
