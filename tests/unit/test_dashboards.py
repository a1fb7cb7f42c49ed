"""The Grafana dashboards in compose/grafana/dashboards/: each parses, every panel queries the
dashboard's Prometheus datasource variable, and every metric a query names is one the code
declares, used as its kind allows (a counter or histogram series only under rate() or
increase(), a quantile only over a histogram's buckets summed by le). The declared metrics
are found in the source: the literal names given to `Metrics.counter|gauge|histogram` and
`counter_from|gauge_from` (tests/e2e/test_dashboards.py checks the scan against a live
cluster's scrapes, and evaluates every query on a real Prometheus)."""

from __future__ import annotations

import ast
import functools
import json
import re
from pathlib import Path

import pytest

from shared.metrics import check_name

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "compose" / "grafana" / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
KINDS = {
    "counter": "counter",
    "counter_from": "counter",
    "gauge": "gauge",
    "gauge_from": "gauge",
    "histogram": "histogram",
}
HISTOGRAM_SERIES = ("_bucket", "_count", "_sum")
_NAME = re.compile(r"kvfabric_[a-z0-9_]+")
# What Grafana substitutes before a query reaches Prometheus.
GRAFANA_VARIABLES = {"$__rate_interval": "30s", "$__range": "5m"}


def dashboards() -> dict[str, dict]:
    """File name -> the parsed dashboard."""
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def panels(dashboard: dict) -> list[dict]:
    """The panels that query (rows aside)."""
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def expressions(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target."""
    return [(p["title"], t["expr"]) for p in panels(dashboard) for t in p["targets"]]


def substitute(expr: str, instance: str = ".*") -> str:
    """The query as Grafana sends it, `$instance` being `instance`."""
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    expr = expr.replace("$instance", instance)
    if "$" in expr:
        raise ValueError(f"a variable left in {expr!r}")
    return expr


@functools.cache
def declared_metrics() -> dict[str, str]:
    """Every metric name the production code declares -> its kind."""
    declared: dict[str, str] = {}
    for path in sorted(
        p for top in ("services", "shared", "worker") for p in (ROOT / top).rglob("*.py")
    ):
        if "testing" not in path.parts:
            declared |= _declared_in(ast.parse(path.read_text()))
    return declared


def _declared_in(module: ast.Module) -> dict[str, str]:
    declared: dict[str, str] = {}
    for function in ast.walk(module):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        calls = [
            c
            for c in ast.walk(function)
            if isinstance(c, ast.Call)
            and isinstance(c.func, ast.Attribute)
            and c.func.attr in KINDS
            and c.args
        ]
        literal = {id(c.args[0]) for c in calls if isinstance(c.args[0], ast.Constant)}
        for call in calls:
            kind, first = KINDS[call.func.attr], call.args[0]
            if isinstance(first, ast.Constant) and _NAME.fullmatch(str(first.value)):
                declared[first.value] = kind
            elif isinstance(first, ast.Name):
                # Declared in a loop over a table of names (kv-index's, swa-memcache's
                # counters): the other names written in the same function.
                for node in ast.walk(function):
                    if (
                        isinstance(node, ast.Constant)
                        and id(node) not in literal
                        and isinstance(node.value, str)
                        and _NAME.fullmatch(node.value)
                    ):
                        declared[node.value] = kind
    return declared


def series_kind(name: str, declared: dict[str, str]) -> str:
    """ "counter", "gauge" or "histogram" (a histogram's _bucket/_count/_sum series);
    KeyError for a name nothing declares."""
    if name in declared:
        return declared[name]
    for suffix in HISTOGRAM_SERIES:
        base = name.removesuffix(suffix)
        if base != name and declared.get(base) == "histogram":
            return "histogram"
    raise KeyError(name)


def test_the_scan_finds_the_declarations_and_each_is_a_valid_name() -> None:
    declared = declared_metrics()
    # One from each way of declaring: literal, read when scraped, in a table, the runtime's.
    for name in (
        "kvfabric_router_decisions_total",
        "kvfabric_billing_revenue_pico_cny_total",
        "kvfabric_kv_index_matches_total",
        "kvfabric_swa_memcache_hits_total",
        "kvfabric_decode_time_to_first_token_seconds",
        "kvfabric_endpoint_requests_total",
        "kvfabric_worker_queue_depth",
    ):
        assert name in declared, name
    for name, kind in declared.items():
        check_name(name, kind)  # raises for a name that is not one of this kind


def test_there_is_an_overview_a_cache_dashboard_and_one_per_service() -> None:
    found = dashboards()
    expected = {
        "overview",
        "cache-economics",
        "router",
        "prefill",
        "decode",
        "kv-index",
        "swa-memcache",
        "ingress",
        "billing",
    }
    assert {name.removesuffix(".json") for name in found} == expected
    uids = [d["uid"] for d in found.values()]
    assert len(set(uids)) == len(uids)


@pytest.mark.parametrize("file_name", sorted(dashboards()))
def test_every_panel_queries_the_datasource_variable(file_name: str) -> None:
    dashboard = dashboards()[file_name]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert panels(dashboard), file_name
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(set(ids)) == len(ids), "panel ids repeat"
    for panel in panels(dashboard):
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(set(ref_ids)) == len(ref_ids), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
            assert target["expr"].strip(), panel["title"]
        if any("$instance" in t["expr"] for t in panel["targets"]):
            assert "instance" in variables, f"{panel['title']}: $instance is no variable"


@pytest.mark.parametrize("file_name", sorted(dashboards()))
def test_every_metric_is_declared_and_used_as_its_kind_allows(file_name: str) -> None:
    declared = declared_metrics()
    for title, expr in expressions(dashboards()[file_name]):
        substitute(expr)  # no variable Grafana would leave unresolved
        for match in _NAME.finditer(expr):
            name = match.group()
            try:
                kind = series_kind(name, declared)
            except KeyError:
                pytest.fail(f"{file_name} / {title}: {name} is not a declared metric")
            under_rate = re.search(r"(rate|increase)\($", expr[: match.start()]) is not None
            if kind == "gauge":
                assert not under_rate, f"{title}: rate() of the gauge {name}"
            else:
                assert under_rate, f"{title}: the {kind} series {name} outside rate()"
            if kind == "histogram":
                assert name.endswith(HISTOGRAM_SERIES), f"{title}: histogram {name} bare"
        for quantile in re.finditer(r"histogram_quantile\(", expr):
            shape = re.match(
                r"histogram_quantile\(0\.\d+, sum by \(le(, \w+)*\) \(rate\(kvfabric_\w+_bucket",
                expr[quantile.start() :],
            )
            assert shape, f"{title}: a quantile not over sum by (le) of a rate of _bucket"
