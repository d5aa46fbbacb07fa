"""``EngineBackend``: what the engine service needs from an inference engine.

The service speaks only to this protocol. ``VllmBackend`` (in ``vllm_backend.py``) implements it
with vLLM's public ``AsyncLLM``; tests of the service's own logic can plug in something lighter.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Protocol

from shoal_engine.kv.params import KvLoad
from shoal_protos.messages import FinishReason, SamplingOptions


@dataclass(frozen=True, slots=True)
class BackendInfo:
    max_model_len: int
    kv_blocks_total: int
    kv_block_size: int
    """Tokens per KV block: the unit of ``kv_blocks_total`` and of the load's block counts."""


@dataclass(frozen=True, slots=True)
class EngineTimes:
    """When the engine's scheduler took a request in, first scheduled it and sampled its first
    token (``time.monotonic``, this host's clock; the engine runs on the same host)."""

    queued: float
    scheduled: float
    first_token: float


@dataclass(frozen=True, slots=True)
class BackendOutput:
    """New output of one request since the previous ``BackendOutput``."""

    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    # On the request's first output with tokens, where the engine has them.
    engine_times: EngineTimes | None = None


@dataclass(slots=True)
class BackendLoad:
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    step_time_ms: float = 0.0


class BackendRequestError(Exception):
    """The backend rejected one request (bad parameters, prompt too long); others go on."""


class BackendDeadError(Exception):
    """The backend can serve nothing more; the engine process must exit."""


class EngineBackend(Protocol):
    async def start(self) -> BackendInfo:
        """Load the model; return once requests can be served."""
        ...

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        kv_load: KvLoad | None = None,
        priority: int = 0,
        produced: int = 0,
    ) -> AsyncGenerator[BackendOutput]:
        """Stream a request's output. Cancelling the iteration, or closing the stream early,
        aborts the request.
        ``kv_load``: the request arrives by migration, its KV staged here; ``priority``
        orders requests where the backend schedules by priority (lower first); ``produced``:
        the last ``produced`` tokens of ``prompt_token_ids`` are the request's own output so
        far (it resumes here), whose text was shown up to the stop strings' held-back part."""
        ...

    def load(self) -> BackendLoad:
        """The latest scheduler view: queue lengths and KV blocks in use."""
        ...

    async def check_health(self) -> None:
        """Raise ``BackendDeadError`` if the backend can serve nothing more."""
        ...

    def shutdown(self) -> None: ...
