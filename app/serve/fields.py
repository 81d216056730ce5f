"""OpenAI's error shape, and a request's scalar fields checked one by one (app.serve.request and
app.serve.thinking read the body through them).

Every refusal is an `ApiError` in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: a field
this server cannot honour is a clear 400 naming it, never silently ignored.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from starlette.responses import JSONResponse

from app.errors import describe, is_user_error


class ApiError(Exception):
    """An answer in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


def from_exception(e: BaseException) -> ApiError:
    """A user error is the client's 400; anything else a 500 whose details stay in the log."""
    if is_user_error(e):
        return bad(describe(e))
    return ApiError(500, "the generation failed on the server (see its log)")


def number(body: Mapping[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(f"'{name}' must be a number", name)
    return float(value)


def integer(body: Mapping[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"'{name}' must be an integer", name)
    return value


def flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be true or false", name)
    return value
