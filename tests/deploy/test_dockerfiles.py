"""deploy/*.Dockerfile: each parses (dockerfile-parse), copies only what exists, and pins what
pyproject.toml pins: vLLM's image at the `vllm` extra's release, a Python that
``requires-python`` admits, the extras it installs, the version it labels, its entry point."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = pytest.importorskip("tomllib").loads((ROOT / "pyproject.toml").read_text())  # Python 3.11+
dockerfile_parse = pytest.importorskip("dockerfile_parse")
ENGINE = ROOT / "deploy" / "engine.Dockerfile"
VLLM = ROOT / "deploy" / "vllm.Dockerfile"
KNOWN = {"FROM", "ARG", "LABEL", "COPY", "RUN", "ENV", "USER", "ENTRYPOINT", "CMD", "WORKDIR", "EXPOSE", "COMMENT"}


def _parsed(text: str):
    return dockerfile_parse.DockerfileParser(fileobj=io.BytesIO(text.encode()))


def dockerfile_problems(text: str) -> list[str]:
    """What in Dockerfile ``text`` does not parse, copies what is not there, or disagrees with
    pyproject.toml."""
    parser, problems = _parsed(text), []
    instructions = parser.structure
    problems += [f"line {i['startline'] + 1}: unknown instruction {i['instruction']}"
                 for i in instructions if i["instruction"] not in KNOWN]
    if not instructions or instructions[0]["instruction"] not in ("FROM", "ARG", "COMMENT"):
        problems.append("no FROM first")
    for i in instructions:
        if i["instruction"] == "COPY":
            sources = i["value"].split()[:-1]
            problems += [f"COPY {s}: not in the repository" for s in sources if not (ROOT / s).exists()]
    version = PYPROJECT["project"]["version"]
    if parser.labels.get("org.opencontainers.image.version") != version:
        problems.append(f"labelled {parser.labels.get('org.opencontainers.image.version')!r}, pyproject says {version}")
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    for found in re.findall(r'/src\[([a-z,-]+)\]', text):
        problems += [f"extra {e!r} is not pyproject's" for e in found.split(",") if e not in extras]
    return problems


def _base_image(text: str) -> str:
    return _parsed(text).baseimage


def test_dockerfiles_parse_and_agree_with_pyproject():
    assert dockerfile_problems(ENGINE.read_text()) == []
    assert dockerfile_problems(VLLM.read_text()) == []


def test_vllm_dockerfile_is_on_vllms_image_at_the_vllm_extras_release():
    (pin,) = PYPROJECT["project"]["optional-dependencies"]["vllm"]
    assert _base_image(VLLM.read_text()) == "vllm/vllm-openai:v" + pin.removeprefix("vllm==")


def test_engine_dockerfile_python_is_one_pyproject_admits_and_it_runs_the_engine():
    image = _base_image(ENGINE.read_text())
    major, minor = re.fullmatch(r"python:(\d+)\.(\d+)-slim-\w+", image).groups()
    lowest = tuple(int(p) for p in PYPROJECT["project"]["requires-python"].removeprefix(">=").split("."))
    assert (int(major), int(minor)) >= lowest
    parser = _parsed(ENGINE.read_text())
    entrypoint = next(i["value"] for i in parser.structure if i["instruction"] == "ENTRYPOINT")
    assert entrypoint == '["pegaflow-engine"]' and "pegaflow-engine" in PYPROJECT["project"]["scripts"]
    assert "[nvrtc]" in ENGINE.read_text()
    users = [i["value"] for i in parser.structure if i["instruction"] == "USER"]
    assert users == ["1000"]  # the uid of deploy/kubernetes/'s pods


@pytest.mark.parametrize("old, new, said", [
    ("ARG PEGAFLOW_VERSION=0.1.0", "ARG PEGAFLOW_VERSION=0.0.9", "pyproject says"),
    ("COPY engine /src/engine", "COPY engines /src/engine", "not in the repository"),
    ('"/src[nvrtc]"', '"/src[nvrtk]"', "is not pyproject's"),
    ("ENTRYPOINT", "ENTRYPIONT", "unknown instruction"),
])
def test_dockerfile_problems_finds_a_broken_copy(old, new, said):
    text = ENGINE.read_text()
    assert old in text
    assert any(said in p for p in dockerfile_problems(text.replace(old, new)))
