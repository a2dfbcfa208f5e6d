"""vLLM's CPU build in the end-to-end tests: one process of tests/e2e/run_vllm.py, or one
long-lived tests/e2e/vllm_session.py, with what the CPU needs (attention blocks of 32
tokens, a small KV cache) and a model of random weights (random_weights.py), and the engine
beside them on the host backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import readline_within
from tests.e2e.runs import ROOT, run_vllm
from tools.engine_process import EngineProcess

MODELS = ROOT / "tools" / "models"
BLOCK = 32  # vLLM's CPU attention takes block sizes of multiples of 32
KV_CACHE_BYTES = 256 << 20  # per vLLM process: moved into shared memory at start (docs/cpu.md)
RUN_TIMEOUT_S = 900
START_TIMEOUT_S = 600


def cpu_kwargs(**more) -> dict:
    return {"block_size": BLOCK, "kv_cache_memory_bytes": KV_CACHE_BYTES, "load_format": "safetensors", **more}


def run(tmp: Path, tag: str, model: Path, batches: list, engine: str = "", *flags: str, **more) -> dict:
    """``batches`` through a fresh vLLM of the model in ``model`` on the CPU."""
    return run_vllm(tmp, tag, model, batches, engine, *flags, "--llm-kwargs",
                    json.dumps(cpu_kwargs(**more)), timeout_s=RUN_TIMEOUT_S)


def flatten(result: dict) -> list:
    return [r for batch in result["batches"] for r in batch]


def cached_tokens(result: dict) -> int:
    return sum(r["cached_tokens"] for r in flatten(result))


def start_engine(name: str, *flags: str, pool_size: str = "512MiB") -> EngineProcess:
    return EngineProcess(name, *flags, backend="host", pool_size=pool_size, start_timeout_s=60)


class Session:
    """One vLLM process kept between commands (tests/e2e/vllm_session.py)."""

    def __init__(self, model: Path, engine: str = "", **more):
        cmd = [sys.executable, str(ROOT / "tests/e2e/vllm_session.py"), "--model", str(model),
               "--eager", "--llm-kwargs", json.dumps(cpu_kwargs(**more))]
        if engine:
            cmd += ["--engine-name", engine]
        env = dict(os.environ, PYTHONHASHSEED="0",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        ready = readline_within(self.proc, START_TIMEOUT_S)
        assert json.loads(ready).get("ready"), ready

    def send(self, command: dict) -> None:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def answer(self) -> dict:
        line = readline_within(self.proc, RUN_TIMEOUT_S)
        assert line, "the vLLM session ended without answering"
        return json.loads(line)

    def generate(self, prompts: list) -> dict:
        self.send({"op": "generate", "prompts": prompts})
        return self.answer()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send({"op": "exit"})
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
