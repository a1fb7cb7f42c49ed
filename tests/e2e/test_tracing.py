"""One OpenTelemetry trace per request across every hop, through `kvfabric up` as a
subprocess (separate processes, the mock engine) exporting both ways at once: over OTLP/HTTP
to a receiver inside this test (the protobuf decoded with opentelemetry-proto), and as JSON
lines under `--trace-dir`, read back by `kvfabric trace`.

A cold request and then the same prompt again (its prefix from the store): each is one
connected trace (one root, every parent present) from ingress's HTTP span through router,
kv-index, prefill, decode and swa-memcache to billing's ledger write, which joins through the
usage record's JetStream headers.
"""

from __future__ import annotations

import gzip
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from shared.testing import unique_root

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KVFABRIC = str(Path(sys.executable).parent / "kvfabric")
KEY = "kvf-trace-test-key-0123"
REQUIRED = {"ingress", "router", "kv-index", "prefill", "decode", "billing"}
SYSTEM = " ".join(f"Rule {i}: keep functions short and name things clearly." for i in range(30))
ROW = re.compile(
    r"^ *\+(?P<start>[\d.]+) ms +(?P<duration>[\d.]+) ms  (?P<service>\S+) +(?P<rest>.+)$"
)


class OtlpReceiver:
    """An OTLP/HTTP traces endpoint (POST /v1/traces, protobuf) keeping every span it gets."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                receiver._take(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:  # quiet
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def _take(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(
                        {
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent_span_id": span.parent_span_id.hex() or None,
                            "name": span.name,
                            "service": resource["service.name"],
                            "attributes": {a.key: _value(a.value) for a in span.attributes},
                        }
                    )
        with self._lock:
            self.spans += spans

    def trace(self, trace_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _value(value: Any) -> Any:
    return getattr(value, value.WhichOneof("value")) if value.WhichOneof("value") else None


@dataclass
class Running:
    http_url: str
    state_dir: Path
    trace_dir: Path
    receiver: OtlpReceiver


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    base = tmp_path_factory.mktemp("tracing")
    state_dir, trace_dir = base / "state", base / "traces"
    receiver = OtlpReceiver()
    up = subprocess.Popen(
        [
            KVFABRIC,
            "up",
            "--engine",
            "mock",
            "--models",
            "tiny-coder",
            "--nats-port",
            "0",
            "--http-port",
            "0",
            "--state-dir",
            str(state_dir),
            "--root",
            unique_root(),
            "--dev-api-key",
            KEY,
            "--shutdown-grace-s",
            "3",
            "--trace-dir",
            str(trace_dir),
            "--otlp-endpoint",
            receiver.url,
            "--trace-sample-ratio",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=os.environ | {"OTEL_BSP_SCHEDULE_DELAY": "200"},  # OTLP batches sent at once
    )
    try:
        assert up.stdout is not None
        lines: list[str] = []
        while not (lines and lines[-1].startswith("ready")):
            line = up.stdout.readline()
            assert line, "kvfabric up exited before it was ready:\n" + "\n".join(lines)
            lines.append(line.rstrip("\n"))
        http_url = re.search(r"HTTP API\s+(http://\S+)", "\n".join(lines)).group(1).rstrip(",")
        yield Running(http_url, state_dir, trace_dir, receiver)
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
        receiver.close()


def _ask(http_url: str) -> tuple[str, str, dict[str, Any]]:
    """One chat completion: (request id, trace id from x-trace-id, usage)."""
    body = {
        "model": "tiny-coder",
        "max_tokens": 12,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "def add(a, b):"},
        ],
    }
    response = httpx.post(
        f"{http_url}/v1/chat/completions",
        json=body,
        timeout=60,
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert response.status_code == 200, response.text
    payload = response.json()
    return payload["id"].removeprefix("chatcmpl-"), response.headers["x-trace-id"], payload["usage"]


@pytest.fixture(scope="module")
def asked(cluster: Running) -> dict[str, tuple[str, str, dict[str, Any]]]:
    """The cold request, then the same prompt once kv-index knows its blocks (the first
    request whose usage shows cached tokens; kv-index applies the KV events moments later)."""
    cold = _ask(cluster.http_url)
    assert cold[2]["prompt_tokens_details"]["cached_tokens"] == 0
    for _ in range(10):
        warm = _ask(cluster.http_url)
        if warm[2]["prompt_tokens_details"]["cached_tokens"] > 0:
            return {"cold": cold, "warm": warm}
        time.sleep(0.2)
    raise AssertionError("the repeated prompt never hit the store")


def _is_whole(spans: list[dict[str, Any]]) -> bool:
    ids = {s["span_id"] for s in spans}
    return {s["service"] for s in spans} >= REQUIRED and all(
        s["parent_span_id"] in ids for s in spans if s["parent_span_id"]
    )


@pytest.mark.timeout(120)
def test_one_request_is_one_connected_otlp_trace_across_every_service(
    cluster: Running, asked: dict[str, tuple[str, str, dict[str, Any]]]
) -> None:
    request_id, trace_id, usage = asked["cold"]
    deadline = time.monotonic() + 30  # billing's span comes after its next pull (~1 s)
    while not _is_whole(spans := cluster.receiver.trace(trace_id)):
        assert time.monotonic() < deadline, f"trace {trace_id} incomplete: {spans}"
        time.sleep(0.2)
    ids = {s["span_id"] for s in spans}
    roots = [s for s in spans if s["parent_span_id"] is None]
    assert [(r["service"], r["name"]) for r in roots] == [("ingress", "POST /v1/chat/completions")]
    root = roots[0]
    assert root["attributes"]["kvfabric.request_id"] == request_id
    assert root["attributes"]["kvfabric.protocol"] == "openai.chat_completions"
    assert root["attributes"]["http.response.status_code"] == 200
    assert all(s["parent_span_id"] in ids for s in spans if s is not root)
    services = {s["service"] for s in spans}
    assert REQUIRED | {"swa-memcache"} <= services, services  # the window snapshot's put
    by_name = {(s["service"], s["name"]): s for s in spans}
    route = by_name[("router", "router route")]["attributes"]
    assert route["kvfabric.hit_tokens"] == 0 and route["kvfabric.prefill_worker_id"] == "prefill-0"
    assert route["kvfabric.decode_worker_id"] == "decode-0"
    assert by_name[("kv-index", "kv-index match")]["attributes"]["kvfabric.hit_blocks.ssd"] == 0
    compute = by_name[("prefill", "prefill compute")]["attributes"]
    assert compute["kvfabric.num_tokens"] == usage["prompt_tokens"]  # and samples the first
    pulled = by_name[("decode", "decode pull")]["attributes"]  # the suffix's pages and window
    assert pulled["kvfabric.num_blocks"] > 0 and pulled["kvfabric.bytes"] > 0
    stored = by_name[("prefill", "prefill store")]["attributes"]
    assert stored["kvfabric.num_blocks"] > 0 and stored["kvfabric.bytes"] > 0
    generated = by_name[("decode", "decode generate")]["attributes"]
    assert generated["kvfabric.num_output_tokens"] == usage["completion_tokens"]
    billed = by_name[("billing", "billing record")]["attributes"]
    assert billed["kvfabric.request_id"] == request_id and billed["kvfabric.source"] == "decode"


def _tree(text: str) -> list[tuple[int, str, str, float, str]]:
    """(depth, service, span name, duration ms, attributes) of each line of `kvfabric trace`."""
    lines = text.splitlines()
    column = lines[1].index("span")
    rows = []
    for line in lines[2:]:
        match = ROW.match(line)
        assert match, line
        name, _, attributes = match["rest"].partition("  ")
        depth = (match.start("rest") - column) // 2
        rows.append((depth, match["service"], name, float(match["duration"]), attributes))
    return rows


def _parents(rows: list[tuple[int, str, str, float, str]]) -> dict[tuple[str, str], tuple]:
    """Each span's parent in the printed tree: the nearest line above it one level up."""
    parents, stack = {}, []
    for depth, service, name, _, _ in rows:
        del stack[depth:]
        if stack:
            parents[(service, name)] = stack[-1]
        stack.append((service, name))
    return parents


@pytest.mark.timeout(120)
def test_kvfabric_trace_prints_the_tree_of_a_real_request(
    cluster: Running, asked: dict[str, tuple[str, str, dict[str, Any]]]
) -> None:
    request_id, trace_id, _ = asked["warm"]
    command = [KVFABRIC, "trace", request_id, "--state-dir", str(cluster.state_dir)]
    deadline = time.monotonic() + 30
    while True:  # the files get each process's spans every half second
        shown = subprocess.run(command, capture_output=True, text=True, timeout=60)
        if shown.returncode == 0 and "billing record" in shown.stdout:
            break
        assert time.monotonic() < deadline, shown.stdout + shown.stderr
        time.sleep(0.3)
    heading = shown.stdout.splitlines()[0]
    assert heading.startswith(f"trace {trace_id}  request {request_id}  ")
    rows = _tree(shown.stdout)
    assert {service for _, service, _, _, _ in rows} >= REQUIRED
    assert rows[0][:3] == (0, "ingress", "POST /v1/chat/completions")
    assert [row for row in rows if row[0] == 0] == [rows[0]]  # one root, nothing orphaned
    parents = _parents(rows)
    assert parents[("ingress", "client generate")] == ("ingress", "POST /v1/chat/completions")
    assert parents[("router", "generate")] == ("ingress", "client generate")
    assert parents[("kv-index", "match")] == ("router", "router match")
    assert parents[("prefill", "run")] == ("router", "router prefill job")
    assert parents[("prefill", "prefill load")] == ("prefill", "run")  # the hit, read back
    assert parents[("decode", "suffix")] == ("prefill", "prefill transfer")
    assert parents[("billing", "billing record")] == ("decode", "decode finish")
    durations = {(service, name): ms for _, service, name, ms, _ in rows}
    assert all(ms >= 0 for ms in durations.values())
    assert (
        durations[("ingress", "POST /v1/chat/completions")]
        >= durations[("ingress", "client generate")]
        >= durations[("decode", "decode generate")]
        > 0
    )
    route = next(attrs for _, _, name, _, attrs in rows if name == "router route")
    assert int(re.search(r"hit_tokens=(\d+)", route).group(1)) > 0

    missing = subprocess.run(
        [*command[:2], "no-such-request", *command[3:]], capture_output=True, text=True, timeout=60
    )
    assert missing.returncode == 1
    assert f"'no-such-request' not found in {cluster.trace_dir.resolve()} (" in missing.stderr
    assert re.search(r"\((\d+) traces, \d+ spans in 7 files", missing.stderr)
