"""The alert rules an operator gets (compose/prometheus/alerts.yml): valid, each one fired by
the series promtool's unit tests feed it (alerts_test.yml), and each names a metric the code
really exports."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

RULES_DIR = Path(__file__).parents[2] / "compose" / "prometheus"
CODE_DIRS = ("shared", "services", "worker")

pytestmark = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool missing (Debian: apt-get install prometheus)"
)


def test_rules_are_valid_and_fire_as_tested() -> None:
    for args in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts_test.yml"]):
        result = subprocess.run(
            ["promtool", *args], cwd=RULES_DIR, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stdout + result.stderr


def test_every_rule_reads_a_metric_the_code_exports() -> None:
    rules = (RULES_DIR / "alerts.yml").read_text()
    names = set(re.findall(r"\b(kvfabric_[a-z_]+)", rules))
    root = RULES_DIR.parents[1]
    code = "".join(p.read_text() for d in CODE_DIRS for p in (root / d).rglob("*.py"))
    missing = {n for n in names if f'"{n}"' not in code}
    assert names and not missing, f"rules read metrics nobody exports: {sorted(missing)}"
