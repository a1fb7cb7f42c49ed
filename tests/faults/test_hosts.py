"""The hosts harness (shared/testing/hosts.py): three network-namespace hosts meet only over
their bridge, a cut host loses its connection and gets it back, KV moves between two hosts
over NIXL's UCX backend on TCP (and nothing else), and nothing of a run outlives it."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.natsd import NatsServer
from shared.testing.hosts import Host, HostNetwork, remove_stale, run_names, unavailable_reason
from shared.testing.ucx import proto_info

UNAVAILABLE = unavailable_reason()
pytestmark = [
    pytest.mark.faults,
    pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no hosts here: {UNAVAILABLE}"),
]

REPO = Path(__file__).resolve().parents[2]
BLOCK_NBYTES = 98_304  # one 64-token block of the tiny model
NUM_BLOCKS = 100
# Connects to argv[1]:argv[2]; exit status 0 when it connected.
PROBE = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 2).close()"
LISTEN = (
    "import socket, sys; s = socket.create_server(('127.0.0.1', 0)); "
    "print(s.getsockname()[1], flush=True); sys.stdin.read()"
)


@pytest.fixture(scope="module")
def net() -> Iterator[HostNetwork]:
    with HostNetwork(["ctl", "a", "b"]) as network:
        yield network


@pytest.fixture(scope="module")
def nats_on_ctl(net: HostNetwork, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path_factory.mktemp("nats-ctl"), host=net["ctl"].address)
    with net["ctl"].inside():  # NatsServer starts its own child: it lands on host ctl
        server.start()
    try:
        yield server
    finally:
        server.stop()


def start(host: Host, module: str, *args: str, **env: str) -> subprocess.Popen[str]:
    return host.popen(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env=host.env(**env),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def read_line(proc: subprocess.Popen[str], timeout_s: float = 30.0) -> str:
    """The process's next stdout line; fails the test rather than hang on a silent one."""
    done: list[str] = []
    thread = threading.Thread(target=lambda: done.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    thread.start()
    thread.join(timeout_s)
    assert done and done[0], f"nothing printed within {timeout_s}s (exit code {proc.poll()})"
    return done[0].strip()


def ask(proc: subprocess.Popen[str], line: str) -> dict[str, Any]:
    proc.stdin.write(line + "\n")  # type: ignore[union-attr]
    proc.stdin.flush()  # type: ignore[union-attr]
    return json.loads(read_line(proc))


def wait_until(check: Callable[[], bool], timeout_s: float) -> None:
    """Until `check()` is true; each check bounds its own wait (a round trip's timeout)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition never became true"


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def can_connect(host: Host, address: str, port: int) -> bool:
    return host.run([sys.executable, "-c", PROBE, address, str(port)], check=False).returncode == 0


def test_hosts_meet_over_the_bridge_and_keep_their_loopback(
    net: HostNetwork, nats_on_ctl: NatsServer, subject_root: str
):
    url = nats_on_ctl.url
    assert url.startswith(f"nats://{net['ctl'].address}:")
    # The subnet is the whole of a host's world: no default route, nothing else to reach.
    assert net["a"].run(["ip", "-4", "route"]).stdout.split()[0] == str(net.subnet)
    echo = start(net["b"], "tests.faults.host_peer", "echo", url, subject_root)
    client = start(net["a"], "tests.faults.host_peer", "client", url, subject_root)
    listener = net["ctl"].popen(
        [sys.executable, "-c", LISTEN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert read_line(echo) == "ready"
        assert read_line(client) == "ready"
        assert ask(client, "roundtrip 10") == {"ok": True}  # a -> ctl -> b -> ctl -> a
        # ctl's 127.0.0.1 is ctl's: reached from ctl, refused on a (a's own loopback).
        port = int(read_line(listener))
        assert can_connect(net["ctl"], "127.0.0.1", port)
        assert not can_connect(net["a"], "127.0.0.1", port)
        assert not ask(client, f"connect nats://127.0.0.1:{nats_on_ctl.port} 1")["ok"]
    finally:
        for proc in (echo, client, listener):
            stop(proc)


def test_a_cut_host_loses_its_connection_and_gets_it_back(
    net: HostNetwork, nats_on_ctl: NatsServer, subject_root: str
):
    url = nats_on_ctl.url
    echo = start(net["b"], "tests.faults.host_peer", "echo", url, subject_root)
    client = start(net["a"], "tests.faults.host_peer", "client", url, subject_root)
    try:
        assert read_line(echo) == "ready"
        assert read_line(client) == "ready"
        assert ask(client, "roundtrip 10") == {"ok": True}
        net["a"].cut()
        try:
            assert ask(client, "roundtrip 1") == {"ok": False}
            assert not ask(client, f"connect {url} 1")["ok"]
        finally:
            net["a"].restore()
        # Nothing was reset: TCP retransmits what waited, and the same connection works.
        wait_until(lambda: ask(client, "roundtrip 1")["ok"], timeout_s=60.0)
        assert ask(client, f"connect {url} 10") == {"ok": True}
    finally:
        net["a"].restore()
        stop(echo)
        stop(client)


def test_kv_moves_between_hosts_over_tcp(
    net: HostNetwork, nats_on_ctl: NatsServer, subject_root: str, tmp_path: Path
):
    """prefill on host a writes 100 blocks into decode's region on host b (a scatter) with
    the project's KvTransferAgent; UCX's own protocol tables say it used TCP on the hosts'
    interface, and the hosts' cables carried the bytes."""
    common = [nats_on_ctl.url, subject_root]
    blocks = (str(NUM_BLOCKS), str(BLOCK_NBYTES), "kv:req-42")
    # UCX's tables go to a file per process: stdout is the peers' line protocol.
    ucx = {"UCX_PROTO_INFO": "y", "UCX_LOG_FILE": str(tmp_path / "ucx.%p.log")}
    peer = "tests.service.kv_transfer_peer"
    receiver = start(net["b"], peer, "receive", *common, "decode-1", *blocks, **ucx)
    sender = start(net["a"], peer, "send", *common, "decode-1", *blocks, **ucx)
    try:
        assert read_line(receiver) == "ready"
        assert read_line(sender) == "ready"
        received, sent = net["b"].bytes_received(), net["a"].bytes_sent()
        sender.stdin.write("go\n")  # type: ignore[union-attr]
        sender.stdin.flush()  # type: ignore[union-attr]
        report = json.loads(read_line(sender))
        assert report["sent"] == NUM_BLOCKS * BLOCK_NBYTES
        verdict = json.loads(read_line(receiver))
        assert verdict == {"sender": report["agent"], "message": "kv:req-42", "ok": True}
        assert sender.wait(timeout=20) == 0
        assert receiver.wait(timeout=20) == 0
        assert net["b"].bytes_received() - received >= NUM_BLOCKS * BLOCK_NBYTES
        assert net["a"].bytes_sent() - sent >= NUM_BLOCKS * BLOCK_NBYTES
    finally:
        stop(sender)
        stop(receiver)
    tables = proto_info((tmp_path / f"ucx.{sender.pid}.log").read_text())
    writes = [
        t
        for t in tables
        if "inter-node" in t.endpoint and t.operation.startswith("remote memory write")
    ]
    assert writes, f"no inter-node write protocol in UCX's tables: {tables}"
    assert {lane for t in writes for lane in t.transports} == {f"tcp/{net['a'].interface}"}
    for log in tmp_path.glob("ucx.*.log"):  # neither side took the other for a local peer
        assert not [t for t in proto_info(log.read_text()) if "intra-node" in t.endpoint]


def test_close_removes_namespaces_veths_and_bridge():
    network = HostNetwork(["x", "y"]).start()
    namespaces = [host.namespace for host in network.hosts.values()]
    links = [network.bridge, *(host.veth for host in network.hosts.values())]
    sleeper = network["x"].popen(["sleep", "600"])
    assert set(namespaces) <= set(run_names()[0])
    assert set(links) <= set(run_names()[1])
    network.close()
    assert sleeper.poll() is not None
    assert not set(namespaces) & set(ip_names("netns", "list"))
    assert not set(links) & set(ip_names("link"))
    network.close()  # again: nothing left to do


def test_what_a_killed_run_left_is_removed_by_the_next():
    script = (
        "import sys; from shared.testing.hosts import HostNetwork; "
        "net = HostNetwork(['x']).start(); net['x'].popen(['sleep', '600']); "
        "print(net.run_id, flush=True); sys.stdin.read()"
    )
    killed = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        run_id = read_line(killed)
    finally:
        stop(killed)  # SIGKILL: no close(), no atexit
    assert [n for n in run_names()[0] if run_id in n]
    assert [n for n in run_names()[1] if run_id in n]
    remove_stale()
    assert not [n for n in ip_names("netns", "list") + ip_names("link") if run_id in n]


def ip_names(*args: str) -> list[str]:
    """First word of each line of `ip ARGS` (brief form): namespace or interface names."""
    out = subprocess.run(["ip", "-br", *args], capture_output=True, text=True, check=True).stdout
    return [line.split()[0].split("@")[0] for line in out.splitlines() if line.strip()]
