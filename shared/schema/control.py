"""Heartbeats: every instance publishes a `LoadReport` on its load subject."""

from __future__ import annotations

from enum import StrEnum

from shared.schema.base import Message


class InstanceState(StrEnum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    # Its last report: it stopped taking work and answered every request it received, so
    # a caller still waiting on it can send again (what it waits for never reached it).
    STOPPED = "stopped"


class LoadReport(Message, tag="load_report"):
    service: str
    instance_id: str
    seq: int
    ts_ms: int
    state: InstanceState = InstanceState.SERVING
    node_id: str = ""
    num_inflight: int = 0
    num_queued: int = 0
    num_queued_tokens: int = 0
    num_running: int = 0
    num_kv_pages_total: int = 0
    num_kv_pages_free: int = 0
    model: str = ""  # the model a prefill or decode worker serves ("" for other services)
    # Accelerators the instance holds: a model worker has one (a GPU in a cluster; on this
    # machine one CPU process stands for it), other services none. Billing counts the
    # device-hours these reports cover, for revenue per GPU-hour.
    num_devices: int = 0
    # A prefill worker with `--queue-policy fair`: its queued tokens by the jobs' queue level
    # (index 0 first); empty from a first-come-first-served one.
    num_queued_tokens_by_level: tuple[int, ...] = ()


class InflightNotice(Message, tag="inflight_notice"):
    """router replica -> its peers: work it just sent to one worker, not yet in that worker's
    heartbeats. Peers add it to their load view until the worker's next reports cover it."""

    router_id: str
    instance_id: str
    num_tokens: int = 0  # prefill: tokens the job adds to the worker's compute queue
    num_kv_pages: int = 0  # decode: KV pages the job will hold
    num_requests: int = 1
    queue_level: int = 0  # prefill: the job's (PrefillJob.queue_level)


class DrainRequest(Message, tag="drain_request"):
    """Operator (`kvfabric drain`) -> one instance: stop taking work, let what is in flight
    finish within `grace_s` (what outlives it fails as at shutdown), then exit cleanly; its
    launcher starts it again."""

    grace_s: float = 60.0


class DrainAccepted(Message, tag="drain_accepted"):
    """The instance's answer to `DrainRequest`, sent before it starts draining."""

    instance_id: str
    num_in_flight: int  # requests and streams it is finishing


class LimitUse(Message, tag="limit_use"):
    """ingress replica -> every replica (through the limits stream): what it admitted or
    settled against rate limits since its last batch. Each use is (scope, dimension,
    amount, unix time): scope "key:<key id>" or "account:<name>", dimension "requests",
    "input_tokens" or "output_tokens"; a negative amount returns what a request reserved
    and did not use."""

    replica: str
    uses: list[tuple[str, str, float, float]]


class OpenStreams(Message, tag="open_streams"):
    """ingress replica -> every replica, each second: its requests open per scope (for the
    concurrency limits; a replica whose reports stop is forgotten after a few seconds)."""

    replica: str
    open: dict[str, int]


class AuditRecord(Message, tag="audit_record"):
    """An admin action (`kvfabric keys`, `accounts`, `drain`, `cache`), kept by the audit
    stream: who (`actor`: the operator's user@host and the public key of the NATS
    credentials the server accepted), what (`action`, e.g. "keys.revoke", on `target`),
    the settings it changed (`detail`, never a secret) and how it ended (`outcome`: "ok",
    or why not)."""

    ts_ms: int
    actor: str
    action: str
    target: str
    outcome: str
    detail: dict[str, str] = {}
