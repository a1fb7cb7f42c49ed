"""deploy/k8s renders (`kubectl kustomize`, offline) into objects Kubernetes' schemas accept,
and stays in step with the code: every service `kvfabric up` starts is one Deployment of
`kvfabric serve <service>`, probed, drained, disrupted and scaled as docs/deploy.md says,
setting only variables its config reads (with values it accepts); the NATS servers take
the seeds the generation step made, and no seed is committed. Static: no cluster here.

Needs `kubectl` (any recent one: `kubectl kustomize` is built in) and the dev extra
`kubernetes-validate` (the schemas, bundled: no network)."""

from __future__ import annotations

import base64
import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from services.admin.cli import drain
from services.admin.launcher import DEFAULT_REPLICAS, MODEL_WORKERS, START_ORDER, module_of
from shared import models
from shared.config import SHARED_ENV_PREFIX, ServiceConfig, load_config
from shared.nats_auth import ROLES, SEED_SUFFIX, permissions, public_key, seed_path
from shared.natsd import find_nats_server
from shared.subjects import (
    DECODE,
    INGRESS,
    PREFILL,
    ROUTER,
    SERVICES,
    SWA_MEMCACHE,
    VLLM_WORKER,
    Subjects,
)

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = ("cpu-dev", "gpu")
# The oldest Kubernetes the manifests claim (docs/deploy.md): nothing newer is used.
K8S_VERSION = "1.29"
# What `kvfabric up` starts by default; the gpu overlay adds the vLLM workers
# (components/vllm-worker), which `up` starts only with `--engine vllm`.
EXPECTED = {
    "cpu-dev": {s for s in START_ORDER if DEFAULT_REPLICAS.get(s, 1) > 0},
    "gpu": set(START_ORDER),
}
SCALED = {ROUTER, PREFILL, DECODE, INGRESS, VLLM_WORKER}  # the services with an HPA
# The node label docs/deploy.md documents, valued as terraform's cluster-plan names pools:
# where each service runs in the gpu overlay (the rest: anywhere).
NODE_POOL = "kvfabric.io/node-pool"
POOLS = {
    PREFILL: {"prefill"},  # the 8-GPU servers
    DECODE: {"decode"},  # the super-nodes' servers
    VLLM_WORKER: {"prefill", "decode"},
    SWA_MEMCACHE: {"prefill", "decode"},  # one a GPU node, beside the workers
}
GPU = "nvidia.com/gpu"
# Read outside the config classes (the model cache: shared/models.py), by the workers only.
PROCESS_ENV = {models.CACHE_ENV}
# SIGTERM: endpoints drained within shutdown_grace_s, then a usage outbox flushed within it
# again (ingress, decode, vLLM workers); this much more for closing NATS and the rest.
CLOSE_MARGIN_S = 10
# An nkey seed: 'S', its kind, base32 (a user's starts SU).
SEED = re.compile(r"\bS[A-Z][A-Z2-7]{50,}\b")
# A pod's values for the fields the manifests take from the downward API.
FIELD_VALUES = {"metadata.name": "{name}-5d8f9c7b6-x2x9k", "spec.nodeName": "node-1"}


# -- rendering ----------------------------------------------------------------------------
def run(args: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(args, capture_output=True, text=True, timeout=120, **kwargs)
    assert done.returncode == 0, f"{' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done


def kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        pytest.fail(
            "kubectl not found on PATH: deploy/k8s is rendered with `kubectl kustomize` "
            "(install kubectl; no cluster is needed)",
            pytrace=False,
        )
    return found


def copy_without_secrets(destination: Path) -> Path:
    """deploy/k8s as committed: whatever this checkout generated is left behind."""
    return Path(shutil.copytree(K8S, destination, ignore=shutil.ignore_patterns("secrets")))


@dataclasses.dataclass
class Rendered:
    overlay: str
    objects: list[dict[str, Any]]
    seeds_dir: Path  # where the generation step put this render's seeds

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def find(self, kind: str, name: str) -> dict[str, Any] | None:
        found = [o for o in self.of(kind) if o["metadata"]["name"] == name]
        assert len(found) <= 1, f"{len(found)} {kind}s named {name}"
        return found[0] if found else None

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = self.find(kind, name)
        assert found is not None, f"{self.overlay}: no {kind} {name!r} in the rendered output"
        return found

    def deployments(self) -> dict[str, dict[str, Any]]:
        return {d["metadata"]["name"]: d for d in self.of("Deployment")}


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of deploy/k8s after its documented generation step (generate-secrets.sh)."""
    kubectl()
    copy = copy_without_secrets(tmp_path_factory.mktemp("deploy") / "k8s")
    # The step runs `kvfabric` and `python3`: this environment's.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    run(["sh", str(copy / "generate-secrets.sh")], env={**os.environ, "PATH": path})
    return copy


@pytest.fixture(scope="module")
def rendered(generated: Path) -> dict[str, Rendered]:
    out = {}
    for overlay in OVERLAYS:
        text = run([kubectl(), "kustomize", str(generated / "overlays" / overlay)]).stdout
        objects = [o for o in yaml.safe_load_all(text) if o]
        out[overlay] = Rendered(overlay, objects, generated / "base" / "secrets" / "nats")
    return out


@pytest.fixture(params=OVERLAYS)
def r(request: pytest.FixtureRequest, rendered: dict[str, Rendered]) -> Rendered:
    return rendered[request.param]


# -- the code's side ----------------------------------------------------------------------
@functools.cache
def config_type(service: str) -> type[ServiceConfig]:
    """The config class `kvfabric serve <service>` loads: its main module's `main` hands
    it to `service_main` (shared/runtime.py), caught here instead of run."""
    module = importlib.import_module(f"{module_of(service)}.main")
    seen: list[type[ServiceConfig]] = []
    with mock.patch.object(module, "service_main", lambda _, cls, *a, **k: seen.append(cls)):
        module.main([])
    assert len(seen) == 1, f"{module.__name__}.main did not call service_main once"
    return seen[0]


def env_names(cls: type[ServiceConfig]) -> set[str]:
    """Every variable `load_config` reads for `cls` (shared/config.py)."""
    shared = {f.name for f in dataclasses.fields(ServiceConfig)}
    names = set()
    for field in dataclasses.fields(cls):
        names.add(f"{cls.env_prefix}{field.name.upper()}")
        if field.name in shared:
            names.add(f"{SHARED_ENV_PREFIX}{field.name.upper()}")
    return names


@functools.cache
def exported_metrics() -> set[str]:
    """Every metric name the code declares (a literal `kvfabric_...` in shared/, services/,
    worker/)."""
    names = set()
    for top in ("shared", "services", "worker"):
        for path in (REPO / top).rglob("*.py"):
            names |= set(re.findall(r"\"(kvfabric_[a-z0-9_]+)\"", path.read_text()))
    return names


def drain_default_grace_s() -> float:
    """`kvfabric drain`'s default --grace-s: how long a worker's running work may take."""
    return inspect.signature(drain).parameters["grace_s"].default.default


# -- reading the manifests ----------------------------------------------------------------
def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def main_container(deployment: dict[str, Any]) -> dict[str, Any]:
    name = deployment["metadata"]["name"]
    found = [c for c in pod_spec(deployment)["containers"] if c["name"] == name]
    assert len(found) == 1, f"{name}: no container named after its Deployment"
    return found[0]


def all_containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod_spec(deployment)
    return [*spec.get("initContainers", []), *spec["containers"]]


def decoded(secret: dict[str, Any]) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}


def container_env(
    r: Rendered, deployment: dict[str, Any], container: dict[str, Any]
) -> dict[str, str]:
    """The container's environment as the kubelet builds it (envFrom, then env), with
    the downward API's fields as a pod would have them; an optional reference to a
    Secret the overlay does not make leaves the variable unset."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        assert set(source) <= {"configMapRef", "secretRef"}, source
        if "configMapRef" in source:
            env |= r.get("ConfigMap", source["configMapRef"]["name"])["data"]
        else:
            env |= decoded(r.get("Secret", source["secretRef"]["name"]))
    for var in container.get("env", []):
        name, ref = var["name"], var.get("valueFrom")
        if ref is None:
            env[name] = var["value"]
        elif "fieldRef" in ref:
            pattern = FIELD_VALUES[ref["fieldRef"]["fieldPath"]]
            env[name] = pattern.format(name=deployment["metadata"]["name"])
        elif "secretKeyRef" in ref or "configMapKeyRef" in ref:
            kind, key_ref = (
                ("Secret", ref["secretKeyRef"])
                if "secretKeyRef" in ref
                else ("ConfigMap", ref["configMapKeyRef"])
            )
            source = r.find(kind, key_ref["name"])
            if source is None:
                assert key_ref.get("optional"), f"{name}: no {kind} {key_ref['name']}"
                continue
            data = decoded(source) if kind == "Secret" else source["data"]
            env[name] = data[key_ref["key"]]
        else:
            raise AssertionError(f"{name}: unexpected valueFrom {ref}")
    return env


def service_config(r: Rendered, service: str) -> ServiceConfig:
    """The config the service's main container would load from its manifest (a known
    model's files are this checkout's business: tiny-coder, bundled, stands in for it)."""
    deployment = r.deployments()[service]
    env = container_env(r, deployment, main_container(deployment))
    cls = config_type(service)
    overrides = (
        {"model": "tiny-coder"} if "model" in {f.name for f in dataclasses.fields(cls)} else {}
    )
    return load_config(cls, environ=env, **overrides)


def volume_mounts(deployment: dict[str, Any], container: dict[str, Any]) -> dict[str, dict]:
    """mountPath -> the pod volume mounted there."""
    volumes = {v["name"]: v for v in pod_spec(deployment).get("volumes", [])}
    return {m["mountPath"]: volumes[m["name"]] for m in container.get("volumeMounts", [])}


def port_number(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    assert port in named, f"{container['name']}: no port named {port}"
    return named[port]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) == {"matchLabels"}, selector
    return selector["matchLabels"].items() <= labels.items()


def nats(r: Rendered) -> tuple[dict[str, Any], dict[str, str]]:
    """The NATS StatefulSet and its configuration files (nats.conf, authorization.conf)."""
    statefulset = r.get("StatefulSet", "nats")
    config_volume = next(v for v in pod_spec(statefulset)["volumes"] if v["name"] == "config")
    return statefulset, r.get("ConfigMap", config_volume["configMap"]["name"])["data"]


# -- the tests ----------------------------------------------------------------------------
def test_every_object_is_valid_for_kubernetes(r: Rendered) -> None:
    errors = []
    for obj in r.objects:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError) as e:
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {e}")
    assert not errors, "\n".join(errors)
    assert all(o["metadata"].get("namespace") for o in r.objects if o["kind"] != "Namespace")


def test_each_service_up_starts_is_one_deployment_of_kvfabric_serve(r: Rendered) -> None:
    version = importlib.metadata.version("kvfabric")  # the images' tag
    services = {n: d for n, d in r.deployments().items() if n in SERVICES}
    assert set(services) == EXPECTED[r.overlay]
    assert set(r.deployments()) == set(services), "a Deployment that is no kvfabric service"
    for service, deployment in services.items():
        container = main_container(deployment)
        assert [*container["command"], *container.get("args", [])] == [
            "kvfabric",
            "serve",
            service,
        ]
        on_gpu = r.overlay == "gpu" and service in MODEL_WORKERS
        image = f"kvfabric-cuda:{version}" if on_gpu else f"kvfabric:{version}"
        for c in all_containers(deployment):
            assert c["image"] == image, f"{service}/{c['name']}"
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert selects(deployment["spec"]["selector"], labels)


def test_probes_drain_and_grace_match_the_config(r: Rendered) -> None:
    for service, deployment in r.deployments().items():
        container, config = main_container(deployment), service_config(r, service)
        assert config.metrics_host == "0.0.0.0", f"{service}: probes come from outside the pod"
        assert config.metrics_port == port_number(container, "metrics")
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(config.metrics_port)
        ready, live = container["readinessProbe"]["httpGet"], container["livenessProbe"]["httpGet"]
        assert (ready["path"], live["path"]) == ("/readyz", "/livez"), service
        assert port_number(container, live["port"]) == config.metrics_port
        ready_ports = {config.metrics_port}
        if service == INGRESS:  # its API port answers /readyz too: what the Service uses
            ready_ports.add(config.http_port)
        assert port_number(container, ready["port"]) in ready_ports
        prestop = container["lifecycle"]["preStop"]["exec"]["command"]
        assert prestop[0] == "sleep", f"{service}: preStop {prestop}"
        budget = config.shutdown_grace_s * (2 if hasattr(config, "usage_outbox_dir") else 1)
        need = float(prestop[1]) + config.sigterm_drain_s + budget + CLOSE_MARGIN_S
        grace = pod_spec(deployment)["terminationGracePeriodSeconds"]
        assert grace >= need, f"{service}: terminationGracePeriodSeconds {grace} < {need}"
        if service in MODEL_WORKERS:  # SIGTERM drains first: running work finishes
            assert config.sigterm_drain_s >= drain_default_grace_s(), service


def test_every_variable_set_is_one_the_config_reads(r: Rendered) -> None:
    for service, deployment in r.deployments().items():
        allowed = env_names(config_type(service))
        for container in all_containers(deployment):
            env = container_env(r, deployment, container)
            unread = set(env) - allowed - PROCESS_ENV
            assert not unread, f"{service}/{container['name']} sets what nothing reads: {unread}"
            # The kubelet leaves a reference to an unset variable as it is: `$(X)` literally.
            words = [*container.get("command", []), *container.get("args", [])]
            for name in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", " ".join(words)):
                assert name in env, f"{service}/{container['name']}: $({name}) is unset"
        service_config(r, service)  # and every value parses and validates


def test_configs_agree_with_the_cluster_around_them(r: Rendered) -> None:
    statefulset, _ = nats(r)
    members = statefulset["spec"]["replicas"]
    kv_index = service_config(r, "kv-index")
    for service, deployment in r.deployments().items():
        container, config = main_container(deployment), service_config(r, service)
        mounts = volume_mounts(deployment, container)
        # NATS: its members or its Service, JetStream replicas it can keep, its root's
        # permissions (generate-secrets.sh used the default root).
        for url in config.nats_url.split(","):
            parts = urlsplit(url)
            hosts = {"nats"} | {f"nats-{i}.nats-headless" for i in range(members)}
            assert parts.hostname in hosts and parts.port == 4222, f"{service}: {url}"
        assert config.js_replicas == min(members, 3), service
        assert config.root == Subjects().root
        # Its own role's seed, from its own Secret.
        creds = config.nats_creds
        assert creds is not None and creds.name == f"{service}{SEED_SUFFIX}", service
        secret_name = mounts[str(creds.parent)]["secret"]["secretName"]
        assert secret_name.startswith(f"nats-creds-{service}-")
        assert creds.name in decoded(r.get("Secret", secret_name))
        # The shared volumes where the config keeps its files.
        claims = {"store_dir": "kvstore", "usage_outbox_dir": "outbox"}
        for field, claim in claims.items():
            if hasattr(config, field):
                volume = mounts.get(str(getattr(config, field)))
                assert volume and volume["persistentVolumeClaim"]["claimName"] == claim
        if hasattr(config, "num_threads"):  # torch's threads: the cores it asked for
            cpu = str(container["resources"]["requests"]["cpu"])
            cores = int(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)
            assert config.num_threads == max(1, int(cores)), service
        if hasattr(config, "kv_index_shards"):
            assert config.kv_index_shards == kv_index.num_shards, service
        if service in MODEL_WORKERS:  # a model the init container can fetch
            model = container_env(r, deployment, container)[
                f"{config_type(service).env_prefix}MODEL"
            ]
            models.source(model)
            (fetch,) = [c for c in all_containers(deployment) if c["name"] == "fetch-model"]
            assert [*fetch["command"], *fetch["args"][:2]] == ["kvfabric", "models", "fetch"]
            cache = container_env(r, deployment, fetch)[models.CACHE_ENV]
            assert container_env(r, deployment, container)[models.CACHE_ENV] == cache
    ingress = main_container(r.deployments()[INGRESS])
    service = r.get("Service", INGRESS)
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    assert port_number(ingress, "http") == service_config(r, INGRESS).http_port
    assert service_config(r, INGRESS).http_host == "0.0.0.0"


def test_disruption_budgets_and_autoscalers(r: Rendered) -> None:
    adapter = yaml.safe_load(r.get("ConfigMap", "prometheus-adapter-rules")["data"]["config.yaml"])
    served = [
        re.search(r'__name__=~"([^"]+)"', rule["seriesQuery"]).group(1)
        for rule in adapter["externalRules"]
    ]
    budgets, scalers = r.of("PodDisruptionBudget"), r.of("HorizontalPodAutoscaler")
    for service, deployment in r.deployments().items():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert len([b for b in budgets if selects(b["spec"]["selector"], labels)]) == 1, service
        mine = [
            h
            for h in scalers
            if h["spec"]["scaleTargetRef"]
            == {"apiVersion": "apps/v1", "kind": "Deployment", "name": service}
        ]
        assert len(mine) == (service in SCALED), service
        for hpa in mine:
            external = [m["external"] for m in hpa["spec"]["metrics"] if m["type"] == "External"]
            assert external, f"{service}: no queue metric"
            for metric in external:
                name = metric["metric"]["name"]
                assert name in exported_metrics(), f"{service}: {name} is exported by nothing"
                assert metric["metric"]["selector"]["matchLabels"] == {"service": service}
                assert any(re.fullmatch(p, name) for p in served), f"no adapter rule for {name}"
            assert "replicas" not in deployment["spec"], f"{service}: the HPA owns replicas"


def test_nats_is_a_jetstream_cluster_taking_the_generated_seeds(
    r: Rendered, tmp_path: Path
) -> None:
    statefulset, files = nats(r)
    conf, members = files["nats.conf"], statefulset["spec"]["replicas"]
    assert members == (1 if r.overlay == "cpu-dev" else 3)
    assert [t["metadata"]["name"] for t in statefulset["spec"]["volumeClaimTemplates"]] == ["data"]
    assert "jetstream {" in conf and "include ./authorization.conf" in conf
    routes = re.findall(r"nats-route://(nats-\d+)\.nats-headless:6222", conf)
    assert sorted(routes) == ([] if members == 1 else [f"nats-{i}" for i in range(members)])
    headless = r.get("Service", statefulset["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"]
    # nats-server itself accepts it (the files as mounted, a member's name).
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    env = {**os.environ, "POD_NAME": "nats-0"}
    run([find_nats_server(), "-t", "-c", str(tmp_path / "nats.conf")], env=env)
    # Every role's public key, with the permissions shared/nats_auth.py gives it.
    prefix = "authorization: "  # what `kvfabric nats-creds` writes
    assert files["authorization.conf"].startswith(prefix)
    authorization = json.loads(files["authorization.conf"].removeprefix(prefix))
    users = {u["nkey"]: u["permissions"] for u in authorization["users"]}
    subjects = Subjects()
    for role in ROLES:
        key = public_key(seed_path(r.seeds_dir, role).read_bytes().strip())
        assert users.pop(key) == permissions(role, subjects).to_config(), role
    assert not users, "keys of no role"


def test_no_seed_is_committed_and_secrets_come_from_the_generation_step(
    rendered: dict[str, Rendered], tmp_path: Path
) -> None:
    for r in rendered.values():
        for secret in r.of("Secret"):
            for key, value in decoded(secret).items():
                if key.endswith(SEED_SUFFIX):
                    assert value == (r.seeds_dir / key).read_text(), f"{key}: not generated"
    # What a commit would take: no file under deploy/k8s carries a seed...
    listed = run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "deploy/k8s"], cwd=REPO
    ).stdout.split()
    assert listed, "deploy/k8s has no files git would take"
    for name in listed:
        path = REPO / name
        if path.is_file():
            assert not SEED.search(path.read_text(errors="replace")), f"{name}: an nkey seed"
    # ... as what the generation step writes is ignored...
    made = [
        "base/secrets/nats/router.nk",
        "base/secrets/postgres.env",
        "overlays/cpu-dev/secrets/dev-api-key",
    ]
    paths = [f"deploy/k8s/{m}" for m in made]
    ignored = run(["git", "check-ignore", *paths], cwd=REPO).stdout.split()
    assert ignored == paths
    # ... and without that step nothing renders (no committed fallback).
    bare = copy_without_secrets(tmp_path / "k8s")
    done = subprocess.run(
        [kubectl(), "kustomize", str(bare / "overlays" / "gpu")], capture_output=True, text=True
    )
    assert done.returncode != 0 and "secrets/" in done.stderr, done.stderr


def test_billing_keeps_its_ledger_in_the_postgres_statefulset(r: Rendered) -> None:
    url = urlsplit(service_config(r, "billing").ledger_url)
    service = r.get("Service", url.hostname)
    assert service["spec"]["ports"][0]["port"] == url.port
    postgres = r.get("StatefulSet", "postgres")
    assert selects(
        {"matchLabels": service["spec"]["selector"]},
        postgres["spec"]["template"]["metadata"]["labels"],
    )
    assert postgres["spec"]["volumeClaimTemplates"], "the ledger needs a volume"
    container = pod_spec(postgres)["containers"][0]
    env = container_env(r, postgres, container)
    assert (url.username, url.password, url.path) == (
        env["POSTGRES_USER"],
        env["POSTGRES_PASSWORD"],
        "/" + env["POSTGRES_DB"],
    )
    backup = r.get("CronJob", "postgres-backup")["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    script = " ".join(backup["containers"][0]["command"])
    assert "pg_dump" in script
    claim = backup["volumes"][0]["persistentVolumeClaim"]["claimName"]
    r.get("PersistentVolumeClaim", claim)


def test_gpu_workers_are_placed_on_their_pools(rendered: dict[str, Rendered]) -> None:
    for service, deployment in rendered["gpu"].deployments().items():
        spec, container = pod_spec(deployment), main_container(deployment)
        limits = container["resources"]["limits"]
        assert limits.get(GPU) == (1 if service in MODEL_WORKERS else None), service
        if service not in POOLS:
            assert "affinity" not in spec, service
            continue
        terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        (term,) = terms["nodeSelectorTerms"]
        (expression,) = term["matchExpressions"]
        assert (expression["key"], expression["operator"]) == (NODE_POOL, "In"), service
        assert set(expression["values"]) == POOLS[service], service
        assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    memcache = pod_spec(rendered["gpu"].deployments()[SWA_MEMCACHE])["affinity"]
    (apart,) = memcache["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert apart["topologyKey"] == "kubernetes.io/hostname", "one swa-memcache a node"
    kvstore = rendered["gpu"].get("PersistentVolumeClaim", "kvstore")
    assert kvstore["spec"]["accessModes"] == ["ReadWriteMany"]


def test_cpu_dev_is_one_of_everything_without_gpus(rendered: dict[str, Rendered]) -> None:
    r = rendered["cpu-dev"]
    assert GPU not in json.dumps(r.objects) and "kvfabric-cuda" not in json.dumps(r.objects)
    for workload in [*r.of("Deployment"), *r.of("StatefulSet")]:
        assert workload["spec"].get("replicas", 1) == 1, workload["metadata"]["name"]
    assert all(h["spec"]["minReplicas"] == 1 for h in r.of("HorizontalPodAutoscaler"))
    assert service_config(r, INGRESS).dev_api_key, "cpu-dev's dev API key"
    assert service_config(rendered["gpu"], INGRESS).dev_api_key is None
