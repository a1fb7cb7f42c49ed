"""The OpenAPI document ingress serves at /openapi.json, true to what the handlers do, so that
a client generator or a fuzzer (tests/e2e/test_security.py runs schemathesis on it) sees the
real contract:

- every status a route answers, with the error body in the route's protocol (OpenAI's
  `{"error": {...}}`, Anthropic's `{"type": "error", ...}`); a bad body is 400 as the SDKs
  expect, not FastAPI's 422;
- 200 as JSON, and as `text/event-stream` where the route streams;
- `model` in each request body: one of the models the cluster serves now (the document is
  built per fetch from the served-model table).
"""

from __future__ import annotations

import copy
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel


class _OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIError(BaseModel):
    error: _OpenAIErrorDetail


class _AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"]
    error: _AnthropicErrorDetail
    request_id: str | None = None


_DESCRIPTIONS = {
    400: "the request is invalid (the message says where)",
    401: "no API key, or one that is invalid or revoked",
    404: "no such model, or no such stored response",
    408: "the body did not all arrive in time",
    413: "the body is larger than the limit",
    429: "over a limit, or the cluster is overloaded (Retry-After)",
    503: "the cluster is unreachable or has no worker for it now (Retry-After)",
    504: "the request's deadline passed",
    529: "the cluster is overloaded (Retry-After)",
}
GENERATE = (400, 401, 404, 408, 413, 429, 503, 504)  # the statuses of a route that generates


def responses(
    protocol: str, statuses: tuple[int, ...], *, streams: bool = False
) -> dict[int | str, dict[str, Any]]:
    """FastAPI's `responses=` for a route: its errors in `protocol`'s shape (Anthropic adds
    529 where OpenAI says 429 for an overloaded cluster), and its 200's media types."""
    model = AnthropicError if protocol == "anthropic" else OpenAIError
    codes = (*statuses, 529) if protocol == "anthropic" and 429 in statuses else statuses
    out: dict[int | str, dict[str, Any]] = {
        code: {"model": model, "description": _DESCRIPTIONS[code]} for code in codes
    }
    if streams:
        out[200] = {
            "description": "the answer: JSON, or server-sent events when `stream` is true",
            "content": {"text/event-stream": {"schema": {}}},
        }
    return out


def install(app: FastAPI, served_models: Callable[[], Awaitable[list[str]]]) -> None:
    """Serve the document built from `app`'s routes at /openapi.json (the app is made with
    `openapi_url=None`), with `await served_models()` as the enum of every body's `model`."""
    base: dict[str, Any] = {}

    def document() -> dict[str, Any]:
        if not base:
            base.update(
                get_openapi(
                    title=app.title, version=app.version, routes=app.routes, openapi_version="3.1.0"
                )
            )
            for operation in _operations(base):
                operation["responses"].pop("422", None)  # bodies that fail validation are 400
            for name in ("HTTPValidationError", "ValidationError"):
                base.get("components", {}).get("schemas", {}).pop(name, None)
            _link_stored_responses(base)
        return base

    async def serve() -> JSONResponse:
        doc = copy.deepcopy(document())
        names = sorted(await served_models())
        links = doc["paths"].get("/v1/responses", {}).get("post", {}).get("responses", {})
        follow = links.get("200", {}).get("links", {}).get("ContinueResponse")
        if follow is not None and names:
            follow["requestBody"]["model"] = names[0]
        for schema in doc.get("components", {}).get("schemas", {}).values():
            model = schema.get("properties", {}).get("model")
            if names and model is not None and model.get("type") == "string":
                model["enum"] = names
        return JSONResponse(doc)

    app.openapi = document  # type: ignore[method-assign]
    app.add_api_route("/openapi.json", serve, methods=["GET"], include_in_schema=False)


def _link_stored_responses(doc: dict[str, Any]) -> None:
    """OpenAPI links from a created response to what takes its id: its GET, and the next
    turn's `previous_response_id` (a fuzzer's stateful phase follows them)."""
    created = doc["paths"].get("/v1/responses", {}).get("post")
    if created is None:
        return
    created["responses"]["200"]["links"] = {
        "GetResponse": {
            "operationId": doc["paths"]["/v1/responses/{response_id}"]["get"]["operationId"],
            "parameters": {"response_id": "$response.body#/id"},
        },
        "ContinueResponse": {
            "operationId": created["operationId"],
            "requestBody": {
                "model": "",  # a served model's name, filled in per fetch
                "input": "And then?",
                "previous_response_id": "$response.body#/id",
            },
        },
    }


def _operations(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [op for ops in doc.get("paths", {}).values() for op in ops.values()]
