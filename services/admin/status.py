"""`kvfabric status`: every live instance under a root, with its load and where its metrics
are served (`metrics_url` in its discovery metadata), from discovery. `--json` adds each
instance's metrics snapshot (the registry its /metrics serves)."""

from __future__ import annotations

from shared.discovery import Instance

COLUMNS = (
    "SERVICE",
    "INSTANCE",
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
