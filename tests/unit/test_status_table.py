"""`kvfabric status`'s table: one row per instance, its version beside its id (two versions
run side by side during a rolling upgrade)."""

from __future__ import annotations

from services.admin.status import COLUMNS, render
from shared.discovery import Instance


def test_each_instance_row_names_its_version() -> None:
    old = Instance("decode", "decode-0", "0.1.0", {"node_id": "node-a"}, {"state": "serving"})
    new = Instance("decode", "decode-1", "0.2.0", {"node_id": "node-b"}, {"state": "draining"})
    header, *rows = render([old, new]).splitlines()
    assert header.split()[:3] == ["SERVICE", "INSTANCE", "VERSION"]
    assert len(rows) == 2 and len(COLUMNS) == len(header.split()) - 1  # "KV FREE/TOTAL"
    assert rows[0].split()[:4] == ["decode", "decode-0", "0.1.0", "serving"]
    assert rows[1].split()[:4] == ["decode", "decode-1", "0.2.0", "draining"]
