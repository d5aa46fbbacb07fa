"""``VllmBackend``: the ``EngineBackend`` protocol on vLLM's public ``AsyncLLM``.

vLLM runs its engine core (the model loop) in a process of its own; ``AsyncLLM`` in this process
detokenizes and hands each request's outputs to ``generate``'s async iterator. Outputs are asked
for as deltas (``RequestOutputKind.DELTA``), so each iteration carries just the new tokens and
text. Queue lengths and KV usage come from a stat logger passed to ``AsyncLLM`` (its documented
hook for custom metrics), called once per engine step.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncGenerator, Sequence
from typing import Any, NoReturn, cast

from tokenizers import Tokenizer
from transformers import TokenizersBackend
from vllm import SamplingParams, TokensPrompt
from vllm.config import KVEventsConfig, KVTransferConfig, VllmConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import GracefulHTTPError, VLLMClientError
from vllm.platforms import current_platform
from vllm.sampling_params import RequestOutputKind
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import IterationStats, RequestStateStats, SchedulerStats

from shoal_engine import tcmalloc
from shoal_engine.backend import (
    BackendDeadError,
    BackendInfo,
    BackendLoad,
    BackendOutput,
    BackendRequestError,
    EngineTimes,
)
from shoal_engine.config import EngineConfig
from shoal_engine.detokenize import OutputText, StopStrings
from shoal_engine.kv.params import ConnectorSettings, KvLoad, KvParams
from shoal_engine.vllm_args import OWNED_FIELDS, VllmArgsError, refusal
from shoal_protos.messages import FinishReason, SamplingOptions

logger = logging.getLogger(__name__)

_FINISH_REASONS = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
    "error": FinishReason.ERROR,
}


class _LoadRecorder(StatLoggerBase):
    """Keeps the latest scheduler stats in a ``BackendLoad`` the backend owns."""

    def __init__(self, vllm_config: VllmConfig, load: BackendLoad) -> None:
        self._vllm_config = vllm_config
        self._load = load
        self._last_step = 0.0
        # Exponential moving average of the time between steps while the engine is busy.
        self._step_ema_ms = 0.0

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        mm_cache_stats: object | None = None,
        engine_idx: int = 0,
    ) -> None:
        now = time.monotonic()
        if scheduler_stats is None:
            return
        load = self._load
        load.num_running = scheduler_stats.num_running_reqs
        load.num_waiting = scheduler_stats.num_waiting_reqs
        load.kv_blocks_used = round(scheduler_stats.kv_cache_usage * load.kv_blocks_total)
        if self._last_step and load.num_running:
            gap_ms = (now - self._last_step) * 1000.0
            self._step_ema_ms = gap_ms if not self._step_ema_ms else 0.8 * self._step_ema_ms + 0.2 * gap_ms
            load.step_time_ms = self._step_ema_ms
        self._last_step = now

    def log_engine_initialized(self) -> None:
        blocks = self._vllm_config.cache_config.num_gpu_blocks or 0
        self._load.kv_blocks_total = blocks
        logger.info("vLLM engine ready with %d KV blocks", blocks)


def _engine_times(stats: object) -> EngineTimes | None:
    """The engine core's stamps of a request (``RequestOutput.metrics``: monotonic, on this
    host), once its first token is out; None where vLLM kept none."""
    if not isinstance(stats, RequestStateStats) or not (stats.queued_ts and stats.first_token_ts):
        return None
    return EngineTimes(stats.queued_ts, stats.scheduled_ts or stats.queued_ts, stats.first_token_ts)


def to_sampling_params(options: SamplingOptions, detokenize: bool = True) -> SamplingParams:
    """vLLM's parameters for ``options``. ``detokenize=False``: token ids only, the text and
    the stop strings are the engine's own (``shoal_engine.detokenize``)."""
    return SamplingParams(
        max_tokens=options.max_tokens,
        temperature=options.temperature,
        top_p=options.top_p,
        top_k=options.top_k,
        seed=options.seed,
        stop=(list(options.stop) or None) if detokenize else None,
        stop_token_ids=list(options.stop_token_ids) or None,
        ignore_eos=options.ignore_eos,
        detokenize=detokenize,
        output_kind=RequestOutputKind.DELTA,
    )


class _FlagParser(FlexibleArgumentParser):
    """vLLM's own parser, whose errors raise ``VllmArgsError`` with vLLM's message instead of
    printing vLLM's usage and exiting."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments"):
            message += " (--vllm-args takes vLLM engine flags only: Shoal's router serves the API)"
        raise VllmArgsError(f"--vllm-args: {message}")


def user_engine_args(words: Sequence[str]) -> dict[str, Any]:
    """The ``AsyncEngineArgs`` fields ``words`` set, parsed by vLLM's own parser (names, values
    and choices checked as ``vllm serve`` checks them). Raises ``VllmArgsError`` on what vLLM
    refuses and on a field Shoal sets itself."""
    if not words:
        return {}
    # No --help: it would print vLLM's help and exit the engine.
    parser = _FlagParser(prog="vllm", add_help=False)
    AsyncEngineArgs.add_cli_args(parser)
    # Without defaults the namespace holds just what the words set, a value equal to vLLM's
    # default (--no-enforce-eager) included; a comparison with the defaults would miss that.
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    try:
        parsed = vars(parser.parse_args(list(words)))
    except ValueError as exc:  # a --config file vLLM cannot read
        raise VllmArgsError(f"--vllm-args: {exc}") from None
    fields = {field.name for field in dataclasses.fields(AsyncEngineArgs)}
    for name in parsed:
        flag = "--" + name.replace("_", "-")
        # The parsed names catch spellings no string check sees: abbreviations, --config files.
        if name in OWNED_FIELDS:
            raise VllmArgsError(refusal(flag))
        if name not in fields:
            raise VllmArgsError(f"--vllm-args: {flag} is not a vLLM engine setting")
    return parsed


def shoal_engine_args(config: EngineConfig) -> dict[str, Any]:
    """The ``AsyncEngineArgs`` fields Shoal sets from its own settings; each is an owned flag
    (``shoal_protos.vllm_flags``), so the user's flags never carry one."""
    args: dict[str, Any] = {
        "model": config.model,
        "served_model_name": [config.served_model_name],
        "dtype": config.dtype,
        "max_model_len": config.max_model_len,
        "max_num_seqs": config.max_num_seqs,
        "enforce_eager": config.enforce_eager,
        "distributed_executor_backend": config.executor_backend,
        "disable_log_stats": False,
        "enable_log_requests": False,
        "block_size": config.block_size,
        "kv_transfer_config": _kv_transfer_config(config),
        "scheduling_policy": config.scheduling_policy,
        "tensor_parallel_size": config.tensor_parallel_size,
        "pipeline_parallel_size": config.pipeline_parallel_size,
        "quantization": config.quantization,
        "revision": config.revision,
        "tokenizer_revision": config.revision,
    }
    if config.gpu_memory_utilization is not None:
        args["gpu_memory_utilization"] = config.gpu_memory_utilization
    if config.migration and not current_platform.is_cpu():
        total = current_platform.get_device_total_memory(0)
        args["gpu_memory_utilization"] = migration_budget(config, total)
    return args


VLLM_GPU_MEMORY_UTILIZATION = cast(
    float,
    next(f.default for f in dataclasses.fields(AsyncEngineArgs) if f.name == "gpu_memory_utilization"),
)
"""vLLM's own default of ``gpu_memory_utilization``, read from its engine arguments."""
NCCL_PAIR_RESERVE = 64 << 20
"""GPU memory set aside per NCCL pair group: an upper estimate of a two-rank communicator's
buffers at NCCL's default ``NCCL_BUFFSIZE`` (not measured on these machines)."""


def migration_budget(config: EngineConfig, total_bytes: int) -> float:
    """The ``gpu_memory_utilization`` vLLM gets on a GPU engine with migration: the configured
    one (vLLM's default if unset) less the share of the device that the staging arena and the
    pair groups take, which vLLM's profile does not see (they are allocated after it). Without
    it, an engine at 0.9 would hold 0.9 of the GPU for vLLM and then the arena on top."""
    wanted = config.gpu_memory_utilization or VLLM_GPU_MEMORY_UTILIZATION
    reserve = (config.kv_staging_mib << 20) + config.kv_max_pairs * NCCL_PAIR_RESERVE
    budget = wanted - reserve / total_bytes
    if budget <= 0.05:
        raise VllmArgsError(
            f"--kv-staging-mib {config.kv_staging_mib} and {config.kv_max_pairs} NCCL pairs leave vLLM "
            f"{budget:.2f} of a {total_bytes >> 20} MiB GPU at gpu_memory_utilization {wanted:g}"
        )
    return round(budget, 4)


def build_engine_args(config: EngineConfig, kv_events: KVEventsConfig | None = None) -> AsyncEngineArgs:
    """The engine arguments vLLM starts with: Shoal's settings, ``kv_events`` (unless the
    user's flags set their own), then the user's own flags (``config.vllm_args``). Built in one
    call, so ``AsyncEngineArgs.__post_init__`` converts each value once. Raises
    ``VllmArgsError`` on flags vLLM or Shoal refuses."""
    user = user_engine_args(config.vllm_args)
    shoal = shoal_engine_args(config)
    if kv_events is not None and "kv_events_config" not in user:
        shoal["kv_events_config"] = kv_events
    return AsyncEngineArgs(**shoal, **user)


def kv_events_source(user: KVEventsConfig | None) -> tuple[str, str] | None:
    """Where this process can read the KV events of the user's own ``--kv-events-config``
    (endpoint, topic): its PUB socket's address, a wildcard bind read on this host; None where
    it publishes none or connects out to a broker of its own."""
    if user is None or not user.enable_kv_cache_events or user.publisher != "zmq":
        return None
    endpoint = user.endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return (endpoint, user.topic) if endpoint.startswith("ipc://") else None
    if "*" in endpoint:
        return endpoint.replace("*", "127.0.0.1", 1), user.topic
    return None


def _kv_transfer_config(config: EngineConfig) -> KVTransferConfig | None:
    if not config.migration:
        return None
    return KVTransferConfig(
        kv_connector="ShoalConnector",
        kv_role="kv_both",
        kv_connector_module_path="shoal_engine.kv.connector",
        # Blocks a load could not fill (staging that expired, a prefix-cache block the target
        # evicted after it said it held it) are computed again, as the connector promises; the
        # default fails the request instead.
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=ConnectorSettings(
            control_address=config.kv_agent_address,
            data_address=config.kv_data_bind,
            host=config.host,
            transport=config.kv_transport,
            staging_bytes=config.kv_staging_mib << 20,
            max_pairs=config.kv_max_pairs,
            debug_reads=config.kv_debug_reads,
            tls_dir=config.fleet_tls_dir or "",
            timeout_s=config.migration_step_timeout_s,
        ).to_vllm(),
    )


class VllmBackend:
    def __init__(self, config: EngineConfig) -> None:
        self._config = config
        self._events_dir: str | None = None
        self.kv_events: tuple[str, str] | None = None
        """Where vLLM publishes its KV events (endpoint, topic), for ``prefix_cache``."""
        kv_events = None
        user_events = user_engine_args(config.vllm_args).get("kv_events_config")
        if user_events is not None:
            self.kv_events = kv_events_source(user_events) if config.prefix_events else None
        elif config.prefix_events:
            # A socket file of its own: nothing else on the host can bind or read it.
            self._events_dir = tempfile.mkdtemp(prefix="shoal-kv-events-")
            endpoint = f"ipc://{self._events_dir}/events"
            kv_events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint)
            self.kv_events = endpoint, ""
        try:
            # Built here, so flags vLLM refuses stop the engine before anything loads.
            self._args = build_engine_args(config, kv_events)
        except VllmArgsError:
            self._remove_events_dir()
            raise
        self._load = BackendLoad()
        self._llm: AsyncLLM | None = None
        # The fast tokenizer's own, for ``OutputText``; None: vLLM detokenizes.
        self._tokenizer: Tokenizer | None = None

    async def start(self) -> BackendInfo:
        if self._config.tcmalloc and current_platform.is_cpu():
            library = tcmalloc.installed()
            if tcmalloc.preload(os.environ, library):
                logger.info("vLLM's processes run with %s", library)
            elif not library:
                logger.info("tcmalloc is not installed: vLLM's processes keep glibc's allocator")
        load = self._load
        self._llm = AsyncLLM.from_engine_args(
            self._args, stat_loggers=[lambda cfg, _idx: _LoadRecorder(cfg, load)]
        )
        tokenizer = self._llm.tokenizer
        if isinstance(tokenizer, TokenizersBackend):
            self._tokenizer = tokenizer.backend_tokenizer
        else:
            logger.info("the model's tokenizer is not a fast one: vLLM detokenizes every request")
        vllm_config = self._llm.vllm_config
        self._load.kv_blocks_total = vllm_config.cache_config.num_gpu_blocks or 0
        return BackendInfo(
            max_model_len=vllm_config.model_config.max_model_len,
            kv_blocks_total=self._load.kv_blocks_total,
            kv_block_size=vllm_config.cache_config.block_size,
        )

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        kv_load: KvLoad | None = None,
        priority: int = 0,
        produced: int = 0,
    ) -> AsyncGenerator[BackendOutput]:
        assert self._llm is not None, "start() first"
        # vLLM refuses a priority unless it schedules by priority; under FCFS the router-side
        # headroom still applies.
        priority = priority if self._config.scheduling_policy == "priority" else 0
        prompt = TokensPrompt(prompt_token_ids=prompt_token_ids)
        try:
            # The text and the stop strings are this engine's (``detokenize``), from the end of
            # the context; vLLM's own only for a tokenizer that is not a fast one.
            tokenizer = self._tokenizer
            text = OutputText(tokenizer, prompt_token_ids) if tokenizer is not None else None
            stops = None
            if tokenizer is not None and sampling.stop:
                stops = StopStrings.resumed(sampling.stop, tokenizer, prompt_token_ids, produced)
            # SamplingParams validates its values: a ValueError here is the request's fault.
            params = to_sampling_params(sampling, detokenize=text is None)
            if self._config.migration:
                # The KV connector knows requests by Shoal's id (vLLM adds a suffix to its own).
                shoal = KvParams(id=request_id, load=kv_load)
                params.extra_args = {"kv_transfer_params": shoal.to_vllm()}
            outputs = self._llm.generate(prompt, params, request_id, priority=priority)
            first = True
            try:
                async for out in outputs:
                    completion = out.outputs[0]
                    reason = completion.finish_reason
                    token_ids = list(completion.token_ids)
                    times = None
                    if first and token_ids:
                        first = False
                        times = _engine_times(out.metrics)
                    new_text = completion.text if text is None else text.add(token_ids, reason == "stop")
                    if stops is not None:
                        new_text, matched = stops.add(new_text)
                        if matched is not None:
                            # Leaving the loop closes vLLM's stream: it stops the request.
                            yield BackendOutput(token_ids, new_text, FinishReason.STOP, matched, times)
                            break
                        if reason is not None:
                            new_text += stops.flush()
                    yield BackendOutput(
                        token_ids,
                        new_text,
                        _FINISH_REASONS.get(reason) if reason else None,
                        completion.stop_reason,
                        times,
                    )
            finally:
                # Closing this stream early closes vLLM's at once, which aborts the request
                # there (rather than whenever the garbage collector gets to it).
                await outputs.aclose()
        except EngineDeadError as exc:
            raise BackendDeadError(str(exc) or "vLLM engine core died") from exc
        except (VLLMClientError, GracefulHTTPError, ValueError) as exc:
            raise BackendRequestError(str(exc)) from exc
        except EngineGenerateError as exc:
            cause = exc.__cause__
            raise BackendRequestError(
                f"{type(cause).__name__}: {cause}" if cause else "generate failed"
            ) from exc

    def load(self) -> BackendLoad:
        return self._load

    async def check_health(self) -> None:
        if self._llm is None:
            raise BackendDeadError("engine not started")
        try:
            await self._llm.check_health()
        except EngineDeadError as exc:
            raise BackendDeadError(str(exc) or "vLLM engine core died") from exc

    def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        self._remove_events_dir()

    def _remove_events_dir(self) -> None:
        if self._events_dir is not None:
            shutil.rmtree(self._events_dir, ignore_errors=True)
            self._events_dir = None
