"""The HTTP surface: routes, authentication, limits and errors in each protocol's shape.

Routes: POST /v1/chat/completions, POST /v1/responses, GET /v1/responses/{id},
POST /v1/messages, POST /v1/messages/count_tokens, GET /v1/models, GET /health, and
FastAPI's /openapi.json. Anthropic's routes (/v1/messages...) answer errors in Anthropic's
shape, the others in OpenAI's; both auth headers work everywhere (C-05).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.ingress import anthropic_messages, openai_chat, openai_responses, openapi, sse
from services.ingress.diagnosis import HEADER, MAX_SESSION_ID_CHARS, SESSION_HEADER
from services.ingress.errors import ApiError
from services.ingress.limits import Admission, Limiter, Scope, scopes_of
from services.ingress.metrics import CountRequests
from services.ingress.pipeline import Completion, Generation, Pipeline, Prepared
from services.ingress.stability import harness
from services.ingress.tracing import TraceRequests
from shared.accounts import SCOPE_SHARED, Account, AccountStore, Limits
from shared.api_keys import KeyStore
from shared.logging import get_logger

log = get_logger(__name__)


@dataclass
class Caller:
    key_id: str
    account: Account
    key_limits: Limits = Limits()

    def scopes(self) -> list[Scope]:
        return scopes_of(self.key_id, self.key_limits, self.account.name, self.account.limits)

    def bill(self, completion: Completion, cache_salt: str | None = None) -> Completion:
        """The completion charged to this caller's account, cached in its namespace
        (`cache_salt`: the request's own, inside that namespace)."""
        return dataclasses.replace(
            completion,
            api_key_id=self.key_id,
            account=self.account.name,
            cache_salt=self.account.cache_salt(cache_salt or ""),
            keep_text=self.account.cache_scope == SCOPE_SHARED,
            prefix_guard=self.account.prefix_guard,
        )


@dataclass
class Services:
    """What the routes need, built by main.py (tests build their own)."""

    pipeline: Pipeline
    responses: openai_responses.ResponseStore
    keys: KeyStore | None  # None: no key needed (a dev cluster told so)
    accounts: AccountStore | None  # settings of the keys' accounts (None with keys None)
    limiter: Limiter | None  # rate limits and quotas (None with keys None)
    dev_api_key: str | None
    max_body_bytes: int
    health: Callable[[], tuple[int, dict[str, Any]]]
    body_timeout_s: float = 30.0  # a body not all in by then: 408
    stream_write_timeout_s: float = 60.0  # a stream write not out by then: the stream ends


def protocol_of(path: str) -> str:
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def error_response(exc: ApiError, path: str) -> JSONResponse:
    protocol = protocol_of(path)
    return JSONResponse(exc.body(protocol), status_code=exc.status(protocol), headers=exc.headers())


def build_app(services: Services) -> FastAPI:
    # FastAPI's own OpenTelemetry (a span, metrics and logs per request) is off: it cost
    # ~1 ms a request here; the request's span is TraceRequests' (tracing.py).
    telemetry = {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}
    app = FastAPI(
        title="kvfabric ingress",
        version="1",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,  # openapi.install serves it, with the models served now
        telemetry=telemetry,
    )
    pipeline = services.pipeline

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Starlette's own (an unknown route, a wrong method, a body past the limit), in the
        # protocol's shape too.
        kind = {401: "authentication", 404: "not_found", 413: "request_too_large"}.get(
            exc.status_code, "invalid_request" if exc.status_code < 500 else "api_error"
        )
        error = ApiError(kind, str(exc.detail))  # type: ignore[arg-type]
        response = error_response(error, request.url.path)
        response.status_code = exc.status_code  # 405 stays 405
        return response

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or "body"
        message = f"{where}: {first.get('msg', 'invalid request')}"
        return error_response(ApiError("invalid_request", message, param=where), request.url.path)

    app.add_middleware(
        BodyLimit, max_body_bytes=services.max_body_bytes, body_timeout_s=services.body_timeout_s
    )
    app.add_middleware(CountRequests, counts=pipeline.counts)  # refusals of the limit too
    app.add_middleware(TraceRequests)  # outermost: its span covers the body limit too

    async def caller(request: Request) -> Caller:
        # Every API route depends on this: while NATS is away nothing behind ingress can be
        # reached, so say so within a second (503, Retry-After) instead of letting the
        # request hang; a move to another server of the cluster is waited out.
        if not await pipeline.bus.until_connected():
            raise ApiError(
                "unavailable",
                "the cluster's message bus is unreachable (reconnecting); retry shortly",
                retry_after_s=1.0,
            )
        header = request.headers.get("authorization", "")
        key = header[7:].strip() if header.lower().startswith("bearer ") else ""
        key = key or request.headers.get("x-api-key", "").strip()
        # A cluster without keys, and its dev key, are one tenant: the operator's, in the
        # unsalted namespace `kvfabric generate` uses too.
        if services.keys is None:
            return Caller("", Account("anonymous", SCOPE_SHARED))
        if services.dev_api_key and key == services.dev_api_key:
            return Caller("key_dev", Account("dev", SCOPE_SHARED))
        if not key:
            raise ApiError(
                "authentication",
                "no API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY' "
                "(create one with `kvfabric keys create`)",
            )
        record = await services.keys.lookup(key)
        if record is None:
            raise ApiError("authentication", "invalid or revoked API key", code="invalid_api_key")
        assert services.accounts is not None  # built with the key store
        who = Caller(record.key_id, await services.accounts.get(record.account), record.limits)
        _check_body_size(request, who)
        return who

    async def start(prepared: list[Prepared], who: Caller, protocol: str) -> Started:
        """Admit the request under its caller's limits (429 before anything is queued), then
        send every choice to the cluster; the generations and what they hold."""
        admission = None
        if services.limiter is not None:
            first = prepared[0]
            admission = await services.limiter.admit(
                who.scopes(),
                num_prompt_tokens=first.num_prompt_tokens,
                max_output_tokens=first.request.sampling.max_tokens * len(prepared),
                protocol=protocol,
            )
        started = Started([pipeline.generation(p) for p in prepared], services.limiter, admission)
        try:
            await asyncio.gather(*(g.start() for g in started.generations))
        except BaseException:
            await started.close()
            raise
        first = started.generations[0]
        turn = first.prepared.turn
        if turn is not None:  # from the router's count: decode's comes in the usage
            diagnosis = turn.diagnosis(first.num_cached_estimate, first.eviction)
            started.cache_header = diagnosis.header()
        pipeline.remember_turn(first.prepared)
        return started

    # /health is kept for clients of the one health check there was.
    @app.get("/health", responses={503: {"description": "not ready: the body says why"}})
    @app.get("/readyz", responses={503: {"description": "not ready: the body says why"}})
    async def readyz() -> JSONResponse:
        """200 while this ingress takes requests: connected to NATS and serving."""
        status, body = services.health()
        return JSONResponse(body, status_code=status)

    @app.get("/livez")
    async def livez() -> JSONResponse:
        """200 while the process answers at all (NATS or not): restart it only when not."""
        return JSONResponse({"status": "alive"})

    @app.get("/v1/models", responses=openapi.responses("openai", (401, 503)))
    async def list_models(request: Request, _: Caller = Depends(caller)) -> dict[str, Any]:
        await pipeline.models.refresh()
        served = pipeline.models.served()
        if "anthropic-version" in request.headers:
            data = [
                {
                    "type": "model",
                    "id": m.name,
                    "display_name": m.name,
                    "created_at": _rfc3339(m.created),
                }
                for m in served
            ]
            return {
                "data": data,
                "has_more": False,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
            }
        return {
            "object": "list",
            "data": [
                {
                    "id": m.name,
                    "object": "model",
                    "created": m.created,
                    "owned_by": "kvfabric",
                    "context_length": m.max_model_len,
                }
                for m in served
            ],
        }

    @app.post(
        "/v1/chat/completions",
        responses=openapi.responses("openai", openapi.GENERATE, streams=True),
    )
    async def chat_completions(
        request: Request, body: openai_chat.ChatCompletionRequest, who: Caller = Depends(caller)
    ) -> Response:
        completion = openai_chat.to_completion(body, who.key_id)
        completion = dataclasses.replace(
            completion, session=_session(request), harness=_harness(request)
        )
        prepared = await pipeline.prepare(who.bill(completion, body.cache_salt))
        choices = [pipeline.fork(prepared, i) for i in range(body.n)]
        started = await start(choices, who, "openai")
        generations, rid = started.generations, prepared.request.request_id
        if body.stream:
            frames = openai_chat.stream(body, generations, rid)
            return _streaming(frames, started, services.stream_write_timeout_s)
        try:
            results = await asyncio.gather(*(g.run_to_end() for g in generations))
        finally:
            await started.close()
        return _json(openai_chat.response(body, list(results), rid), started.headers)

    @app.post(
        "/v1/messages", responses=openapi.responses("anthropic", openapi.GENERATE, streams=True)
    )
    async def messages(
        request: Request, body: anthropic_messages.MessagesRequest, who: Caller = Depends(caller)
    ) -> Response:
        user_id = (body.metadata or {}).get("user_id")
        session = _session(request) or (user_id if isinstance(user_id, str) else "")
        completion = anthropic_messages.to_completion(body, who.key_id)
        completion = dataclasses.replace(completion, session=session, harness=_harness(request))
        prepared = await pipeline.prepare(who.bill(completion, body.cache_salt))
        started = await start([prepared], who, "anthropic")
        (generation,), rid = started.generations, prepared.request.request_id
        if body.stream:
            frames = anthropic_messages.stream(body, generation, rid)
            return _streaming(frames, started, services.stream_write_timeout_s)
        try:
            events, finished = await generation.run_to_end()
        finally:
            await started.close()
        return _json(anthropic_messages.response(body, events, finished, rid), started.headers)

    @app.post(
        "/v1/messages/count_tokens",
        responses=openapi.responses("anthropic", (400, 401, 404, 408, 413, 503)),
    )
    async def count_tokens(
        body: anthropic_messages.CountTokensRequest, _: Caller = Depends(caller)
    ) -> dict[str, int]:
        chat = anthropic_messages.to_chat(body)
        return {"input_tokens": await pipeline.count_tokens(body.model, chat)}

    @app.post(
        "/v1/responses", responses=openapi.responses("openai", openapi.GENERATE, streams=True)
    )
    async def responses(
        request: Request, body: openai_responses.ResponsesRequest, who: Caller = Depends(caller)
    ) -> Response:
        context = []
        if body.previous_response_id:
            stored = await services.responses.get(body.previous_response_id, who.account.name)
            if stored is None:
                raise ApiError(
                    "not_found",
                    f"response {body.previous_response_id!r} not found "
                    "(never stored, stored with store=false, or expired)",
                    param="previous_response_id",
                )
            context = stored[1]
        prompt = [*context, *openai_responses.input_messages(body.input)]
        completion = who.bill(
            openai_responses.to_completion(body, prompt, who.key_id), body.cache_salt
        )
        completion = dataclasses.replace(completion, harness=_harness(request))
        # A chain is its own session: each turn is kept under its response id, which the
        # next turn's previous_response_id names; an x-session-id header takes precedence.
        if header := _session(request):
            completion = dataclasses.replace(completion, session=header)
        else:
            previous = body.previous_response_id
            chain = f"response:{previous}" if previous else ""
            completion = dataclasses.replace(completion, session=chain, chained=True)
        prepared = await pipeline.prepare(completion)
        started = await start([prepared], who, "openai")
        (generation,) = started.generations
        output = openai_responses.Output(body, prepared.request.request_id, prompt)

        async def store() -> None:
            if body.store and output.status in ("completed", "incomplete"):
                try:
                    await services.responses.put(
                        output.response(), output.context(prompt), who.account.name
                    )
                except Exception:  # the answer is out; only a later chaining suffers
                    log.exception("storing a response failed", response_id=output.id)

        if body.stream:
            frames = openai_responses.stream(output, generation)
            return _streaming(frames, started, services.stream_write_timeout_s, store)
        try:
            for event in (await generation.run_to_end())[0]:
                for _ in output.take(event):
                    pass
        finally:
            await started.close()
        await store()
        return _json(output.response(), started.headers)

    @app.get("/v1/responses/{response_id}", responses=openapi.responses("openai", (401, 404, 503)))
    async def get_response(response_id: str, who: Caller = Depends(caller)) -> Response:
        stored = await services.responses.get(response_id, who.account.name)
        if stored is None:
            raise ApiError("not_found", f"response {response_id!r} not found", param="response_id")
        return _json(stored[0])

    @app.get(
        "/v1/kvfabric/cache/explain/{request_id}",
        responses=openapi.responses("openai", (401, 404, 503)),
    )
    async def explain(request_id: str, who: Caller = Depends(caller)) -> Response:
        """Why this request's prompt missed the cache (services/ingress/diagnosis.py), to
        the account that sent it; the text around the first miss unless its cache is
        isolated. Ids as each protocol returned them (chatcmpl-..., resp_..., msg_...)."""
        explanations = pipeline.explanations
        found = None
        if explanations is not None:
            found = await explanations.get(request_id, who.account.name)
        if found is None:
            raise ApiError(
                "not_found",
                f"no cache explanation for request {request_id!r} (never kept, another "
                "account's, or expired)",
                param="request_id",
            )
        return _json(found.as_json())

    async def served_models() -> list[str]:
        await pipeline.models.refresh()
        return [m.name for m in pipeline.models.served()]

    openapi.install(app, served_models)
    # C-05: an OpenAI client whose base_url lacks /v1 reaches the same routes.
    for route in list(app.routes):
        path = getattr(route, "path", "")
        if path.startswith("/v1/") and not path.startswith("/v1/messages"):
            app.add_api_route(
                path[3:], route.endpoint, methods=list(route.methods), include_in_schema=False
            )
    return app


class BodyLimit:
    """413 in the protocol's shape for a body past the limit, told by Content-Length before
    anything is read, or counted as it arrives when the client sends it chunked; 408 for a
    body that has not all arrived `body_timeout_s` after the request began (a client
    trickling it byte by byte holds a connection and a task, never the cluster). (A plain
    ASGI middleware: Starlette's BaseHTTPMiddleware costs a task and a copy per request.)"""

    def __init__(self, app, max_body_bytes: int, body_timeout_s: float = 30.0) -> None:  # noqa: ANN001
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit, path = self.max_body_bytes, scope["path"]
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            return await self._refuse(f"request body of {int(length)} bytes", path, send)
        received, complete = 0, False
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s

        async def counted():  # noqa: ANN202
            nonlocal received, complete
            if complete:  # after the body, only the disconnect a stream watches for
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise StarletteHTTPException(
                    408, f"the request body did not arrive within {self.body_timeout_s:g} s"
                ) from None
            complete = message["type"] != "http.request" or not message.get("more_body")
            received += len(message.get("body", b""))
            if received > limit:  # FastAPI passes an HTTPException through body reading
                raise StarletteHTTPException(
                    413, f"request body exceeds the limit of {limit} bytes"
                )
            return message

        return await self.app(scope, counted, send)

    async def _refuse(self, what: str, path: str, send) -> None:  # noqa: ANN001
        error = ApiError(
            "request_too_large", f"{what} exceeds the limit of {self.max_body_bytes} bytes"
        )
        response = error_response(error, path)
        await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> dict:
    return {"type": "http.disconnect"}


@dataclass
class Started:
    """A request's generations (one per choice) and its admission under the rate limits:
    `close()` stops what still runs and gives back or settles what the admission holds."""

    generations: list[Generation]
    limiter: Limiter | None
    admission: Admission | None
    cache_header: str = ""  # diagnosis.HEADER's value

    @property
    def headers(self) -> dict[str, str]:
        headers = dict(self.admission.headers) if self.admission is not None else {}
        if self.cache_header:
            headers[HEADER] = self.cache_header
        return headers

    async def close(self) -> None:
        await asyncio.gather(*(g.close() for g in self.generations), return_exceptions=True)
        if self.limiter is not None and self.admission is not None:
            outputs = [g.num_output_tokens for g in self.generations]
            known = None if None in outputs else sum(o or 0 for o in outputs)
            # A pin counts against the token quota too (the choices share one prompt).
            pinned = self.generations[0].pin_quota_tokens if self.generations else 0
            await self.limiter.end(self.admission, known, pinned)


def _harness(request: Request) -> str:
    return harness(request.headers.get("user-agent", ""))


def _session(request: Request) -> str:
    """The agent session the request names (`x-session-id`), or ""."""
    session = request.headers.get(SESSION_HEADER, "").strip()
    if len(session) > MAX_SESSION_ID_CHARS:
        raise ApiError(
            "invalid_request",
            f"{SESSION_HEADER} is {len(session)} characters; at most {MAX_SESSION_ID_CHARS}",
            param=SESSION_HEADER,
        )
    return session


def _check_body_size(request: Request, who: Caller) -> None:
    """413 for a body over the caller's own limit (its key's or its account's); the
    service-wide limit is BodyLimit's."""
    limits = [x for x in (who.key_limits.max_body_bytes, who.account.limits.max_body_bytes) if x]
    length = request.headers.get("content-length", "")
    if limits and length.isdigit() and int(length) > min(limits):
        raise ApiError(
            "request_too_large",
            f"request body of {int(length)} bytes exceeds this key's limit of {min(limits)} bytes",
        )


def _streaming(
    frames: AsyncIterator[bytes],
    started: Started,
    write_timeout_s: float,
    after: Callable[[], Awaitable[None]] | None = None,
) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        try:
            async for frame in frames:
                yield frame
            if after is not None:
                await after()
        finally:  # also when the client went away: the request is cancelled downstream
            await started.close()

    headers = sse.HEADERS | started.headers
    response = _StreamingResponse(body(), media_type=sse.MEDIA_TYPE, headers=headers)
    response.write_timeout_s = write_timeout_s
    return response


class _StreamingResponse(StreamingResponse):
    """Stops streaming as soon as the client disconnects, or stops reading: a write that has
    not gone out after `write_timeout_s` (the client's socket full) ends the stream as a
    disconnect does. (Starlette's own relies on a write failing, and uvicorn drops writes to
    a closed connection silently, so a generation would run on to its end for nobody.)
    Cancelling the stream runs its `finally`, which cancels the request downstream."""

    write_timeout_s: float = 60.0

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        async def disconnected() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        async def send_in_time(message: dict) -> None:
            try:
                async with asyncio.timeout(self.write_timeout_s):
                    await send(message)
            except TimeoutError:
                raise _NotReading(self.write_timeout_s) from None

        stream = asyncio.ensure_future(self.stream_response(send_in_time))
        watch = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({stream, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, watch):
                task.cancel()
            await asyncio.gather(stream, watch, return_exceptions=True)
            # A stream stopped in a write leaves its frames suspended at a yield: close them
            # now (their `finally` cancels the request downstream), not whenever GC does.
            closing = getattr(self.body_iterator, "aclose", None)
            if closing is not None:
                await closing()
        failed = stream.exception() if stream.done() and not stream.cancelled() else None
        if isinstance(failed, _NotReading):
            log.info("a streaming client stopped reading: stream ended", after_s=failed.after_s)
            return
        if failed is not None:
            raise failed
        if self.background is not None:
            await self.background()


class _NotReading(Exception):
    def __init__(self, after_s: float) -> None:
        super().__init__(f"no write went out for {after_s:g} s")
        self.after_s = after_s


def _json(payload: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(payload), media_type="application/json", headers=headers)


def _rfc3339(epoch_s: int) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(epoch_s, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
