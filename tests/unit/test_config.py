from __future__ import annotations

import os

import pytest

from services.ingress.config import IngressConfig
from services.prefill.config import PrefillConfig
from services.router.config import RouterConfig
from shared.config import ConfigError, load_config


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
