"""Separate 'hosts' on one machine for the fault tests: Linux network namespaces on a bridge.

A host is a network namespace with its own stack: `lo` (its own 127.0.0.1, which no other
host reaches), one interface `kvnet0` with an address on a private /24, and nothing else: no
route out, no IPv6, so its processes reach the other hosts of the run and nothing more. The
hosts' cables (veth pairs) meet on a bridge of the run's own, which has no address: the
machine itself is on none of these networks.

A host is not a machine: all hosts share the kernel, the filesystem (a directory is the
distributed file system's stand-in), the PID space and /dev/shm. So UCX could move KV between
two hosts through shared memory or CMA and never touch the network; the tests pin it to TCP
(`UCX_TLS=tcp`) and check which transport it used.

    with HostNetwork(["ctl", "a", "b"]) as net:
        proc = net["a"].popen([sys.executable, "-c", "..."])  # runs inside host a
        net["a"].cut()       # its cable pulled: peers find out by timeouts, as on a network
        net["a"].restore()

Names start with `kvh` and carry the creating process's pid, so `remove_stale()` (run by
every `start()`) finds and removes what a killed run left behind. `close()` (also at exit)
kills what the hosts still run and removes namespaces, veths and the bridge.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ipaddress
import itertools
import os
import random
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from shared.natsd import die_with_parent

PREFIX = "kvh"
_NETWORK_NUMBERS = itertools.count()  # this process's networks, in order
HOST_INTERFACE = "kvnet0"  # inside each host's namespace, so the same name on every host
_NETNS_DIR = Path("/run/netns")
_CLONE_NEWNET = 0x40000000
_STOP_TIMEOUT_S = 10.0


class HostNetworkError(RuntimeError):
    pass


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (for a test's skip), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` is unavailable: {probe.stderr.strip()}"
    return None


def _ip(*args: str, namespace: str | None = None, check: bool = True) -> str:
    command = ["ip", *(["-n", namespace] if namespace else []), *args]
    done = subprocess.run(command, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise HostNetworkError(f"{' '.join(command)}: {done.stderr.strip()}")
    return done.stdout


def _pid_is_alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def _owner_pid(name: str) -> int | None:
    """The pid of the run that made `name` (kvh<6 hex pid><2 hex>...), None if not ours."""
    if not name.startswith(PREFIX):
        return None
    try:
        return int(name[len(PREFIX) : len(PREFIX) + 6], 16)
    except ValueError:
        return None


def _namespace_pids(namespace: str) -> list[int]:
    return [int(p) for p in _ip("netns", "pids", namespace, check=False).split()]


def _kill_namespace(namespace: str) -> None:
    """SIGKILL whatever still runs in it: a live process keeps the namespace (and its veth)
    alive after its name is deleted."""
    deadline = time.monotonic() + _STOP_TIMEOUT_S
    while pids := _namespace_pids(namespace):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise HostNetworkError(f"processes {pids} in {namespace} survive SIGKILL")
        time.sleep(0.01)


def _links() -> list[str]:
    return [line.split()[0].split("@")[0] for line in _ip("-br", "link").splitlines() if line]


def run_names() -> tuple[list[str], list[str]]:
    """(namespaces, links) of every run, live or dead: what `ip` shows with our prefix."""
    namespaces = [line.split()[0] for line in _ip("netns", "list").splitlines() if line]
    links = [name for name in _links() if name.startswith(PREFIX)]
    return [n for n in namespaces if n.startswith(PREFIX)], links


def remove_stale() -> list[str]:
    """Remove the namespaces and links of runs whose process is gone (by the pid in their
    names; a reused pid keeps them until it ends too); what was removed."""
    removed = []
    for namespace in run_names()[0]:
        pid = _owner_pid(namespace)
        if pid is not None and not _pid_is_alive(pid):
            _kill_namespace(namespace)
            _ip("netns", "delete", namespace, check=False)
            removed.append(namespace)
    # A veth goes with its namespace (its teardown is asynchronous); the bridge is left.
    for link in run_names()[1]:
        pid = _owner_pid(link)
        if pid is not None and not _pid_is_alive(pid):
            _ip("link", "delete", link, check=False)
            removed.append(link)
    return removed


def _free_subnet() -> ipaddress.IPv4Network:
    """A random 10.x.y.0/24 that no address or route of this machine overlaps."""
    used = [
        ipaddress.ip_interface(word).network
        for word in _ip("-4", "-o", "addr").split()
        if "/" in word and word[0].isdigit()
    ]
    for line in _ip("-4", "route").splitlines():
        first = line.split()[0] if line else ""
        if first[:1].isdigit():
            used.append(ipaddress.ip_network(first, strict=False))
    for _ in range(1000):
        subnet = ipaddress.ip_network(f"10.{random.randrange(256)}.{random.randrange(256)}.0/24")
        if not any(subnet.overlaps(network) for network in used):
            return subnet
    raise HostNetworkError("no free 10.x.y.0/24 on this machine")


def _setns(fd: int) -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise HostNetworkError(f"setns failed: {os.strerror(errno)}")


class Host:
    """One namespace on the run's bridge. Made by `HostNetwork`."""

    def __init__(self, name: str, namespace: str, veth: str, address: str) -> None:
        self.name = name
        self.namespace = namespace
        self.veth = veth  # the cable's end on the bridge, in the machine's namespace
        self.address = address
        self.interface = HOST_INTERFACE
        self._processes: list[subprocess.Popen[Any]] = []

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a kvfabric process on this host: the host's name as its node id
        (every host has the machine's hostname) and KV over TCP (between two namespaces UCX
        otherwise moves it with CMA: measured, an `intra-node` endpoint on `cma/memory`)."""
        return {**os.environ, "KVF_NODE_ID": self.name, "UCX_TLS": "tcp", **extra}

    def bytes_received(self) -> int:
        """What came in over the host's cable (its bridge end's transmitted bytes)."""
        return int(Path(f"/sys/class/net/{self.veth}/statistics/tx_bytes").read_text())

    def bytes_sent(self) -> int:
        return int(Path(f"/sys/class/net/{self.veth}/statistics/rx_bytes").read_text())

    def command(self, args: Sequence[str]) -> list[str]:
        """`args` run inside this host. `ip netns exec` execs them in place (same pid, no
        intermediate process) and mounts a /sys of the namespace, where UCX finds its
        interfaces."""
        return ["ip", "netns", "exec", self.namespace, *args]

    def popen(self, args: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start `args` inside this host; stopped by `close()` if still running. By default
        the kernel SIGTERMs it when the thread that started it ends (a killed test run leaves
        no orphan): start it from a thread that lives as long as it, not from to_thread."""
        popen_kwargs.setdefault("preexec_fn", die_with_parent)
        process = subprocess.Popen(self.command(args), **popen_kwargs)
        self._processes.append(process)
        return process

    def run(
        self, args: Sequence[str], *, timeout_s: float = 30.0, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run `args` inside this host to completion: its stdout and stderr as text."""
        return subprocess.run(
            self.command(args),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=check,
            preexec_fn=die_with_parent,
        )

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        """The calling thread's network is this host's while inside: for code that starts its
        child itself (`NatsServer.start()`). Such a child sees the machine's /sys, so UCX in
        it would find the wrong interfaces: start those with `popen`. Do not await inside."""
        with (
            open("/proc/thread-self/ns/net", "rb") as own,
            open(_NETNS_DIR / self.namespace, "rb") as target,
        ):
            _setns(target.fileno())
            try:
                yield
            finally:
                _setns(own.fileno())

    def cut(self) -> None:
        """Pull the host's cable: its packets are dropped, nothing is reset; peers and the
        host find out by timeouts, as when a machine drops off a network."""
        _ip("link", "set", self.veth, "down")

    def restore(self) -> None:
        _ip("link", "set", self.veth, "up")

    def stop_processes(self) -> None:
        """SIGTERM what `popen` started, SIGKILL what is left after a grace period."""
        processes, self._processes = self._processes, []
        for process in processes:
            if process.poll() is None:
                process.terminate()
        for process in processes:
            try:
                process.wait(timeout=_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


class HostNetwork:
    """Named hosts on a bridge of their own; `with` (or `start()`/`close()`) around a test."""

    def __init__(self, names: Sequence[str]) -> None:
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"host names must be distinct and at least one: {names}")
        if not all(re.fullmatch(r"[a-z0-9][a-z0-9-]*", name) for name in names):
            raise ValueError(f"host names are lowercase letters, digits and '-': {names}")
        if len(names) > 99:
            raise ValueError("at most 99 hosts (interface names are limited to 15 characters)")
        # kvh + pid + this process's network count (2 hex): `remove_stale` reads the pid
        # back; 14 characters at most. A count, not a random byte: two networks one process
        # holds at once never share a name (a random byte collided, 1 in 256).
        self.run_id = f"{os.getpid():06x}{next(_NETWORK_NUMBERS) % 256:02x}"
        self.bridge = f"{PREFIX}{self.run_id}br"
        self.names = list(names)
        self.subnet: ipaddress.IPv4Network | None = None
        self.hosts: dict[str, Host] = {}
        self._started = False

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def start(self) -> HostNetwork:
        reason = unavailable_reason()
        if reason:
            raise HostNetworkError(reason)
        remove_stale()
        self._started = True
        atexit.register(self.close)  # a failing test or an interrupted run cleans up too
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def _create(self) -> None:
        self.subnet = _free_subnet()
        # addrgenmode none: no IPv6 link-local address, so IPv4 on this subnet is the only way
        # between hosts, and the machine's own namespace has no address on the bridge.
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "addrgenmode", "none")  # before up, or it has one
        _ip("link", "set", self.bridge, "up")
        for index, name in enumerate(self.names):
            namespace = f"{PREFIX}{self.run_id}-{name}"
            address = str(self.subnet.network_address + index + 1)
            host = Host(name, namespace, f"{PREFIX}{self.run_id}v{index}", address)
            self.hosts[name] = host
            _ip("netns", "add", namespace)
            peer = ("peer", "name", HOST_INTERFACE, "netns", namespace)
            _ip("link", "add", host.veth, "type", "veth", *peer)
            _ip("link", "set", host.veth, "master", self.bridge, "addrgenmode", "none")
            _ip("link", "set", host.veth, "up")
            _ip("link", "set", "lo", "up", namespace=namespace)
            _ip("link", "set", HOST_INTERFACE, "addrgenmode", "none", namespace=namespace)
            prefix = f"{host.address}/{self.subnet.prefixlen}"
            _ip("addr", "add", prefix, "dev", HOST_INTERFACE, namespace=namespace)
            _ip("link", "set", HOST_INTERFACE, "up", namespace=namespace)

    def close(self) -> None:
        """Stop the hosts' processes, remove namespaces, veths and the bridge. Safe to call
        twice; what is already gone is skipped."""
        if not self._started:
            return
        self._started = False
        atexit.unregister(self.close)
        for host in self.hosts.values():
            host.stop_processes()
        for host in self.hosts.values():
            if (_NETNS_DIR / host.namespace).exists():
                _kill_namespace(host.namespace)
            # Deleting the veth removes both ends now; a namespace's teardown is asynchronous.
            _ip("link", "delete", host.veth, check=False)
            _ip("netns", "delete", host.namespace, check=False)
        _ip("link", "delete", self.bridge, check=False)

    def __enter__(self) -> HostNetwork:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()
