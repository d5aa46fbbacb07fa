"""``ShoalConnector``: Shoal's vLLM KV connector, loaded with ``kv_connector_module_path``.

vLLM builds it twice: in the scheduler (engine-core process) and in the worker (next to the KV
cache). Only public ``KVConnectorBase_V1`` hooks are used.

Scheduler side, every step (``build_connector_meta``):
  * the block tables of the requests it scheduled (whole table for new or resumed requests,
    appended blocks otherwise) and how many tokens of KV each will have after the step, keyed by
    Shoal's request id (passed in ``kv_transfer_params``, as ``KvParams``);
  * loads: a request arriving by migration carries a ``KvLoad`` (migration M, tokens T);
    ``get_num_new_matched_tokens`` claims its first ``T`` tokens (never the last one, which
    vLLM must compute; less what the local prefix cache has), and once vLLM has allocated the
    blocks the metadata tells the worker which staged blocks go where. A warm-up before the
    stop (``keep``, the migration's context so far, one output token) loads them
    without freeing the staging area; its blocks stay in vLLM's prefix cache, so the commit's
    request finds them there and loads only the blocks after them. A commit's request that
    finds every staged token there loads nothing, and its staging area is freed at once.

  * an aborted request's blocks are kept (``request_finished`` says so) until the worker
    reports them free: a migration stops its request with an abort, then copies its last,
    partly filled block.

  * the requests it preempted: their blocks are free again, so a send of them must not be
    trusted (the agent fails it).

Worker side: ``start_load_kv`` hands table updates to the KV agent and injects the step's loads
(vLLM runs it before the forward pass when a step has synchronous loads; the staged bytes are
already in this process); ``wait_for_save`` tells the agent which tokens' KV the forward pass
wrote; ``get_finished`` frees kept blocks the agent does not hold. Blocks that could not be
loaded are reported through ``get_block_ids_with_load_errors`` and vLLM recomputes them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank, get_tp_group
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.request import RequestStatus

from shoal_engine.kv.agent import KvAgent, Load, TableUpdate
from shoal_engine.kv.params import ConnectorSettings, KvParams
from shoal_engine.kv.ranks import worker_addresses
from shoal_protos.tls import load_optional

KV_CACHE_LAYOUT = "LBHNC"
"""The KV cache layout the connector asks vLLM for (a ``vllm.v1.kv_cache_layout.KVCacheLayout``
name), on every backend."""

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


@dataclass
class ShoalConnectorMetadata(KVConnectorMetadata):
    updates: list[TableUpdate] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)
    # Shoal ids of requests that finished, and vLLM ids of those whose blocks vLLM keeps
    # until the worker reports them (aborted requests: one may be a migration's stop).
    finished: list[str] = field(default_factory=list)
    delayed: list[str] = field(default_factory=list)
    # Shoal ids of requests vLLM preempted this step (their blocks are free again).
    preempted: list[str] = field(default_factory=list)
    # Migrations whose request found all of its staged KV in the prefix cache: nothing will
    # load from their staging areas.
    unneeded: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _PendingLoad:
    migration_id: str
    first_block: int
    last_block: int
    keep: bool


class ShoalConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        self._num_blocks = kv_cache_config.num_blocks
        self._settings = ConnectorSettings.from_vllm(dict(self._kv_transfer_config.kv_connector_extra_config))
        # Scheduler side: vLLM's request id -> Shoal's; loads waiting for their blocks.
        self._ids: dict[str, str] = {}
        self._loads: dict[str, _PendingLoad] = {}
        self._delayed: list[str] = []
        self._unneeded: list[str] = []
        # Local prefix-cache hits of requests with KV to load (set when vLLM asks how many
        # tokens the connector has, used once their blocks are allocated).
        self._matched: dict[str, int] = {}
        # Worker side.
        self._agent: KvAgent | None = None

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """LBHNC: each layer's blocks one after another, each block one dense page. The agent
        moves a block per layer as one slice of that layer's tensor; FlashAttention, the CUDA
        default, would otherwise get LBNHC, where a layer's tensor is not blocks-first
        contiguous and the agent refuses it."""
        return KV_CACHE_LAYOUT

    # ---- scheduler side ---------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = KvParams.from_vllm(request.kv_transfer_params)
        if params is None:
            return 0, False
        self._ids[request.request_id] = params.id
        load = params.load
        if load is None:
            return 0, False
        # Never the last token: vLLM must compute at least one to sample the next.
        tokens = min(load.tokens, request.num_tokens - 1)
        if tokens <= num_computed_tokens:
            if not load.keep:
                self._unneeded.append(load.migration)
            return 0, False
        # The local prefix cache already has the first ``num_computed_tokens``: load the rest.
        self._matched[request.request_id] = num_computed_tokens
        return tokens - num_computed_tokens, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        local = self._matched.pop(request.request_id, None)
        if num_external_tokens <= 0 or local is None:
            return
        params = KvParams.from_vllm(request.kv_transfer_params)
        load = params.load if params is not None else None
        assert load is not None, "a request vLLM allocated external tokens for carries a load"
        end = local + num_external_tokens
        self._loads[request.request_id] = _PendingLoad(
            load.migration,
            local // self._block_size,
            -(-end // self._block_size),  # the last, partly filled block too
            load.keep,
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = ShoalConnectorMetadata(delayed=self._delayed, unneeded=self._unneeded)
        self._delayed, self._unneeded = [], []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            shoal_id = self._ids.get(new.req_id)
            if shoal_id is None:
                continue
            block_ids = list(new.block_ids[0])
            meta.updates.append(
                TableUpdate(
                    shoal_id,
                    new.req_id,
                    block_ids,
                    True,
                    new.num_computed_tokens + scheduled.get(new.req_id, 0),
                )
            )
            pending = self._loads.pop(new.req_id, None)
            if pending is not None:
                meta.loads.append(
                    Load(
                        shoal_id,
                        pending.migration_id,
                        pending.first_block,
                        block_ids[pending.first_block : pending.last_block],
                        pending.keep,
                    )
                )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            shoal_id = self._ids.get(req_id)
            if shoal_id is None:
                continue
            new_blocks = cached.new_block_ids[i]
            meta.updates.append(
                TableUpdate(
                    shoal_id,
                    req_id,
                    list(new_blocks[0]) if new_blocks else [],
                    req_id in cached.resumed_req_ids,
                    cached.num_computed_tokens[i] + scheduled.get(req_id, 0),
                )
            )
        for req_id in scheduler_output.preempted_req_ids or ():
            shoal_id = self._ids.get(req_id)
            if shoal_id is not None:
                meta.preempted.append(shoal_id)
        for req_id in scheduler_output.finished_req_ids:
            shoal_id = self._ids.pop(req_id, None)
            self._loads.pop(req_id, None)
            self._matched.pop(req_id, None)
            if shoal_id is not None:
                meta.finished.append(shoal_id)
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # A migration stops its request with an abort and then copies the last, partly filled
        # block: keep an aborted request's blocks until the worker says they may go (at once,
        # unless the engine service holds the request).
        if request.status == RequestStatus.FINISHED_ABORTED and request.request_id in self._ids:
            self._delayed.append(request.request_id)
            return True, None
        return False, None

    # ---- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # Each worker of a tensor- or pipeline-parallel engine runs its own agent, for its shard.
        rank = get_tensor_model_parallel_rank() + get_pp_group().rank_in_group * get_tp_group().world_size
        settings = self._settings
        control, data = worker_addresses(settings.control_address, settings.data_address, rank)
        self._agent = KvAgent(
            kv_caches,
            self._num_blocks,
            self._block_size,
            control_address=control,
            data_address=data,
            transport=settings.transport,
            chunk_bytes=settings.chunk_bytes,
            staging_ttl_s=settings.staging_ttl_s,
            timeout_s=settings.timeout_s,
            staging_bytes=settings.staging_bytes,
            max_pairs=settings.max_pairs,
            host=settings.host or None,
            debug_reads=settings.debug_reads,
            tls=load_optional(settings.tls_dir),
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self._agent is None or not isinstance(meta, ShoalConnectorMetadata):
            return
        self._agent.update_tables(meta.updates, meta.finished, meta.preempted, meta.delayed)
        for load in meta.loads:
            self._agent.inject(load)
        for migration_id in meta.unneeded:
            self._agent.free_staging(migration_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if self._agent is not None and isinstance(meta, ShoalConnectorMetadata):
            self._agent.step_done(meta.updates)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        meta = self._connector_metadata
        delayed = meta.delayed if isinstance(meta, ShoalConnectorMetadata) else []
        if self._agent is None:
            return set(delayed) or None, None
        return self._agent.finished_sending(delayed) or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._agent.take_load_errors() if self._agent is not None else set()

    def shutdown(self) -> None:
        if self._agent is not None:
            self._agent.close()
            self._agent = None
