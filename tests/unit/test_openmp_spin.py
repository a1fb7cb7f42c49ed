"""The model workers' OpenMP spin (worker/serving/wiring.py: limit_openmp_spin)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from worker.serving.wiring import OPENMP_SPIN_COUNT, limit_openmp_spin


def test_sets_a_short_spin_unless_the_operator_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    limit_openmp_spin()
    assert os.environ["GOMP_SPINCOUNT"] == OPENMP_SPIN_COUNT

    monkeypatch.setenv("GOMP_SPINCOUNT", "123")
    limit_openmp_spin()
    assert os.environ["GOMP_SPINCOUNT"] == "123"

    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    limit_openmp_spin()
    assert "GOMP_SPINCOUNT" not in os.environ


def test_the_workers_set_it_before_torch_loads() -> None:
    """libgomp reads its environment once, when torch loads it: the service modules and the
    wiring must not import torch before setup calls limit_openmp_spin (a fresh process)."""
    code = (
        "import sys\n"
        "import services.decode.main, services.prefill.main\n"
        "from worker.serving.wiring import limit_openmp_spin\n"
        "limit_openmp_spin()\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.split() == ["False"], out.stderr
