"""deploy/kubernetes/: every object valid against Kubernetes' own schemas (kubernetes-validate,
offline, strict: an unknown field fails), and the choices docs/running.md explains kept:
the node's IPC and PID namespaces, one uid, /dev/shm from the node, a memory limit that holds
the pool, every GPU for the engine without taking vLLM's, and probes that run pegaflow-stat."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pegaflow.platform.values import parse_size

kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
KUBERNETES_VERSIONS = ("1.30.0", "1.35.0")  # the oldest still supported upstream then, and a recent one
RINGS_PER_CLIENT_BYTES = 8 * 2**20  # ring and payload arena per client slot (docs/running.md)
MAX_CLIENTS = 64  # the engine's default --max-clients


def _objects() -> dict[str, dict]:
    found = {}
    for path in MANIFESTS:
        for obj in yaml.safe_load_all(path.read_text()):
            found[f"{obj['kind']}/{obj['metadata']['name']}"] = obj
    return found


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def _containers(obj: dict) -> dict[str, dict]:
    return {c["name"]: c for c in obj["spec"]["template"]["spec"]["containers"]}


def _schema_errors(obj: dict, version: str) -> str | None:
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return exc.message
    return None


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_are_valid_against_kubernetes_schemas(version):
    objects = _objects()
    assert set(objects) == {"Namespace/pegaflow", "DaemonSet/pegaflow-engine", "Deployment/vllm", "Service/vllm"}
    assert {name: _schema_errors(obj, version) for name, obj in objects.items()} == dict.fromkeys(objects)


def test_manifests_schema_check_fails_on_an_invalid_field():
    # The check above can fail: a misspelt field, and a wrong type, in a copy of the DaemonSet.
    daemonset = _objects()["DaemonSet/pegaflow-engine"]
    misspelt = json.loads(json.dumps(daemonset).replace('"hostIPC"', '"hostIpc"'))
    assert "hostIpc" in (_schema_errors(misspelt, KUBERNETES_VERSIONS[-1]) or "")
    wrong_type = json.loads(json.dumps(daemonset).replace('"terminationGracePeriodSeconds": 60',
                                                          '"terminationGracePeriodSeconds": "60s"'))
    assert _schema_errors(wrong_type, KUBERNETES_VERSIONS[-1]) is not None


def test_manifests_share_the_nodes_ipc_pid_shm_and_one_uid():
    objects = _objects()
    assert objects["Namespace/pegaflow"]["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    uids = set()
    for name in ("DaemonSet/pegaflow-engine", "Deployment/vllm"):
        pod = objects[name]["spec"]["template"]["spec"]
        assert pod["hostIPC"] is True and pod["hostPID"] is True, name
        assert objects[name]["metadata"]["namespace"] == "pegaflow"
        uids.add(pod["securityContext"]["runAsUser"])
        shm = [v for v in pod["volumes"] if v["name"] == "dev-shm"]
        assert shm == [{"name": "dev-shm", "hostPath": {"path": "/dev/shm", "type": "Directory"}}], name
        for container in pod["containers"]:
            assert {"name": "dev-shm", "mountPath": "/dev/shm"}.items() <= \
                next(m for m in container["volumeMounts"] if m["name"] == "dev-shm").items()
    assert len(uids) == 1  # every segment is mode 0600


def test_manifests_engine_memory_limit_holds_its_pool_and_rings():
    daemonset = _objects()["DaemonSet/pegaflow-engine"]
    engine = _containers(daemonset)["engine"]
    pool = parse_size(_env(engine)["PEGAFLOW_POOL_SIZE"])
    table = min(pool // 56, 144 * 2**20)  # --keep-pool's slot table
    needed = pool + table + MAX_CLIENTS * RINGS_PER_CLIENT_BYTES + 2**30 // 2  # and the process
    limit = parse_size(engine["resources"]["limits"]["memory"].replace("Gi", "GiB").replace("Mi", "MiB"))
    assert limit >= needed
    assert engine["resources"]["requests"]["memory"] == engine["resources"]["limits"]["memory"]
    assert daemonset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 60


def test_manifests_engine_sees_every_gpu_without_taking_vllms():
    engine = _containers(_objects()["DaemonSet/pegaflow-engine"])["engine"]
    assert _env(engine)["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert "nvidia.com/gpu" not in json.dumps(engine["resources"])
    vllm = _containers(_objects()["Deployment/vllm"])["vllm"]
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_manifests_vllm_attaches_to_the_engine_by_its_name():
    engine = _containers(_objects()["DaemonSet/pegaflow-engine"])
    vllm = _containers(_objects()["Deployment/vllm"])["vllm"]
    config = json.loads(vllm["args"][vllm["args"].index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "PegaKVConnector" and config["kv_connector_module_path"] == "pegaflow.connector"
    assert config["kv_connector_extra_config"]["engine_name"] == _env(engine["engine"])["PEGAFLOW_NAME"]
    assert _env(engine["exporter"])["PEGAFLOW_NAME"] == _env(engine["engine"])["PEGAFLOW_NAME"]
    assert _env(vllm)["PYTHONHASHSEED"] == "0"


def _probe(container: dict, kind: str) -> list[str]:
    return container[kind]["exec"]["command"]


def test_manifests_probes_and_exporter_run_pegaflow_stat():
    containers = _containers(_objects()["DaemonSet/pegaflow-engine"])
    for kind in ("readinessProbe", "livenessProbe"):
        assert _probe(containers["engine"], kind)[:2] == ["pegaflow-stat", "--once"]
    assert containers["exporter"]["command"][:2] == ["pegaflow-stat", "--serve-metrics"]
    port = int(containers["exporter"]["command"][2].rpartition(":")[2])
    assert containers["exporter"]["ports"][0]["containerPort"] == port


@pytest.mark.parametrize("kind", ["readinessProbe", "livenessProbe"])
def test_manifests_probe_passes_on_a_running_engine_and_fails_without_one(shared_engine, kind):
    # The probe's own command line, with the container's PEGAFLOW_NAME: exit 0 with the
    # engine, 1 with none of that name (3, a frozen engine, is pegaflow-stat's own test's).
    command = _probe(_containers(_objects()["DaemonSet/pegaflow-engine"])["engine"], kind)
    argv = [sys.executable, "-m", "pegaflow.stats.cli", *command[1:]]

    def run(name: str) -> int:
        env = dict(os.environ, PEGAFLOW_NAME=name)
        return subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, timeout=60).returncode

    assert run(shared_engine.name) == 0
    assert run(shared_engine.name + "_none") == 1
