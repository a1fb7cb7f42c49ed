"""`kvfabric up` as a subprocess: comes up listing every process's metrics URL, `kvfabric
status` lists all seven services with those URLs, and SIGINT stops everything it started (no
child process left behind). The mock engine where the model is beside the point; `kvfabric
demo`'s test runs both real models."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.subjects import SERVICES, VLLM_WORKER
from shared.testing import unique_root

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
KVFABRIC = str(Path(sys.executable).parent / "kvfabric")
JSON = "application/json"


def _read_until_ready(process: subprocess.Popen[str], timeout_s: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    assert process.stdout is not None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if line.startswith("ready"):
            return lines
    raise AssertionError("kvfabric up never became ready:\n" + "\n".join(lines))


def _read_until(process: subprocess.Popen[str], marker: str, timeout_s: float) -> str:
    """The launcher's output up to the line holding `marker`."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    assert process.stdout is not None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if marker in line:
            return "\n".join(lines)
    raise AssertionError(f"no {marker!r} from kvfabric up:\n" + "\n".join(lines))


def _post(url: str, body: dict, key: str) -> dict:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"authorization": f"Bearer {key}", "content-type": JSON},
    )
    return json.loads(urllib.request.urlopen(request, timeout=60).read())


def _get_until(url: str, key: str, timeout_s: float = 30.0) -> dict:
    """GET `url`'s JSON once it is there (a request's explanation is kept in the background
    after its answer); a 404 past `timeout_s` is raised."""
    deadline = time.monotonic() + timeout_s
    while True:
        request = urllib.request.Request(url, headers={"authorization": f"Bearer {key}"})
        try:
            return json.loads(urllib.request.urlopen(request, timeout=60).read())
        except urllib.error.HTTPError as exc:
            if exc.code != 404 or time.monotonic() > deadline:
                raise
        time.sleep(0.1)


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it has exited and only waits to be reaped.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


def test_up_status_and_clean_stop(tmp_path: Path) -> None:
    root = unique_root()
    up = subprocess.Popen(
        [
            KVFABRIC,
            "up",
            "--engine",
            "mock",
            "--nats-port",
            "0",
            "--http-port",
            "0",
            "--state-dir",
            str(tmp_path),
            "--root",
            root,
            "--replicas",
            "prefill=2,decode=2",
            "--shutdown-grace-s",
            "5",
            "--models",
            "tiny-coder",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = _read_until_ready(up, timeout_s=120)
        text = "\n".join(lines)
        nats_url = re.search(r"nats-server\s+(nats://\S+)", text).group(1)
        http_url = re.search(r"HTTP API\s+(http://\S+)", text).group(1).rstrip(",")
        pids = [int(p) for p in re.findall(r"pid (\d+)", text)]
        assert len(pids) == 1 + 9  # nats-server + 7 services, two of them with 2 replicas

        health = json.loads(urllib.request.urlopen(f"{http_url}/health", timeout=5).read())
        assert health["status"] == "ok"
        listed = dict(re.findall(r"^metrics\s+(\S+)\s+(http://\S+/metrics)$", text, re.M))
        assert len(listed) == 9  # one per process
        scrape = urllib.request.urlopen(listed["router-0"], timeout=5).read().decode()
        assert 'kvfabric_router_decisions_total{instance="router-0"' in scrape

        # Its servers take only clients with credentials; the admin's are printed.
        creds = re.search(r"export KVF_NATS_CREDS=(\S+)", text).group(1)
        assert Path(creds) == (tmp_path / "nats-creds" / "admin.nk").resolve()
        assert Path(creds).stat().st_mode & 0o777 == 0o600
        admin = os.environ | {"KVF_NATS_CREDS": creds}
        where = ["--nats-url", nats_url, "--root", root]
        anonymous = subprocess.run(
            [KVFABRIC, "keys", "list", *where],
            env={k: v for k, v in os.environ.items() if k != "KVF_NATS_CREDS"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert anonymous.returncode != 0
        assert "refused the connection" in anonymous.stderr and "Traceback" not in anonymous.stderr
        # A user's credentials (role client) serve requests but may not manage keys: the
        # server refuses the write to the keys bucket.
        client = os.environ | {"KVF_NATS_CREDS": str(tmp_path / "nats-creds" / "client.nk")}
        refused = subprocess.run(
            [KVFABRIC, "keys", "create", "--account", "mallory", *where],
            env=client,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert refused.returncode != 0
        assert "refused by NATS: nats: permissions violation" in refused.stderr, refused.stderr
        # The admin's can; the audit log names who did it (the refused attempt wrote none).
        created = subprocess.run(
            [KVFABRIC, "keys", "create", "--account", "acme", "--name", "ops", *where],
            env=admin,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        key_id = created.split()[0]
        audit = subprocess.run(
            [KVFABRIC, "audit", *where, "--format", "json"],
            env=admin,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        entries = json.loads(audit.stdout)
        assert [(e["action"], e["target"], e["outcome"]) for e in entries] == [
            ("keys.create", "acme", f"ok {key_id}")
        ]
        assert "(nkey U" in entries[0]["actor"] and entries[0]["detail"]["name"] == "ops"

        # Why a request missed the cache: to its own account over HTTP, to the admin with
        # `kvfabric cache explain`; acme's cache is isolated, so no text of it is kept.
        key = created.split(": ", 1)[1].strip()
        other = (
            subprocess.run(
                [KVFABRIC, "keys", "create", "--account", "globex", *where],
                env=admin,
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            )
            .stdout.split(": ", 1)[1]
            .strip()
        )
        asked = _post(
            f"{http_url}/v1/chat/completions",
            {"model": "tiny-coder", "messages": [{"role": "user", "content": "hi"}]},
            key,
        )
        told = asked["usage"]["kvfabric_cache"]
        assert told["cause"] == "never_seen"
        explained = _get_until(f"{http_url}/v1/kvfabric/cache/explain/{asked['id']}", key)
        assert explained["cause"] == "never_seen" and explained["account"] == "acme"
        assert (explained["has_text"], explained["before"], explained["after"]) == (False, "", "")
        assert explained["first_miss_token"] == told["first_miss_token"]
        with pytest.raises(urllib.error.HTTPError) as hidden:
            _get_until(f"{http_url}/v1/kvfabric/cache/explain/{asked['id']}", other, 0)
        assert hidden.value.code == 404  # another account's is as absent as none
        printed = subprocess.run(
            [KVFABRIC, "cache", "explain", asked["id"], *where],
            env=admin,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        assert "cause    never_seen" in printed and "account acme" in printed
        assert "not kept: the account's cache is isolated" in printed

        status = subprocess.run(
            [KVFABRIC, "status", "--nats-url", nats_url, "--root", root, "--format", "json"],
            env=admin,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        instances = json.loads(status.stdout)
        # Every service but vllm-worker (`up --engine vllm` runs those instead of the others).
        assert sorted({i["service"] for i in instances}) == sorted(set(SERVICES) - {VLLM_WORKER})
        counts = {s: sum(i["service"] == s for i in instances) for s in SERVICES}
        assert counts["prefill"] == 2 and counts["decode"] == 2
        assert all(i["load"]["state"] == "serving" for i in instances)
        assert {i["instance_id"]: i["metadata"]["metrics_url"] for i in instances} == listed
        assert all("kvfabric_inflight_requests" in i["metrics"] for i in instances)

        table = subprocess.run(
            [KVFABRIC, "status", "--nats-url", nats_url, "--root", root],
            env=admin,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        assert "swa-memcache-0" in table and "INFLIGHT" in table
        assert "METRICS" in table and listed["swa-memcache-0"] in table

        # kill -9 of a service: the launcher starts it again and the rest serve on.
        billing_pid = int(re.search(r"billing-0 pid (\d+)", text).group(1))
        os.kill(billing_pid, signal.SIGKILL)
        said = _read_until(up, "supervisor    billing-0 restarted", timeout_s=60)
        assert "billing-0 exited with code -9 (killed by SIGKILL); restarting in 0.5s" in said
        launcher_metrics = re.search(r"metrics\s+launcher\s+(http://\S+)", said).group(1)
        scrape = urllib.request.urlopen(launcher_metrics, timeout=5).read().decode()
        assert 'kvfabric_supervisor_restarts_total{instance="launcher",instance_id="billing-0"' in (
            scrape
        )
        assert re.search(r'restarts_total\{[^}]*instance_id="billing-0"[^}]*\} 1\.0', scrape)
        table = subprocess.run(
            [KVFABRIC, "status", "--nats-url", nats_url, "--root", root, "--state-dir", tmp_path],
            env=admin,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        assert re.search(r"^billing-0\s+running\s+1\s+-9\s+", table, re.M), table
        pids.append(int(re.search(r"billing-0 restarted \(pid (\d+)\)", said).group(1)))

        up.send_signal(signal.SIGINT)
        rest, _ = up.communicate(timeout=120)
        assert up.returncode == 0, rest
        assert "stopped nats-server" in rest
        # Stopped in order: ingress first, kv-index last, then the server.
        order = re.findall(r"stopped (\S+)", rest)
        assert order[0] == "ingress-0" and order[-2] == "kv-index-0" and order[-1] == "nats-server"
        assert [pid for pid in pids if _is_alive(pid)] == []
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def test_up_with_tls_takes_only_tls_clients_with_credentials(tmp_path: Path) -> None:
    """`--nats-tls`: the embedded server's certificate comes from a private CA made under the
    state dir; a client that trusts it and has credentials is served, one that connects
    without TLS, or without trusting the CA, is refused; the cluster serves requests."""
    root = unique_root()
    up = subprocess.Popen(
        [KVFABRIC, "up", "--engine", "mock", "--nats-tls", "--nats-port", "0", "--http-port"]
        + ["0", "--state-dir", str(tmp_path), "--root", root, "--models", "tiny-coder"]
        + ["--dev-api-key", "kvf-dev-tls-0123456789"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        text = "\n".join(_read_until_ready(up, timeout_s=120))
        url = re.search(r"nats-server\s+(\S+)", text).group(1)
        assert url.startswith("tls://")
        ca = re.search(r"export KVF_NATS_TLS_CA=(\S+)", text).group(1)
        assert Path(ca) == (tmp_path / "nats-tls" / "ca.pem").resolve()
        creds = re.search(r"export KVF_NATS_CREDS=(\S+)", text).group(1)
        http_url = re.search(r"HTTP API\s+(http://\S+)", text).group(1)
        request = urllib.request.Request(
            f"{http_url}/v1/chat/completions",
            data=json.dumps(
                {"model": "tiny-coder", "messages": [{"role": "user", "content": "hi"}]}
            ).encode(),
            headers={"authorization": "Bearer kvf-dev-tls-0123456789", "content-type": JSON},
        )
        reply = json.loads(urllib.request.urlopen(request, timeout=30).read())
        assert reply["usage"]["completion_tokens"] > 0

        def status(nats_url: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [KVFABRIC, "status", "--nats-url", nats_url, "--root", root, "--format", "json"],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )

        clean = {k: v for k, v in os.environ.items() if not k.startswith("KVF_NATS_")}
        trusted = status(url, clean | {"KVF_NATS_CREDS": creds, "KVF_NATS_TLS_CA": ca})
        assert trusted.returncode == 0, trusted.stderr
        assert len(json.loads(trusted.stdout)) == 7
        plain = status(url.replace("tls://", "nats://"), clean | {"KVF_NATS_CREDS": creds})
        assert plain.returncode != 0 and "Traceback" not in plain.stderr + plain.stdout
        untrusted = status(url, clean | {"KVF_NATS_CREDS": creds})
        assert untrusted.returncode != 0 and "is not trusted" in untrusted.stderr
        up.send_signal(signal.SIGINT)
        rest, _ = up.communicate(timeout=120)
        assert up.returncode == 0, rest
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


@pytest.mark.faults  # a fault: `make faults` runs it
def test_a_killed_launcher_leaves_no_process_behind(tmp_path: Path) -> None:
    """SIGKILL gives `kvfabric up` no chance to stop anything: the kernel ends its children
    (PR_SET_PDEATHSIG), the nats-server among them."""
    up = subprocess.Popen(
        [
            KVFABRIC,
            "up",
            "--engine",
            "mock",
            "--nats-port",
            "0",
            "--http-port",
            "0",
            "--state-dir",
            str(tmp_path),
            "--root",
            unique_root(),
            "--models",
            "tiny-coder",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        text = "\n".join(_read_until_ready(up, timeout_s=120))
        pids = [int(p) for p in re.findall(r"pid (\d+)", text)]
        server_pid = int(re.search(r"nats-server\s.*pid (\d+)", text).group(1))
        assert len(pids) == 8 and server_pid in pids
    finally:
        up.kill()
        up.wait()
    deadline = time.monotonic() + 30
    while (alive := [pid for pid in pids if _is_alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert alive == [], f"outlived the launcher: {alive}"


def test_up_rejects_a_bad_replica_spec(tmp_path: Path) -> None:
    result = subprocess.run(
        [KVFABRIC, "up", "--replicas", "prefil=2", "--state-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=os.environ | {"COLUMNS": "300"},
    )
    assert result.returncode == 2
    message = " ".join(result.stderr.replace("│", " ").split())
    assert "'prefil=2'" in message and "expected <service>=<count>" in message


def test_serve_rejects_bad_config() -> None:
    result = subprocess.run(
        [KVFABRIC, "serve", "router", "--heartbeat-s", "soon"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--heartbeat-s='soon'" in result.stderr


def test_demo_serves_requests_and_stops(tmp_path: Path) -> None:
    """`make demo`'s command: the cluster comes up with both models, answers health, SmolLM2
    answers a coding question and then the agent's second turn (the conversation and a
    tool's output) mostly from the store, then everything it started stops."""
    result = subprocess.run(
        [KVFABRIC, "demo", "--state-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    out = result.stdout
    assert '"status": "ok"' in out
    turns = re.findall(
        r"chat/completions turn (\d): (\d+) prompt tokens, (\d+) from the store, (\d+) generated",
        out,
    )
    assert [t[0] for t in turns] == ["1", "2"], out[-3000:]
    (_, _, cold, made), (_, prompt, cached, _) = turns
    assert cold == "0" and int(made) > 0
    assert int(cached) >= int(prompt) // 2  # turn 2 re-sends turn 1's prompt and answer
    assert "def is_palindrome" in out  # a real answer to the question, not noise
    assert re.search(r"turn 2's prompt computed cold \d+ ms", out)
    assert "decode-smollm2-0" in out and "decode-tiny-coder-0" in out
    assert out.rstrip().endswith("stopped nats-server")
    pids = [int(p) for p in re.findall(r"pid (\d+)", out)]
    assert len(pids) == 10 and not [pid for pid in pids if _is_alive(pid)]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 MiB tmpfs: a disk whose free space is far below kv-index's 1 GiB event log."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


ONLY_KV_INDEX = "router=0,prefill=0,decode=0,billing=0,ingress=0,swa-memcache=0"


@pytest.mark.parametrize("store_gib", ["64", "0"])
def test_up_starts_on_a_disk_with_little_free_space(small_disk: Path, store_gib: str) -> None:
    """The embedded server's JetStream ceiling is stated (--nats-max-store-gib, 64 by default),
    not 75% of the disk's free space at start: a disk short of room no longer refuses
    kv-index's event log at start-up. 0 keeps the server's default, which refuses it here."""
    up = subprocess.Popen(
        [
            KVFABRIC,
            "up",
            "--engine",
            "mock",
            "--nats-port",
            "0",
            "--http-port",
            "0",
            "--state-dir",
            str(small_disk),
            "--root",
            unique_root(),
            "--replicas",
            ONLY_KV_INDEX,
            "--nats-max-store-gib",
            store_gib,
            "--shutdown-grace-s",
            "3",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        if store_gib == "0":
            output, _ = up.communicate(timeout=120)
            assert up.returncode != 0
            assert "insufficient storage resources available" in output
        else:
            text = "\n".join(_read_until_ready(up, timeout_s=120))
            assert "kv-index-0" in text
            assert (
                "max_file_store: 68719476736" in (small_disk / "nats/nats-server.conf").read_text()
            )
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            up.communicate(timeout=60)
