"""What ingress measures, as its clients see it: HTTP requests by protocol and status and how
long each took to its last byte (`CountRequests`, an ASGI middleware), and per generation
the time to its first token from the request's arrival and the gap per token between its
chunks (pipeline.py). Its usage outbox is exported as every worker's (worker/serving).
"""

from __future__ import annotations

import time

from services.ingress.diagnosis import CAUSES
from services.ingress.stability import HARNESS_LABELS, KINDS, SPAN_LABELS
from services.ingress.tracing import UNTRACED_PATHS, protocol_of
from shared.metrics import Metrics

PROTOCOLS = ("openai.chat_completions", "openai.responses", "anthropic.messages", "kvfabric")
# What the routes answer (errors.py; 529 is Anthropic's overloaded, 405/422 Starlette's);
# anything else is "other".
STATUSES = (
    "200",
    "400",
    "401",
    "403",
    "404",
    "405",
    "413",
    "422",
    "429",
    "500",
    "503",
    "504",
    "529",
    "other",
)


class IngressMetrics:
    def __init__(self, metrics: Metrics) -> None:
        self.requests = metrics.counter(
            "kvfabric_ingress_requests_total",
            "HTTP requests answered, by protocol and status (/health and /openapi.json aside).",
            labels={"protocol": PROTOCOLS, "status": STATUSES},
        )
        self.request_seconds = metrics.histogram(
            "kvfabric_ingress_request_duration_seconds",
            "From a request's arrival to its response's last byte (a stream's end).",
            labels={"protocol": PROTOCOLS},
        )
        self.ttft_seconds = metrics.histogram(
            "kvfabric_ingress_time_to_first_token_seconds",
            "From a generation's request reaching the pipeline (its body parsed, before "
            "tokenization) to its first tokens reaching ingress.",
        )
        self.failovers = metrics.counter(
            "kvfabric_ingress_failovers_total",
            "Generations continued on another decode worker after theirs died mid-stream.",
        )
        self.cache_diagnoses = metrics.counter(
            "kvfabric_ingress_cache_diagnoses_total",
            "Generations ended, by why their prompt missed the cache past the tokens it "
            "served (services/ingress/diagnosis.py; none: only new tokens missed).",
            labels={"cause": CAUSES},
        )
        self.volatile_spans = metrics.counter(
            "kvfabric_ingress_volatile_spans_total",
            "Generations whose prompt missed the cache from a span that changes on every "
            "request of its session (services/ingress/stability.py), by the caller's "
            "harness (its user agent) and the span's kind (unknown: the same part changed "
            "twice running, of no known kind).",
            labels={"harness": HARNESS_LABELS, "span": SPAN_LABELS},
        )
        self.staged_turns = metrics.counter(
            "kvfabric_ingress_staged_turns_total",
            "Turns that ended in a tool call whose session's KV was staged on the prefill "
            "worker that served them until the tool is expected back "
            "(services/ingress/staging.py).",
        )
        self.prefix_rewrites = metrics.counter(
            "kvfabric_ingress_prefix_rewrites_total",
            "System-prompt lines the prefix guard removed or moved, by kind (accounts that "
            "opted in only).",
            labels={"kind": tuple(k.name for k in KINDS)},
        )
        self.itl_seconds = metrics.histogram(
            "kvfabric_ingress_inter_token_latency_seconds",
            "Per chunk of a generation after its first: the time since its previous chunk, "
            "divided by the tokens it carries.",
        )


class CountRequests:
    """Counts each HTTP request by protocol and status, and times it to its last byte. (A
    plain ASGI middleware: one closure per request, no task.)"""

    def __init__(self, app, counts: IngressMetrics) -> None:  # noqa: ANN001
        self.app = app
        self.counts = counts

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] != "http" or scope["path"] in UNTRACED_PATHS:
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        status = "500"  # what the client sees if the app fails before answering

        async def send_counted(message) -> None:  # noqa: ANN001
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            protocol = protocol_of(scope["path"])
            label = status if status in STATUSES else "other"
            self.counts.requests.labels(protocol, label).inc()
            self.counts.request_seconds.labels(protocol).observe(time.perf_counter() - started)
