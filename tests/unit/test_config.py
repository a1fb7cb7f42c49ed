from __future__ import annotations

import dataclasses
import importlib
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from services.admin.cli import app
from services.admin.launcher import module_of
from services.ingress.config import IngressConfig
from services.prefill.config import PrefillConfig
from services.router.config import RouterConfig
from shared.config import ConfigError, ServiceConfig, field_docs, load_config
from shared.subjects import SERVICES

runner = CliRunner()


def test_defaults_env_and_flags_in_precedence_order() -> None:
    environ = {
        "KVF_HEARTBEAT_S": "2.5",
        "KVF_ROUTER_HEARTBEAT_S": "3",
        "KVF_NATS_URL": "nats://n:1",
    }
    config = load_config(RouterConfig, [], environ)
    assert config.heartbeat_s == 3.0  # the service's own prefix beats the shared one
    assert config.nats_url == "nats://n:1"  # the shared prefix serves every service
    assert config.shutdown_grace_s == 10.0  # default
    config = load_config(RouterConfig, ["--heartbeat-s", "0.25"], environ)
    assert config.heartbeat_s == 0.25  # flags beat the environment


def test_config_is_frozen() -> None:
    config = load_config(RouterConfig, [], {})
    with pytest.raises(AttributeError):
        config.heartbeat_s = 9  # type: ignore[misc]


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        ([], {"KVF_INGRESS_HEARTBEAT_S": "soon"}, "KVF_INGRESS_HEARTBEAT_S='soon'"),
        (["--http-port", "x"], {}, "--http-port='x'"),
        (["--http-port", "70000"], {}, "http_port must be in [0, 65535]"),
        (["--heartbeat-s", "0"], {}, "heartbeat_s must be > 0"),
        (["--metrics-port", "65536"], {}, "metrics_port must be in [0, 65536)"),
        ([], {"KVF_METRICS_PORT": "-1"}, "metrics_port must be in [0, 65536), got -1"),
        (["--nats-url", "http://x"], {}, "nats_url 'http://x' must start with nats://"),
        (["--root", "a..b"], {}, "subject root 'a..b'"),
        (["--instance-id", "a.b"], {}, "instance_id 'a.b'"),
        (["--log-level", "loud"], {}, "log_level must be one of"),
    ],
)
def test_bad_values_fail_naming_their_source(
    argv: list[str], environ: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(IngressConfig, argv, environ)
    assert message in str(caught.value)


def test_optional_and_bool_values() -> None:
    config = load_config(
        IngressConfig, ["--otlp-endpoint", "none", "--instance-id", "ingress-7"], {}
    )
    assert config.otlp_endpoint is None
    assert config.resolved_instance_id("ingress") == "ingress-7"
    assert load_config(IngressConfig, [], {}).resolved_instance_id("ingress").startswith("ingress-")


def test_engine_threads_default_to_every_core_this_process_may_use() -> None:
    cores = len(os.sched_getaffinity(0))
    assert load_config(PrefillConfig, [], {}).torch_threads == cores
    assert load_config(PrefillConfig, ["--num-threads", "1"], {}).torch_threads == 1
    with pytest.raises(ConfigError, match="num_threads must be >= 0"):
        load_config(PrefillConfig, ["--num-threads", "-1"], {})


CONFIG_FILE = """
[up]
replicas = "prefil=2"

[shared]
nats_url = "nats://file:4222"
heartbeat_s = 2
shutdown_grace_s = 4.5

[router]
heartbeat_s = 0.5

[kv-index]
num_shards = 3
"""


def test_the_file_sits_under_the_environment_and_the_flags(tmp_path: Path) -> None:
    path = tmp_path / "kvfabric.toml"
    path.write_text(CONFIG_FILE)
    environ = {"KVF_CONFIG": str(path)}
    config = load_config(RouterConfig, [], environ)
    # [router] over [shared] over the defaults
    assert (config.heartbeat_s, config.nats_url, config.shutdown_grace_s) == (
        0.5,
        "nats://file:4222",
        4.5,
    )
    assert load_config(PrefillConfig, [], environ).heartbeat_s == 2.0  # [shared] only
    over = load_config(RouterConfig, [], environ | {"KVF_SHUTDOWN_GRACE_S": "7"})
    assert over.shutdown_grace_s == 7.0  # the environment beats the file
    flagged = load_config(RouterConfig, ["--heartbeat-s", "0.25"], environ)
    assert flagged.heartbeat_s == 0.25  # flags beat both
    named = load_config(RouterConfig, ["--config", str(path)], {})
    assert named.nats_url == "nats://file:4222"  # --config as well as $KVF_CONFIG


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[router]\nheartbeat_z = 1\n", "[router] heartbeat_z is not one of its settings"),
        ("[shared]\nnum_shards = 3\n", "[shared] num_shards is not one of its settings"),
        ("[router]\nheartbeat_s = 'soon'\n", "heartbeat_s='soon'"),
        ("heartbeat_s = 1\n", "outside a table"),
        ("[router\n", "configuration file"),
    ],
)
def test_a_bad_file_fails_naming_the_key(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "kvfabric.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(RouterConfig, [], {"KVF_CONFIG": str(path)})
    assert words in str(caught.value)


def test_up_takes_its_options_from_the_file_under_its_flags(tmp_path: Path) -> None:
    path = tmp_path / "kvfabric.toml"
    path.write_text(CONFIG_FILE)
    env = {"COLUMNS": "300", "KVF_CONFIG": ""}
    # [up] replicas = "prefil=2" is the file's: up refuses it as it would the flag's.
    from_file = runner.invoke(app, ["up", "--config", str(path)], env=env)
    assert from_file.exit_code == 2 and "'prefil=2'" in from_file.output
    path.write_text("[up]\nnats_prot = 1\n")
    typo = runner.invoke(app, ["up", "--config", str(path)], env=env)
    assert typo.exit_code == 2 and "[up] nats_prot is not an option of up" in typo.output


def test_every_setting_of_every_service_says_what_it_does() -> None:
    """`kvfabric serve <service> --help` (and the file's keys) show each field's comment."""
    undocumented = {}
    for service in SERVICES:
        module = importlib.import_module(f"{module_of(service)}.config")
        for cls in vars(module).values():
            if (
                isinstance(cls, type)
                and dataclasses.is_dataclass(cls)
                and issubclass(cls, ServiceConfig)
                and cls.__module__ == module.__name__
            ):
                docs = field_docs(cls)
                missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
                if missing:
                    undocumented[cls.__name__] = missing
    assert not undocumented
    assert "SIGTERM first drains" in field_docs(RouterConfig)["sigterm_drain_s"]
