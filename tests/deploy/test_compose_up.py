"""compose/ serves, for real: the images deploy/images/build.sh made, started by podman-compose
with the secrets compose/prepare.sh makes. Both ingresses answer an SDK's two turns (the second
a cache hit), every instance compose starts is in the cluster's own registry and up in
Prometheus, every stream is kept on the three NATS servers, one server killed leaves the
cluster serving, and the ledger in PostgreSQL counts each request once.

`make compose` installs podman, builds the images from an empty store and runs this; the test
fails (does not skip) where the images are missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest
import yaml

from shared.natsd import free_port
from shared.subjects import SERVICES, VLLM_WORKER

pytestmark = [pytest.mark.compose, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "compose" / "compose.yaml"
CONTAINERS_CONF = REPO / "deploy" / "images" / "containers.conf"
PODMAN_COMPOSE = str(Path(sys.executable).parent / "podman-compose")  # the dev extra's
PROJECT = "kvfabric-test"
MODEL = "tiny-coder"
T = TypeVar("T")


def podman_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF), **extra}


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> str:
    done = subprocess.run(
        args, env=env or podman_env(), capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{' '.join(args)}: {done.returncode}\n{done.stdout}{done.stderr}"
    return done.stdout


def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float) -> T:
    """`probe()`'s first truthy value; fails naming `what` (and the last error) past the
    deadline. Containers start in their own time and podman runs no health checks."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            value = probe()
        except Exception as exc:  # not up yet: connection refused, not serving, ...
            last = exc
        else:
            if value:
                return value
            last = value
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout_s:.0f}s (last: {last!r})")


def kvfabric_services() -> dict[str, dict[str, Any]]:
    """compose's kvfabric containers (those that run `kvfabric serve`): name -> definition."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    return {n: s for n, s in services.items() if s.get("command", [None])[0] == "serve"}


def instance_id(service: dict[str, Any]) -> str:
    return service["environment"]["KVF_INSTANCE_ID"]


class Compose:
    def __init__(self, ports: dict[str, int]) -> None:
        self.ports = ports
        self.env = podman_env(
            KVF_HTTP_PORT=str(ports["ingress-0"]),
            KVF_HTTP_PORT_2=str(ports["ingress-1"]),
            KVF_PROMETHEUS_PORT=str(ports["prometheus"]),
        )

    def __call__(self, *args: str, timeout: float = 300) -> str:
        return run(
            PODMAN_COMPOSE, "-p", PROJECT, "-f", str(COMPOSE), *args, env=self.env, timeout=timeout
        )

    def container(self, service: str) -> str:
        return f"{PROJECT}_{service}_1"

    def exec(self, service: str, *args: str) -> str:
        return run("podman", "exec", self.container(service), *args)

    def admin(self, *args: str) -> str:
        """A kvfabric command with the admin role's seed, in a container of its own on
        compose's network (the NATS servers publish no port)."""
        seed = f"{REPO}/compose/secrets/nats/admin.nk:/run/secrets/admin.nk:ro"
        return run(
            "podman", "run", "--rm", "--network", f"{PROJECT}_default", "-v", seed,
            "-e", "KVF_NATS_CREDS=/run/secrets/admin.nk", "localhost/kvfabric:latest", *args,
        )  # fmt: skip

    def logs(self) -> str:
        names = run("podman", "ps", "-a", "--format", "{{.Names}} {{.Status}}")
        tails = [names]
        for line in names.splitlines():
            name = line.split()[0]
            if name.startswith(PROJECT):
                done = subprocess.run(
                    ["podman", "logs", "--tail", "15", name],
                    env=self.env, capture_output=True, text=True, timeout=30,
                )  # fmt: skip
                tails.append(f"--- {name}\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        return "\n".join(tails)


@pytest.fixture(scope="module")
def compose() -> Iterator[Compose]:
    for image in ("kvfabric", "kvfabric-postgres", "kvfabric-prometheus"):
        exists = subprocess.run(
            ["podman", "image", "exists", f"localhost/{image}:latest" if image == "kvfabric"
             else f"localhost/{image}:{version()}"],
            env=podman_env(), timeout=60,
        )  # fmt: skip
        assert exists.returncode == 0, f"no {image} image: run deploy/images/build.sh"
    run(str(REPO / "compose" / "prepare.sh"))
    cluster = Compose({name: free_port() for name in ("ingress-0", "ingress-1", "prometheus")})
    cluster("down", "-v", timeout=180)  # what an interrupted run left
    try:
        cluster("up", "-d")
        yield cluster
    except BaseException:
        print(cluster.logs())
        raise
    finally:
        cluster("down", "-v", timeout=300)


def version() -> str:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def dev_key() -> str:
    [line] = (REPO / "compose" / "secrets" / "ingress.env").read_text().split()
    return line.split("=", 1)[1]


def ready(port: int) -> bool:
    response = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2)
    return response.status_code == 200


def test_compose_serves_survives_a_nats_server_and_bills_each_request(compose: Compose) -> None:
    try:
        check_compose(compose)
    except BaseException:
        print(compose.logs())
        raise


def check_compose(compose: Compose) -> None:
    ingress_ports = [compose.ports["ingress-0"], compose.ports["ingress-1"]]
    for port in ingress_ports:
        wait_for(f"ingress on :{port} ready", lambda port=port: ready(port), 300)

    # Every kvfabric container is one instance of the cluster's registry, and compose runs
    # every service kind there is (vLLM workers replace prefill and decode: not here).
    expected = {instance_id(s) for s in kvfabric_services().values()}
    kinds = {s["command"][1] for s in kvfabric_services().values()}
    assert kinds == set(SERVICES) - {VLLM_WORKER}

    def registry() -> set[str] | None:
        status = compose.admin("status", "--nats-url", "nats://nats-1:4222", "--format", "json")
        found = {i["instance_id"] for i in json.loads(status) if i["load"]["state"] == "serving"}
        return found if found == expected else None

    wait_for("every instance serving in the registry", registry, 180)

    # Prometheus scrapes every one of them, and each is up.
    prometheus = f"http://127.0.0.1:{compose.ports['prometheus']}"

    def targets_up() -> set[str] | None:
        data = httpx.get(f"{prometheus}/api/v1/targets", timeout=5).json()["data"]
        up = {t["labels"]["instance"].split(":")[0] for t in data["activeTargets"]
              if t["health"] == "up"}  # fmt: skip
        return up if up == set(kvfabric_services()) else None

    wait_for("every kvfabric container up in Prometheus", targets_up, 60)

    # Every stream, key-value bucket and object store is kept on all three servers.
    jsz = compose.exec(
        "router-0", "python", "-c",
        "import urllib.request; print(urllib.request.urlopen("
        "'http://nats-1:8222/jsz?streams=true&config=true').read().decode())",
    )  # fmt: skip
    streams = [s for a in json.loads(jsz)["account_details"] for s in a["stream_detail"]]
    assert len(streams) >= 5
    assert {s["name"]: s["config"]["num_replicas"] for s in streams} == {
        s["name"]: 3 for s in streams
    }

    # An agent's two turns, one through each ingress: the second reads the first's prefix.
    key = dev_key()
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "You are a careful coding agent. " * 24},
        {"role": "user", "content": "Write a function that adds two numbers."},
    ]
    usages = []
    for port in ingress_ports:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key)
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12)
        usages.append(reply.usage)
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content or ""},
            {"role": "user", "content": "Now make it subtract."},
        ]
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    assert usages[1].prompt_tokens_details.cached_tokens >= 128, usages[1]

    # One NATS server killed: the cluster serves on (an SDK following the protocol's
    # Retry-After may retry a request caught on the lost connection).
    compose.exec("nats-3", "true")  # it runs before the kill
    run("podman", "kill", compose.container("nats-2"))
    num_after = 6
    for i in range(num_after):
        port = ingress_ports[i % 2]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, timeout=60)
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"ping {i}"}], max_tokens=4
        )
        assert reply.usage.completion_tokens >= 1

    # The ledger in PostgreSQL counts every request once: none dropped, none doubled.
    def ledgered() -> dict[str, Any] | None:
        report = compose.exec(
            "billing", "kvfabric", "billing", "report", "--format", "json",
            "--ledger-url", "postgresql://kvfabric@postgres:5432/kvfabric",
        )  # fmt: skip
        total = json.loads(report)["total"]
        return total if total["num_requests"] >= 2 + num_after else None

    total = wait_for("every request in the ledger", ledgered, 60)
    assert total["num_requests"] == 2 + num_after
    assert total["num_cache_hit_tokens"] >= usages[1].prompt_tokens_details.cached_tokens
