"""Errors in OpenAI's JSON shape, with the HTTP status a client expects.

``{"error": {"message", "type", "param", "code"}}``. Domain errors
(``kvpager.errors``) map by status in one table; a RESOURCE_EXHAUSTED with a
retry hint (the queue is full) is 429 with ``Retry-After``, one without (a
request that can never fit the pool) is 400. Only a bug is a 500.
"""

from __future__ import annotations

import math

from kvpager.errors import KvpagerError

# domain status -> (HTTP status, OpenAI error type, code)
_BY_STATUS = {
    "INVALID_ARGUMENT": (400, "invalid_request_error", "invalid_value"),
    "FAILED_PRECONDITION": (400, "invalid_request_error", "invalid_value"),
    "ALREADY_EXISTS": (409, "invalid_request_error", "conflict"),
    "NOT_FOUND": (404, "invalid_request_error", "not_found"),
    "UNAUTHENTICATED": (401, "invalid_request_error", "invalid_api_key"),
    "PERMISSION_DENIED": (403, "invalid_request_error", "permission_denied"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error", "rate_limit_exceeded"),
    "UNAVAILABLE": (503, "server_error", "service_unavailable"),
    "DEADLINE_EXCEEDED": (504, "server_error", "timeout"),
    "ABORTED": (409, "invalid_request_error", "aborted"),
    "UNIMPLEMENTED": (501, "invalid_request_error", "not_implemented"),
    "INTERNAL": (500, "server_error", "internal_error"),
}


class HttpError(Exception):
    """An error response: status, OpenAI body fields, extra headers."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> HttpError:
    return HttpError(400, message, param=param, code="invalid_value")


def model_not_found(name: str) -> HttpError:
    return HttpError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


def from_domain(exc: KvpagerError) -> HttpError:
    status, type_, code = _BY_STATUS.get(exc.status, (500, "server_error", "internal_error"))
    headers = {}
    if exc.status == "RESOURCE_EXHAUSTED" and exc.retry_after_s is None:
        status, type_, code = 400, "invalid_request_error", "request_too_large"  # never fits: retrying won't help
    if exc.retry_after_s is not None and status in (429, 503):
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    return HttpError(status, exc.message, type=type_, param=exc.param, code=code, headers=headers)
