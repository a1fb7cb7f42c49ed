"""What the e2e suites on a whole cluster share (test_serving.py on the model, test_mock_cluster.py
on the mock engine): the cluster a module's tests run against, a bus to it, and waiting for
what the cluster does asynchronously -- kv-index learning blocks, usage landing on JetStream.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from loadtest.fault_load import usage_log
from services.admin.launcher import START_ORDER, Cluster, ClusterSpec, Placement
from shared import kv_index_client as index_client
from shared.bus import Bus
from shared.schema import UsageRecord
from shared.subjects import DECODE, PREFILL, SWA_MEMCACHE, VLLM_WORKER
from shared.testing import unique_root
from shared.testing.hosts import Host, HostNetwork, unavailable_reason

CLIENT_HOST = "client"
NODE_SERVICES = (PREFILL, DECODE, SWA_MEMCACHE, VLLM_WORKER)


def two_nodes(instance_id: str) -> str:
    """A split for `run_cluster(hosts=...)`: the workers and memcaches numbered even on
    node-a, odd on node-b, the control plane on ctl."""
    service, _, number = instance_id.rpartition("-")
    if service.startswith(NODE_SERVICES) and number.isdigit():
        return "node-a" if int(number) % 2 == 0 else "node-b"
    return "ctl"


def apart(instance_id: str) -> str:
    """A split for `run_cluster(hosts=...)` of a cluster with one worker of each kind: prefill
    (with its swa-memcache and any vllm-worker) on node-a, decode on node-b, the control plane
    on ctl, so every handoff's KV crosses hosts."""
    service, _, number = instance_id.rpartition("-")
    if number.isdigit() and service == DECODE:
        return "node-b"
    if number.isdigit() and service.startswith(NODE_SERVICES):
        return "node-a"
    return "ctl"


def placement(host: Host) -> Placement:
    """Where the launcher runs a process on `host`: inside its namespace, with its address
    and the environment it adds (its node id, KV over TCP)."""
    extra = {k: v for k, v in host.env().items() if os.environ.get(k) != v}
    return Placement(
        prefix=tuple(host.command([])),
        env=tuple(sorted(extra.items())),
        address=host.address,
        enter=host.inside,
    )


def run_cluster(
    state_dir: Path,
    *,
    replicas: dict[str, int],
    extra_args: dict[str, list[str]],
    ready_timeout_s: float,
    instance_args: dict[str, list[str]] | None = None,
    models: tuple[str, ...] = ("tiny-coder",),
    hosts: dict[str, str] | Callable[[str], str] | None = None,
    network: HostNetwork | None = None,
) -> Iterator[Cluster]:
    """A module fixture's body (`yield from run_cluster(...)`): start every service as its own
    process under a fresh subject root, wait until all are ready, yield the cluster, and stop
    it through the handle that started it. `instance_args`: flags of single instances
    (`{"prefill-1": ["--node-id", "node-1"]}`), after their service's `extra_args`;
    `models`: what the prefill and decode workers serve (`replicas` of each per model).

    `hosts` (instance id -> host name, a dict or a function such as `two_nodes`): the
    cluster split over network-namespace hosts (shared/testing/hosts.py) where this machine
    allows them (root), each instance on its host and the rest, NATS included, on "ctl";
    the tests then reach it from the `CLIENT_HOST` host (`cluster.client`, entered for each
    test by tests/e2e/conftest.py). Where namespaces cannot be made, everything runs on
    127.0.0.1 as without `hosts`. `network`: hosts the caller made (and closes), for what
    must run on them before the cluster starts (a database on ctl); it must have every host
    `hosts` names, "ctl" and the client's."""
    use_hosts = network is not None or (hosts is not None and unavailable_reason() is None)
    mapping = hosts or {}
    host_of = mapping if callable(mapping) else (lambda i: mapping.get(i, "ctl"))
    spec = ClusterSpec(
        state_dir=state_dir,
        nats_port=0,
        http_port=0,
        root=unique_root(),
        replicas=replicas,
        extra_args=extra_args,
        instance_args=instance_args or {},
        models=models,
        shutdown_grace_s=3.0,
    )
    instance_ids = [i for service in START_ORDER for i, _ in spec.instances(service)]
    names = {"ctl", CLIENT_HOST, *(host_of(i) for i in instance_ids)}
    if network is not None:
        own: contextlib.AbstractContextManager = contextlib.nullcontext(network)
    else:
        own = HostNetwork(sorted(names)) if use_hosts else contextlib.nullcontext()
    with own as net:
        if net is not None:
            spec.nats_placement = placement(net["ctl"])
            spec.placement = {i: placement(net[host_of(i)]) for i in instance_ids}
        cluster = Cluster(spec)
        cluster.client = net[CLIENT_HOST] if net is not None else None  # type: ignore[attr-defined]
        cluster.start()

        async def ready() -> None:
            bus = await connect(cluster)
            try:
                await cluster.wait_ready(bus, timeout_s=ready_timeout_s)
            finally:
                await bus.close()

        try:
            with on_the_client_host(cluster):
                asyncio.run(ready())
            yield cluster
        finally:
            cluster.stop()
        # Every role did only what its permissions allow (a refusal is a bug in the table
        # or in a service: either way the request it belonged to stalled).
        refused = cluster.nats_violations()
        assert not refused, f"NATS refused {len(refused)}: " + "\n".join(refused[:5])


@contextlib.contextmanager
def on_the_client_host(cluster: Cluster) -> Iterator[None]:
    """This thread's network is the client host's while inside, where the cluster is split
    over hosts (the test process itself is on none of their networks); else nothing."""
    client = getattr(cluster, "client", None)
    with client.inside() if client is not None else contextlib.nullcontext():
        yield


async def connect(cluster: Cluster) -> Bus:
    return await Bus.connect(
        cluster.nats_url, service="test", root=cluster.spec.root, creds=cluster.nats_creds
    )


async def num_indexed_blocks(bus: Bus, block_hashes: Sequence[int], timeout_s: float) -> int:
    """Wait until kv-index knows every block of `block_hashes` (it applies the workers' KV
    events asynchronously) or `timeout_s` passed; returns how many it knows."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = (await index_client.match(bus, list(block_hashes), num_shards=1)).get("ssd")
        num_blocks = found.num_blocks if found else 0
        if num_blocks == len(block_hashes) or time.monotonic() > deadline:
            return num_blocks
        await asyncio.sleep(0.05)


async def usage_records(
    bus: Bus, request_ids: set[str], timeout_s: float
) -> dict[str, UsageRecord]:
    """The `UsageRecord` of each request on JetStream (the decode worker's, or the caller's
    when that worker died). Fails the test when one is missing after `timeout_s`, or when a
    request has more than one: the whole log is read, up to its last message, so a
    duplicate is seen, not hidden."""
    records, complete = await usage_log(bus, request_ids, timeout_s)
    missing = sorted(request_ids - records.keys())
    assert not missing, f"no usage record for {', '.join(missing)}"
    assert complete, "the usage log was not read to its end"
    repeated = {r: len(records[r]) for r in request_ids if len(records[r]) != 1}
    assert not repeated, f"usage records per request, expected exactly one: {repeated}"
    return {r: records[r][0] for r in request_ids}
