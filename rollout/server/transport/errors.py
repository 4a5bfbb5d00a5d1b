"""ApiError: a failed request, as OpenAI's API reports it.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

Every 4xx names the field (`param`) when one is at fault, and says the rule and the fix in `message`, as the rest of
rollout's errors do. Raised anywhere while a request is parsed or run; the app turns it into the response.
"""

from __future__ import annotations

from ...base.errors import InvalidArgument

INVALID = "invalid_request_error"


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
    """A rollout ValueError ("prompt 0: max_new_tokens=9 is invalid: ... Fix: ...") as a 400. An InvalidArgument
    names the request's field (`param`: its `field`, mapped to the API's name by `names`, e.g. max_new_tokens ->
    max_tokens, in the message too); any other ValueError names none."""
    if not isinstance(error, InvalidArgument):
        return bad_request(None, str(error))
    param = (names or {}).get(error.field, error.field)
    return bad_request(param, str(InvalidArgument(param, error.value, error.rule, error.fix, error.where, error.index)))
