"""One vLLM process of tests/e2e/run_vllm.py: run prompt batches, return what it recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_vllm(tmp: Path, tag: str, model: Path, batches: list, engine: str = "", *flags: str,
             timeout_s: float = 600) -> dict:
    """``batches`` through a fresh vLLM of ``model`` (with the connector when ``engine`` names
    one); its tokens, top-5 logprobs and cached-token counts."""
    prompts, out = tmp / f"{tag}.prompts.json", tmp / f"{tag}.out.json"
    prompts.write_text(json.dumps({"batches": batches}))
    cmd = [sys.executable, str(ROOT / "tests/e2e/run_vllm.py"), "--model", str(model),
           "--prompts", str(prompts), "--out", str(out), *flags]
    if engine:
        cmd += ["--engine-name", engine]
    # vLLM before 0.27 seeds block hashes randomly per process unless PYTHONHASHSEED is set.
    env = dict(os.environ, PYTHONHASHSEED="0",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, timeout=timeout_s)
    return json.loads(out.read_text())
