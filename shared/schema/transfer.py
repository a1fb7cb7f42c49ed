"""NIXL agent metadata, exchanged over NATS so that two workers can move KV over NIXL.

A worker serves its agent's metadata and registered regions on `Subjects.nixl_metadata`
(addressed per instance); a peer asks once and caches the answer until a transfer fails.
Bulk KV never rides NATS: only this handshake does (a few KB of UCX worker addresses).
"""

from __future__ import annotations

import msgspec

from shared.schema.base import Message


class NixlRegion(msgspec.Struct, frozen=True, array_like=True):
    """One registered memory region a peer may read from or write into."""

    addr: int
    num_bytes: int
    device_id: int = 0
    mem_type: str = "DRAM"  # DRAM | VRAM


class NixlMetadataRequest(Message, tag="nixl_metadata_request"):
    requester_agent: str = ""  # logged by the server; NIXL itself does not need it


class NixlAgentInfo(Message, tag="nixl_agent_info"):
    agent_name: str
    metadata: bytes  # nixl_agent.get_agent_metadata()
    regions: tuple[NixlRegion, ...] = ()
