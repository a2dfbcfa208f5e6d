"""tools/bench_connector_step.py runs against the real worker and scheduler sides."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_connector_step_prints_one_json_object_with_both_costs():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_connector_step.py"),
                           "--steps", "200", "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["pegaflow_step_us"] > 0 and result["noop_step_us"] > 0
    assert result["pegaflow_over_noop_us"] == result["pegaflow_step_us"] - result["noop_step_us"]
