"""`kvfabric status`: every live instance under a root, with its load and where its metrics
are served (`metrics_url` in its discovery metadata), from discovery. `--format json` adds each
instance's metrics snapshot (the registry its /metrics serves). With the state dir of a
`kvfabric up`, also the launcher's supervision: restarts, crash loops, failed and degraded
services."""

from __future__ import annotations

from typing import Any

from services.admin.supervisor import NATS_SERVER
from shared.discovery import Instance

COLUMNS = (
    "SERVICE",
    "INSTANCE",
    "VERSION",  # two side by side during a rolling upgrade
    "MODEL",
    "STATE",
    "INFLIGHT",
    "QUEUED",
    "RUNNING",
    "KV FREE/TOTAL",
    "NODE",
    "URL",
    "METRICS",
)


def render(instances: list[Instance]) -> str:
    rows = [COLUMNS]
    for i in instances:
        load = i.load
        kv = f"{load.get('num_kv_pages_free', 0)}/{load.get('num_kv_pages_total', 0)}"
        rows.append(
            (
                i.service,
                i.instance_id,
                i.version,
                i.metadata.get("model", ""),
                str(load.get("state", "?")),
                str(load.get("num_inflight", 0)),
                str(load.get("num_queued", 0)),
                str(load.get("num_running", 0)),
                kv,
                i.metadata.get("node_id", ""),
                i.metadata.get("http_url", ""),
                i.metadata.get("metrics_url", ""),
            )
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


SUPERVISION_COLUMNS = ("INSTANCE", "PROCESS", "RESTARTS", "LAST EXIT", "DISCOVERY", "NOTE")


def render_supervision(state: dict[str, Any], instances: list[Instance]) -> str:
    """The launcher's view (supervisor.json) beside discovery's: each process's restarts and
    state, and a line per degraded service (an instance failed, restarting, or not answering
    discovery)."""
    live = {i.instance_id for i in instances}
    rows = [SUPERVISION_COLUMNS]
    degraded: dict[str, list[str]] = {}
    for record in state.get("instances", []):
        instance_id, service = record["instance_id"], record["service"]
        answers = service == NATS_SERVER or instance_id in live
        process = record["state"]
        if process == "backoff" and record.get("restart_in_s") is not None:
            process += f" ({record['restart_in_s']:.1f}s)"
        code = record.get("last_exit_code")
        note = "crash-looping" if record.get("crash_looping") else ""
        if record["state"] == "failed":
            note = "FAILED: restart budget spent; " + (record.get("last_exit_reason") or "")[:60]
        rows.append(
            (
                instance_id,
                process,
                str(record.get("restarts", 0)),
                "" if code is None else str(code),
                "-" if service == NATS_SERVER else ("yes" if answers else "no"),
                note,
            )
        )
        if record["state"] != "running" or not answers or record.get("crash_looping"):
            degraded.setdefault(service, []).append(instance_id)
    widths = [max(len(row[c]) for row in rows) for c in range(len(SUPERVISION_COLUMNS))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    if not state.get("live", True):
        lines.insert(0, "(the launcher that wrote this is gone: its last state)")
    for service, ids in sorted(degraded.items()):
        lines.append(f"degraded: {service} ({', '.join(ids)})")
    if not degraded:
        lines.append("every supervised process is running and answering")
    return "\n".join(lines)
