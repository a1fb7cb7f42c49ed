"""Which transport UCX chose, read from what it prints with `UCX_PROTO_INFO=y`.

UCX prints one table per endpoint configuration and operation the first time it selects a
protocol for them (to UCX_LOG_FILE, stdout by default):

    +--------+-------------+-----------------------------------+
    | prefill-prefill-1-ab12cd34-5e6f7a8b inter-node cfg#1     |
    | remote memory write by ucp_put* from host memory to host |
    +--------+-------------+-----------------------------------+
    | Range  | Description |              Config               |
    +--------+-------------+-----------------------------------+
    | 0..inf | zero-copy   | tcp/kvnet0                        |
    +--------+-------------+-----------------------------------+

The first title row names the local context, then `self`, `intra-node` or `inter-node`;
each Config cell names transport/device lanes. The environment says only what UCX may use
(UCX_TLS); this says what it did use.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s+\[[^\]]*\]\s*")  # [time] [host:pid:thread]
_LANE = re.compile(r"\b([a-z][a-z0-9_]*/[\w.:-]+)")


@dataclass(frozen=True, slots=True)
class UcxProtocol:
    endpoint: str  # "<context> inter-node cfg#1"
    operation: str  # "remote memory write by ucp_put* from host memory to host"
    transports: frozenset[str]  # {"tcp/kvnet0"}


def proto_info(text: str) -> list[UcxProtocol]:
    """Every protocol table in a UCX log with `UCX_PROTO_INFO=y`, in order."""
    tables: list[UcxProtocol] = []
    sections: list[list[str]] = []
    section: list[str] = []
    for raw in text.splitlines():
        line = _LOG_PREFIX.sub("", raw).strip()
        if line.startswith("+"):  # a border closes a section: titles, header, rows
            if section:
                sections.append(section)
                section = []
            if len(sections) == 3:
                titles, _, rows = sections
                lanes = (_LANE.findall(row.split("|")[-2]) for row in rows)
                transports = frozenset(lane for row_lanes in lanes for lane in row_lanes)
                operation = " ".join(t.strip("| ") for t in titles[1:])
                tables.append(UcxProtocol(titles[0].strip("| "), operation, transports))
                sections = []
        elif line.startswith("|"):
            section.append(line)
        else:
            sections, section = [], []
    return tables
