"""The start-up phases a service logs when serving: the process's age comes from /proc."""

from __future__ import annotations

import subprocess
import sys

from shared.runtime import process_age_s


def test_a_process_age_counts_from_its_start() -> None:
    mine = process_age_s()
    assert mine is not None and mine > 0  # pytest has been running a while
    # A child that sleeps before asking is at least that old, and younger than this process.
    code = "import time; time.sleep(0.5); from shared.runtime import process_age_s as a; print(a())"
    child = float(subprocess.check_output([sys.executable, "-c", code], text=True))
    assert 0.5 <= child < (process_age_s() or 0)
