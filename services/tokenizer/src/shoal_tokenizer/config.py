"""Tokenizer service settings: one frozen model, loaded once in ``main`` and passed down."""

from __future__ import annotations

import math
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from shoal_protos.addresses import resolve_bind_host


def pod_cpus() -> int:
    """The CPUs this process may use: its cgroup's CPU limit (``cpu.max`` of cgroup v2, or
    ``cpu.cfs_quota_us`` of v1), rounded up, where one is set below the CPUs it may run on."""
    cpus = len(os.sched_getaffinity(0))
    quota, period = _cgroup_quota()
    if quota > 0 and period > 0:
        cpus = min(cpus, max(1, math.ceil(quota / period)))
    return cpus


def _cgroup_quota() -> tuple[int, int]:
    """The cgroup's CPU quota and period in microseconds; (0, 0) when none is set or readable."""
    try:
        limit, every = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        return (0, 0) if limit == "max" else (int(limit), int(every))
    except (OSError, ValueError):
        pass
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return (quota, period) if quota > 0 else (0, 0)
    except (OSError, ValueError):
        return (0, 0)


class TokenizerConfig(BaseModel):
    """Every setting is a flag of ``shoal-tokenizer`` (``shoal_protos.settings_cli``), named
    after its field: ``max_input_chars`` is ``--max-input-chars``."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    models: dict[str, Path] = Field(min_length=1)
    """Served model name -> folder holding its Hugging Face tokenizer files, or a Hub repository
    (on the command line ``NAME=PATH``; repeat the flag for several models)."""

    revision: str | None = Field(default=None, min_length=1)
    """Hugging Face revision (branch, tag or commit) of each model named by Hub repository; None:
    the default branch. Local folders have none. A gated model's token comes from the
    ``HF_TOKEN`` environment variable, which ``huggingface_hub`` reads itself."""

    host: str = "127.0.0.1"
    """Address of this tokenizer as the pod knows itself (on Kubernetes the pod's IP; routers
    reach it through its Service): the gRPC server binds it unless ``bind_host`` says otherwise."""

    bind_host: str | None = None
    """Address the gRPC server binds; None: ``host``. ``::`` listens on every IPv6 and IPv4
    address (so that ``kubectl port-forward``, which connects to the pod's loopback, reaches it);
    gRPC takes ``0.0.0.0`` as every address too."""

    port: int = Field(default=50051, ge=1, le=65535)
    """Port the gRPC server binds."""

    max_concurrent_rpcs: int = Field(default=256, ge=1)
    """RPCs served at once; more are refused with RESOURCE_EXHAUSTED rather than queued."""

    threads: int = Field(default_factory=pod_cpus, ge=1, le=256)
    """Threads that tokenize (chat templates, encoding, decoding), off the server's event loop:
    one huge prompt then holds up one thread, not every call. By default the CPUs this process
    may use (its cgroup's CPU limit, else the CPUs it may run on)."""

    max_input_chars: int = Field(default=2_000_000, ge=1)
    """The longest input tokenized, in characters (a chat's message contents together): longer
    is refused with INVALID_ARGUMENT before any work. The default is some 500,000 tokens of
    English text."""

    @property
    def listen_host(self) -> str:
        """The address the gRPC server binds: ``bind_host``, else ``host``."""
        return resolve_bind_host(self.bind_host, self.host)


CLI_ALIASES: dict[str, str] = {"--model": "models"}
"""Flag spellings of earlier releases -> the field each sets: manifests written for them keep
working."""
