"""One error type for ingress, rendered in each protocol's own shape (docs/design.md, 'HTTP
APIs': C-03, C-04).

`ApiError` carries a protocol-neutral kind; `openai_body` and `anthropic_body` spell it the
way each SDK reads it, and `headers` adds `x-should-retry` (both SDKs obey it) and
`Retry-After`. A cluster error (`ServiceError`, from the router or a worker) becomes an
ApiError through `from_service_error`, so nothing below ingress knows about HTTP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from shared.schema import ErrorCode, ServiceError

Kind = Literal[
    "invalid_request",
    "authentication",
    "permission",
    "not_found",
    "request_too_large",
    "rate_limit",
    "overloaded",
    "timeout",
    "unavailable",
    "api_error",
]

# Anthropic answers an overloaded cluster with 529; OpenAI clients know 429 for it.
_STATUS: dict[Kind, tuple[int, int]] = {  # kind -> (OpenAI status, Anthropic status)
    "invalid_request": (400, 400),
    "authentication": (401, 401),
    "permission": (403, 403),
    "not_found": (404, 404),
    "request_too_large": (413, 413),
    "rate_limit": (429, 429),
    "overloaded": (429, 529),
    "timeout": (504, 504),
    "unavailable": (503, 503),
    "api_error": (500, 500),
}
_OPENAI_TYPE: dict[Kind, str] = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "request_too_large": "invalid_request_error",
    "rate_limit": "rate_limit_error",
    "overloaded": "rate_limit_error",
    "timeout": "timeout",
    "unavailable": "server_error",
    "api_error": "server_error",
}
_ANTHROPIC_TYPE: dict[Kind, str] = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "request_too_large": "request_too_large",
    "rate_limit": "rate_limit_error",
    "overloaded": "overloaded_error",
    "timeout": "timeout_error",
    "unavailable": "api_error",
    "api_error": "api_error",
}
_RETRYABLE: frozenset[Kind] = frozenset({"rate_limit", "overloaded", "unavailable", "timeout"})
_BY_SERVICE_CODE: dict[ErrorCode, Kind] = {
    ErrorCode.BAD_REQUEST: "invalid_request",
    ErrorCode.UNAUTHORIZED: "authentication",
    ErrorCode.NOT_FOUND: "not_found",
    ErrorCode.OVERLOADED: "overloaded",
    ErrorCode.UNAVAILABLE: "unavailable",
    ErrorCode.DEADLINE_EXCEEDED: "timeout",
    ErrorCode.CANCELLED: "api_error",
    ErrorCode.INTERNAL: "api_error",
}


@dataclass
class ApiError(Exception):
    kind: Kind
    message: str
    param: str | None = None
    code: str | None = None  # OpenAI's machine-readable code (e.g. "model_not_found")
    retry_after_s: float | None = None
    extra_headers: dict[str, str] = field(default_factory=dict)  # a rate limit's, say

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def status(self, protocol: str) -> int:
        return _STATUS[self.kind][1 if protocol == "anthropic" else 0]

    def headers(self) -> dict[str, str]:
        headers = {"x-should-retry": "true" if self.kind in _RETRYABLE else "false"}
        if self.retry_after_s is not None:
            headers["retry-after"] = str(max(1, math.ceil(self.retry_after_s)))
        return headers | self.extra_headers

    def openai_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _OPENAI_TYPE[self.kind],
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self, request_id: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "type": "error",
            "error": {"type": _ANTHROPIC_TYPE[self.kind], "message": self.message},
        }
        if request_id:
            body["request_id"] = request_id
        return body

    def body(self, protocol: str, request_id: str | None = None) -> dict[str, Any]:
        return self.anthropic_body(request_id) if protocol == "anthropic" else self.openai_body()


def from_service_error(exc: ServiceError) -> ApiError:
    kind = _BY_SERVICE_CODE.get(exc.code, "api_error")
    code = "model_not_found" if kind == "not_found" else None
    return ApiError(kind, exc.message, code=code, retry_after_s=exc.retry_after_s)


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError("invalid_request", message, param=param)
