"""The GPU tier: tests of the KV agent on CUDA KV caches, run by ``bash tests/gpu/run.sh``.

``pytest tests`` collects this folder everywhere; without a CUDA device every test here is
skipped, with the reason, so the CPU tiers stay as they are. ``SHOAL_GPU_CHECK_CPU=1`` runs the
tests' CPU variants (their ``device`` parameter is ``cpu``) on a machine without a GPU, which
proves the layouts and byte comparisons short of the device itself.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

CPU_VARIANTS = "SHOAL_GPU_CHECK_CPU"
_HERE = Path(__file__).parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (tests/gpu; bash tests/gpu/run.sh)")


def needs_cuda(item: pytest.Item) -> bool:
    """Whether a test of this folder runs on a GPU: its ``device`` parameter is ``cuda``, or it
    takes the ``cuda_device`` fixture."""
    callspec = getattr(item, "callspec", None)
    device = callspec.params.get("device") if callspec is not None else None
    return device == "cuda" or "cuda_device" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A conftest's hook sees the whole session's items: only this folder's are ours.
    ours = [item for item in items if _HERE in item.path.parents]
    if not ours or torch.cuda.is_available():
        return
    cpu_variants = os.environ.get(CPU_VARIANTS) == "1"
    skip = pytest.mark.skip(
        reason=f"no CUDA device (torch {torch.__version__}): the GPU check runs where there is one "
        f"(bash tests/gpu/run.sh); {CPU_VARIANTS}=1 runs its CPU variants here"
    )
    for item in ours:
        if not (cpu_variants and not needs_cuda(item)):
            item.add_marker(skip)
