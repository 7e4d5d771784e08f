"""A local run without a Citus build ends with one line for the Citus tests it skipped (their
count, and why), not one line per test: `-ra` keeps every other skip's reason in view."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_citus_tests_skipped_for_want_of_citus_are_one_line(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "CI"}
    env["IDEMPOTENCY_CITUS_DIR"] = str(tmp_path / "no-citus-here")
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
         "tests/test_citus_plans.py", "tests/test_citus_contract.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    skipped = [line for line in ran.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) == 1, ran.stdout
    [line] = skipped
    assert line.startswith("SKIPPED [") and "tests/citus_cluster.py" in line
    assert f"no Citus build at {tmp_path / 'no-citus-here'}" in line
