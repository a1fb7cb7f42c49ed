"""The audit log on a real nats-server: records are kept in order with their actor, read back
by age, and the stream refuses deleting or purging them."""

from __future__ import annotations

from pathlib import Path

import nats.js.errors
import pytest

from shared import audit
from shared.nats_auth import ensure_credentials, seed_path
from shared.testing.fixtures import BusFactory

pytestmark = pytest.mark.nats


async def test_actions_are_kept_in_order_and_cannot_be_deleted(
    bus_factory: BusFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = ensure_credentials(tmp_path / "creds", ["admin"])
    monkeypatch.setenv("KVF_NATS_CREDS", str(seed_path(tmp_path / "creds", "admin")))
    bus = await bus_factory("admin")
    assert await audit.read(bus) == []  # no stream yet: nothing recorded
    await audit.record(bus, "keys.create", "acme", "ok key_1", {"name": "ci"})
    await audit.record(bus, "keys.revoke", "key_1", "ok")
    await audit.record(bus, "drain", "decode-0", "not found", {"grace_s": "60.0"})
    records = await audit.read(bus)
    assert [(r.action, r.target, r.outcome) for r in records] == [
        ("keys.create", "acme", "ok key_1"),
        ("keys.revoke", "key_1", "ok"),
        ("drain", "decode-0", "not found"),
    ]
    assert records[0].detail == {"name": "ci"}
    assert all(keys["admin"] in r.actor and "@" in r.actor for r in records)
    assert [r.action for r in await audit.read(bus, limit=1)] == ["drain"]
    assert await audit.read(bus, since_s=-60) == []  # none from the future

    js = bus._nc.jetstream()  # noqa: SLF001 - what a hostile admin tool would call
    stream = bus.subjects.audit_stream
    with pytest.raises(nats.js.errors.APIError, match="not permitted"):
        await js.delete_msg(stream, 1)
    with pytest.raises(nats.js.errors.APIError, match="not permitted"):
        await js.purge_stream(stream)
    assert len(await audit.read(bus)) == 3


def test_the_actor_names_the_credentials_without_the_seed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = ensure_credentials(tmp_path, ["admin"])
    seed = seed_path(tmp_path, "admin")
    monkeypatch.setenv("KVF_NATS_CREDS", str(seed))
    who = audit.actor()
    assert keys["admin"] in who
    assert seed.read_text().strip() not in who
    monkeypatch.delenv("KVF_NATS_CREDS")
    assert "nkey" not in audit.actor()
