"""The audit log: every admin action (`kvfabric keys`, `accounts`, `drain`, `cache`) as an
`AuditRecord` on a JetStream stream that refuses deleting or purging its messages, kept a
year. Only admin credentials may publish there (shared/nats_auth.py), and the actor names the
public key the server checked, so a record says which credentials did what. `kvfabric audit`
reads it.

What it does not stop: an admin can delete the whole stream (NATS keeps no record of that
beyond its own log); ship the stream elsewhere (a mirror) where that matters.
"""

from __future__ import annotations

import getpass
import os
import socket
import time
from pathlib import Path

import nkeys

from shared.bus import Bus, NoStream, now_ms
from shared.bus.connection import CREDS_ENV
from shared.schema import AuditRecord, decode

RETENTION_S = 366 * 86400.0


def actor(creds: str | os.PathLike[str] | None = None) -> str:
    """`user@host`, and the public key of the NATS credentials in use (a seed is never
    written anywhere; its public key names it)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    who = f"{user}@{socket.gethostname()}"
    path = creds or os.environ.get(CREDS_ENV)
    if path:
        try:
            seed = bytearray(Path(path).read_bytes().strip())
            who += f" (nkey {nkeys.from_seed(seed).public_key.decode()})"
        except (OSError, nkeys.ErrInvalidSeed, nkeys.NkeysError):
            who += " (unreadable credentials)"
    return who


async def ensure_stream(bus: Bus) -> None:
    subjects = bus.subjects
    await bus.js.ensure_stream(
        subjects.audit_stream,
        [subjects.audit_all, subjects.prefix_guard_audit],
        max_age_s=RETENTION_S,
        deny_delete=True,
        deny_purge=True,
    )


async def record(
    bus: Bus,
    action: str,
    target: str,
    outcome: str,
    detail: dict[str, str] | None = None,
    subject: str | None = None,
    *,
    who: str | None = None,
    ensure: bool = True,
) -> AuditRecord:
    """Write one record, acknowledged by the stream (raises when it is not); on `subject`
    where a service writes it (admin's go to `audit(action)`). A service writing many
    passes its `actor()` once read (`who`) and `ensure=False` once the stream is there."""
    if ensure:
        await ensure_stream(bus)
    entry = AuditRecord(
        ts_ms=now_ms(),
        actor=who if who is not None else actor(),
        action=action,
        target=target,
        outcome=outcome,
        detail=detail or {},
    )
    await bus.js.publish(subject or bus.subjects.audit(action), entry)
    return entry


async def read(bus: Bus, *, since_s: float | None = None, limit: int = 1000) -> list[AuditRecord]:
    """The stream's records, oldest first: the last `limit` of those newer than `since_s`
    seconds ago (all when None)."""
    try:
        first, last = await bus.js.stream_bounds(bus.subjects.audit_stream)
    except NoStream:
        return []  # no admin action yet
    cutoff_ms = now_ms() - int(since_s * 1000) if since_s is not None else 0
    records: list[AuditRecord] = []
    for seq in range(max(first, last - limit + 1, 1), last + 1):
        data = await bus.js.get_message(bus.subjects.audit_stream, seq)
        if data is None:
            continue
        entry = decode(data, AuditRecord)
        if entry.ts_ms >= cutoff_ms:
            records.append(entry)
    return records


def describe(entry: AuditRecord) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(entry.ts_ms / 1000))
    detail = " ".join(f"{k}={v}" for k, v in sorted(entry.detail.items()))
    return f"{when}  {entry.action:<16} {entry.target:<24} {entry.outcome:<10} {entry.actor}" + (
        f"  {detail}" if detail else ""
    )
