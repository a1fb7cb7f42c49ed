"""terraform/: the files are formatted, the cluster-plan module's own `terraform test` passes,
and the module computes what `kvfabric plan --json` prints, for the reference deployment and
for a second workload away from every default.

Everything runs offline: cluster-plan is a pure module (no providers, no resources), so
`terraform init` downloads nothing and `terraform apply` only evaluates outputs. Terraform
runs on copies in a temporary directory, so no .terraform/ or state lands in the repository.
The AWS modules cannot be validated here (their provider cannot be downloaded):
docs/deploy.md says what was checked instead.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
TERRAFORM_DIR = REPO / "terraform"
CLUSTER_PLAN = TERRAFORM_DIR / "modules" / "cluster-plan"
KVFABRIC = Path(sys.executable).parent / "kvfabric"

# The groups of `kvfabric plan --json` the module outputs under the same names (not money).
GROUPS = ("traffic", "fleet", "storage", "control_plane")
# Counts must be equal; every other figure (tokens, bytes, rates) within 0.1%.
EXACT = {
    "fleet": {
        "num_prefill_gpus",
        "num_decode_gpus",
        "num_pairs",
        "num_gpus",
        "num_prefill_servers",
        "num_decode_super_nodes",
    },
    "control_plane": {"index_min_shards"},
}
REL = 1e-3

# The second workload: the module's variables and the CLI's options for the same inputs
# (as terraform/modules/cluster-plan/tests/second_workload.tftest.hcl); None: the module's
# alone.
SECOND_WORKLOAD: list[tuple[str, str | None, Any]] = [
    ("tokens_per_day", "--tokens-per-day", 20_000_000_000_000),
    ("input_tokens_per_request", "--input-tokens", 30_000),
    ("output_tokens_per_request", "--output-tokens", 500),
    ("hit_rate", "--hit-rate", 0.85),
    ("prefill_tokens_per_s_per_gpu", "--prefill-rate", 1_000_000),
    ("prefill_rate_hit_rate", "--prefill-rate-hit-rate", 0.9),
    ("decode_tokens_per_s_per_gpu", "--decode-rate", 10_000),
    ("headroom_fraction", "--headroom", 0.2),
    ("kv_bytes_per_token", "--kv-bytes-per-token", 4096),
    ("retention_days", "--retention-days", 1),
    ("ssd_reads_per_hit_token", "--ssd-reads-per-hit-token", 2),
    ("block_size_tokens", "--block-size", 32),
    ("num_index_shards", "--index-shards", 32),
    ("gpus_per_prefill_server", "--gpus-per-prefill-server", 4),
    ("decode_super_node_gpus", "--super-node-gpus", [36, 72]),
    # The deployment's shape, which the CLI does not take: 72-GPU super-nodes of 4-GPU servers.
    ("decode_super_node_size", None, 72),
    ("gpus_per_decode_server", None, 4),
]


@pytest.fixture(scope="module")
def terraform() -> str:
    path = shutil.which("terraform")
    if path is None:
        pytest.fail(
            "terraform is not on PATH: install Terraform >= 1.9 (CI has it) to check terraform/"
        )
    return path


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    # No version check against checkpoint.hashicorp.com, no prompts, no colour codes.
    env = {**os.environ, "CHECKPOINT_DISABLE": "1", "TF_IN_AUTOMATION": "1", "TF_INPUT": "0"}
    return subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False
    )


def _ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, f"{result.args} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _copy_module(dest: Path) -> Path:
    return Path(shutil.copytree(CLUSTER_PLAN, dest / "cluster-plan"))


def _hcl(value: Any) -> str:
    return json.dumps(value)  # numbers and lists of numbers read the same in HCL


@pytest.fixture(scope="module")
def module_outputs(terraform: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The module's outputs for the reference (its defaults) and the second workload: a root
    configuration calling it twice, applied with a local backend in a temporary directory."""
    root = tmp_path_factory.mktemp("cluster-plan-root")
    _copy_module(root)
    second = "\n".join(f"  {name} = {_hcl(value)}" for name, _, value in SECOND_WORKLOAD)
    (root / "main.tf").write_text(
        'module "reference" {\n  source = "./cluster-plan"\n}\n'
        f'module "second" {{\n  source = "./cluster-plan"\n{second}\n}}\n'
        'output "reference" {\n  value = module.reference\n}\n'
        'output "second" {\n  value = module.second\n}\n'
    )
    _ok(_run([terraform, "init", "-no-color"], root))
    _ok(_run([terraform, "apply", "-auto-approve", "-no-color"], root))
    outputs = json.loads(_ok(_run([terraform, "output", "-json"], root)))
    return {name: output["value"] for name, output in outputs.items()}


def _kvfabric_plan(*options: str) -> dict[str, Any]:
    result = subprocess.run(
        [str(KVFABRIC), "plan", "--format", "json", *options],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _second_workload_options() -> list[str]:
    options: list[str] = []
    for _, option, value in SECOND_WORKLOAD:
        if option is None:
            continue
        for item in value if isinstance(value, list) else [value]:
            options += [option, str(item)]
    return options


def _assert_same_plan(module: dict[str, Any], cli: dict[str, Any]) -> None:
    for group in GROUPS:
        assert set(module[group]) == set(cli[group]), group
        for key, expected in cli[group].items():
            actual = module[group][key]
            where = f"{group}.{key}: module {actual!r}, kvfabric plan {expected!r}"
            if key in EXACT.get(group, set()) or expected is None:
                assert actual == expected, where
            else:
                assert actual == pytest.approx(expected, rel=REL), where


def test_terraform_files_are_formatted(terraform: str) -> None:
    result = _run(
        [terraform, "fmt", "-check", "-recursive", "-diff", "-no-color", "."], TERRAFORM_DIR
    )
    assert result.returncode == 0, f"run `terraform fmt -recursive terraform/`:\n{result.stdout}"


def test_cluster_plan_terraform_test_passes(terraform: str, tmp_path: Path) -> None:
    module = _copy_module(tmp_path)
    _ok(_run([terraform, "init", "-backend=false", "-no-color"], module))
    out = _ok(_run([terraform, "test", "-no-color"], module))
    summary = re.search(r"Success! (\d+) passed, (\d+) failed\.", out)
    assert summary, f"no success summary in terraform test's output:\n{out}"
    runs = sum(
        len(re.findall(r'^run "', test_file.read_text(), re.MULTILINE))
        for test_file in (module / "tests").glob("*.tftest.hcl")
    )
    # Every run block ran and passed: none skipped, none failed.
    assert (int(summary[1]), int(summary[2])) == (runs, 0), out
    assert runs >= 10


def test_reference_deployment_matches_kvfabric_plan(module_outputs: dict[str, Any]) -> None:
    module, cli = module_outputs["reference"], _kvfabric_plan()
    _assert_same_plan(module, cli)
    # The same defaults: every input the module shares with PlanInputs.
    for key, value in module["inputs"].items():
        assert value == pytest.approx(cli["inputs"][key], rel=1e-12), key
    # The published figures, as tests/unit/test_plan.py checks them of the CLI.
    assert module["fleet"]["num_gpus"] == 2370
    assert module["fleet"]["num_prefill_servers"] == 149
    assert module["fleet"]["num_decode_super_nodes"] == {"64": 19, "128": 10}


def test_second_workload_matches_kvfabric_plan(module_outputs: dict[str, Any]) -> None:
    module, cli = module_outputs["second"], _kvfabric_plan(*_second_workload_options())
    _assert_same_plan(module, cli)
    assert module["fleet"]["num_decode_super_nodes"] == {"36": 13, "72": 7}


def test_every_service_is_placed_on_a_pool(module_outputs: dict[str, Any]) -> None:
    plan = module_outputs["reference"]
    pools, placement = plan["node_pools"], plan["placement"]
    services = {"ingress", "router", "prefill", "decode", "kv-index", "swa-memcache", "billing"}
    assert services | {"nats"} <= set(placement)
    for service, where in placement.items():
        assert where["pools"] and set(where["pools"]) <= set(pools), service
        assert where["replicas"] >= 1, service
        for pool in where["pools"]:
            assert service in pools[pool]["services"], (service, pool)
    # One worker per deployed GPU, one memcache per GPU node.
    gpus = {pool: pools[pool]["nodes"] * pools[pool]["gpus_per_node"] for pool in pools}
    assert placement["prefill"]["replicas"] == gpus["prefill"] >= plan["fleet"]["num_prefill_gpus"]
    assert placement["decode"]["replicas"] == gpus["decode"] >= plan["fleet"]["num_decode_gpus"]
    assert (
        placement["swa-memcache"]["replicas"]
        == pools["prefill"]["nodes"] + pools["decode"]["nodes"]
    )
    # The storage nodes hold the retention and serve the reads the plan asks for.
    tier = plan["storage_tier"]
    assert tier["raw_bytes"] >= plan["storage"]["ssd_capacity_bytes"]
    assert tier["read_bytes_per_s"] >= plan["storage"]["ssd_read_bytes_per_s"]
