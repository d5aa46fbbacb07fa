"""Engine service settings: one frozen model, loaded once in ``main`` and passed down."""

from __future__ import annotations

import socket
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shoal_protos.addresses import host_port, http_url, resolve_bind_host, tcp_url
from shoal_protos.records import default_redis_url

LOOPBACK = "127.0.0.1"
"""Where the KV agent's control socket listens: every pod has this address, and only its own
processes reach it."""


def _default_engine_id(fields: dict[str, Any]) -> str:
    return f"{socket.gethostname()}-{fields.get('zmq_port', '')}"


class EngineConfig(BaseModel):
    """Every setting is a flag of ``shoal-engine`` (``shoal_protos.settings_cli``), named after
    its field: ``heartbeat_ttl_s`` is ``--heartbeat-ttl-s``."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    model: str
    """Folder of the Hugging Face model that vLLM loads."""

    served_model_name: str
    """Name clients use in the OpenAI ``model`` field."""

    cluster: str = Field(default="default", min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    """Cluster name: prefixes every Redis key, so clusters can share one Redis."""

    redis_url: str = Field(default_factory=default_redis_url)
    """Redis holding the fleet state; by default ``$REDIS_URL``, else the local one. A password
    belongs in the environment: every process on the node can read a command line."""

    redis_timeout_s: float = Field(default=1.0, gt=0.0)
    """Deadline of each Redis call: a call that hangs fails and the next heartbeat retries,
    rather than stopping the heartbeats."""

    host: str = "127.0.0.1"
    """Address peers are told to reach this engine at (its Redis record: ZeroMQ, HTTP, control
    and KV addresses); the sockets bind it too unless ``bind_host`` says otherwise. On Kubernetes
    the pod's IP."""

    bind_host: str | None = None
    """Address the ZeroMQ request socket, the HTTP server, the EngineControl gRPC server and the
    KV agent's data socket bind; None: ``host``. ``::`` listens on every IPv6 and IPv4 address
    (so that ``kubectl port-forward``, which connects to the pod's loopback, reaches them),
    ``0.0.0.0`` on every IPv4 one (gRPC takes it as every address, IPv6 too). The KV agent's
    control socket, which hands out KV bytes, always binds ``host``."""

    zmq_port: int = Field(default=5600, ge=1, le=65535)
    """Port of the PULL socket that takes ADD and ABORT frames from routers."""

    engine_id: str = Field(default_factory=_default_engine_id, min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    """Unique id of this engine within its cluster (the pod name on Kubernetes); by default
    ``<hostname>-<zmq_port>``."""

    http_port: int = Field(default=8100, ge=1, le=65535)
    """Port of ``/health`` and ``/metrics``."""

    max_model_len: int | None = Field(default=None, ge=16)
    """Longest prompt plus output; defaults to the model's own limit."""

    dtype: str = "bfloat16"
    """Weights and activations type passed to vLLM."""

    enforce_eager: bool = False
    """Skip vLLM's graph compilation: starts in seconds instead of tens of seconds, decodes
    somewhat slower. Tests use it."""

    tensor_parallel_size: int = Field(default=1, ge=1)
    """GPUs each layer's weights are split across (vLLM's ``tensor_parallel_size``)."""

    pipeline_parallel_size: int = Field(default=1, ge=1)
    """Stages the layers are split into, one group of GPUs each (vLLM's
    ``pipeline_parallel_size``); an engine uses tensor times pipeline parallel size GPUs."""

    gpu_memory_utilization: float | None = Field(default=None, gt=0.0, le=1.0)
    """Share of each GPU's memory vLLM may take for weights, activations and KV cache; None
    keeps vLLM's default. vLLM's CPU build sizes its KV cache by ``VLLM_CPU_KVCACHE_SPACE``."""

    quantization: str | None = Field(default=None, min_length=1)
    """vLLM's quantization method (``awq``, ``gptq``, ``fp8``, ...); None: read from the model's
    config, or none."""

    revision: str | None = Field(default=None, min_length=1)
    """Hugging Face revision (branch, tag or commit) of the model and its tokenizer, when
    ``model`` names a Hub repository; None: the default branch. A gated model's token comes
    from the ``HF_TOKEN`` environment variable, never from a flag."""

    vllm_args: tuple[str, ...] = ()
    """The user's own vLLM engine flags, one word per item, applied over vLLM's defaults after
    vLLM's own parser has checked them. On the command line one shell-quoted text per
    ``--vllm-args``, written with ``=`` (a value that begins with ``--`` is otherwise read as a
    flag): ``--vllm-args="--enable-chunked-prefill --kv-cache-dtype fp8"``; it may repeat, the
    words add up. Flags Shoal sets itself (``shoal_protos.vllm_flags``) are refused. The ``sim``
    backend ignores them."""

    executor_backend: Literal["uni", "mp", "ray"] | None = None
    """vLLM's ``distributed_executor_backend``; None lets vLLM choose. On a single GPU ``uni``
    runs the model in the engine-core process (one process fewer to start); vLLM's CPU build
    always uses ``mp``, since OpenMP must be set up in a fresh worker process."""

    tcmalloc: bool = True
    """On vLLM's CPU build, run the model's processes with tcmalloc (``LD_PRELOAD``) when the
    library is installed (Debian's ``libtcmalloc-minimal4``; ``shoal_engine.tcmalloc``).
    Without the library, or on GPUs, nothing changes."""

    max_num_seqs: int = Field(default=64, ge=1)
    """Requests vLLM runs in one batch; more wait in its queue."""

    priority_headroom: float = Field(default=0.25, ge=0.0, le=1.0)
    """Fraction of the KV cache the engine asks routers to count as used for each priority
    request it holds (priority below 0): dispatch sends it less and balancing moves its other
    requests away, so priority requests decode in smaller batches (Llumnix's virtual usage)."""

    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    """vLLM's scheduling policy. ``priority`` passes each request's priority to vLLM, which then
    runs lower values first and preempts higher ones for them."""

    heartbeat_ttl_s: float = Field(default=3.0, gt=0.2)
    """The engine's Redis record expires this long after its last heartbeat: routers stop
    dispatching to an engine that died within this time."""

    load_report_interval_s: float = Field(default=0.1, gt=0.0, le=1.0)
    """How often the load report (and heartbeat) is written to Redis."""

    prefix_events: bool = True
    """Publish what the engine's prefix cache holds (vLLM's KV events) to Redis, for routers
    that place requests where their prompt's blocks are cached (``--scheduler prefix_cache``).
    vLLM backend only; a ``--kv-events-config`` in ``--vllm-args`` is read instead of Shoal's
    own where it binds a socket on this host."""

    prefix_snapshot_interval_s: float = Field(default=2.0, gt=0.0, le=60.0)
    """How often the whole prefix-cache content is written to Redis, where routers that start
    late or miss changes read it."""

    drain_timeout_s: float = Field(default=30.0, ge=0.0)
    """On SIGTERM, how long running requests may go on before they are aborted."""

    output_hwm: int = Field(default=10_000, ge=1)
    """ZeroMQ high-water mark of each output socket (batches queued per router)."""

    zmq_curve_key_file: str | None = None
    """The fleet's CURVE key file (``shoal_protos.curve``): router-engine frames are encrypted
    and only fleet members connect. None: plain ZeroMQ."""

    fleet_tls_dir: str | None = None
    """The fleet's TLS folder (``shoal_protos.tls``: ``ca.crt``, ``tls.crt``, ``tls.key``):
    EngineControl and the KV data links between agents are mutual TLS, and take only peers
    holding a certificate of the fleet's CA. None: both plain, open to whoever reaches them."""

    backend: Literal["vllm", "sim"] = "vllm"
    """vLLM, or ``sim``: a step-time model in its place (``shoal_sim.engine``), where ``model``
    names the step model."""

    sim_kv_blocks: int = Field(default=4096, ge=1)
    """``sim``: KV cache blocks."""

    sim_speed: float = Field(default=1.0, gt=0.0)
    """``sim``: step times are divided by this (above 1: faster than the modelled hardware)."""

    sim_seed: int = 0
    """``sim``: seed of the generated token ids."""

    sim_kv_gbps: float = Field(default=8.0, gt=0.0)
    """``sim`` with ``migration``: gigabytes per second a migration's KV moves (timed, no bytes
    travel; ``shoal_sim.kv_agent``)."""

    sim_kv_bytes_per_token: int = Field(default=131_072, ge=1)
    """``sim``: KV cache bytes per token (LLaMA-3-8B in fp16 by default)."""

    migration: bool = False
    """Load Shoal's KV connector so running requests can move to other engines with their KV
    (needs ``control_port`` and ``kv_port``)."""

    control_port: int = Field(default=5800, ge=1, le=65535)
    """Port of the gRPC EngineControl service (migrate, drain, list migrations)."""

    kv_port: int = Field(default=5900, ge=1, le=65535)
    """Port where other engines push KV blocks to this engine's KV agent; the agent's control
    socket for this engine service takes ``kv_port + 1``."""

    kv_transport: str = Field(default="tcp", pattern=r"^(tcp|gloo|nccl)$")
    """How KV bytes travel between engines: ``tcp`` (CPU default), ``gloo``, ``nccl`` (GPUs)."""

    kv_staging_mib: int = Field(default=1024, ge=0, le=1 << 20)
    """Staging arena of migrations arriving here: memory kept mapped between migrations (it
    costs only as much as has been used). On CPU engines, chunks that do not fit go to fresh
    memory; on GPU engines the arena is all there is (a move that does not fit fails and the
    request stays on its source), and it is taken out of vLLM's GPU memory budget."""

    kv_debug_reads: bool = False
    """Whether the KV agent serves ``ReadBlocks`` and ``ReadStaged``: KV bytes handed out for
    tests to compare what a move copied. Off in production."""

    kv_max_pairs: int = Field(default=4, ge=1, le=64)
    """Most ``gloo`` or ``nccl`` pair groups this engine keeps open to send (the least recently
    used is closed for a new one) and to receive (a join beyond them is refused): each NCCL
    communicator holds GPU buffers, counted in the GPU budget too."""

    block_size: int | None = Field(default=None, ge=16)
    """KV block size in tokens; None keeps vLLM's default (128 on CPU; the CPU build needs a
    multiple of 32). A request moved here has every block of its context hashed, looked up and
    allocated when it is admitted: fewer, larger blocks keep a long context's stall near a
    short one's."""

    migration_max_stages: int = Field(default=4, ge=1)
    """Pre-copy stages at most before the request is stopped for the last one."""

    migration_last_stage_max_blocks: int = Field(default=2, ge=0)
    """Stop pre-copying once no more than this many new full blocks are left."""

    migration_precopy_mib_per_s: int = Field(default=0, ge=0, le=1 << 20)
    """Pace pre-copy stages to this rate (0: unpaced). On engines whose KV copy shares the cores
    that decode, a pace trades a longer migration for less slowdown of the other requests; the
    last stage, after the stop, always goes at full speed, and so do a drain's moves (the engine
    is leaving, and its other requests with it)."""

    migration_precopy_share: float = Field(default=0.0, ge=0.0, le=1.0)
    """Pace pre-copy stages by time instead of bytes (0: unpaced): the KV agent sends for at most
    this share of the time since a stage began, waiting out the rest after each chunk. Unlike a
    byte rate it needs no knowledge of the link or the machine: the copy takes at most this share
    of a core that also decodes, whatever the copy's speed. Either pace, or both, may be set."""

    migration_warm: bool = True
    """After pre-copy and before the stop, the target runs the context staged so far through vLLM
    for one dropped token, its KV loaded from staging: the blocks then wait in vLLM's prefix
    cache and the commit loads only the blocks after them, so the stall no longer grows with
    the context's KV (vLLM backend only)."""

    migration_step_timeout_s: float = Field(default=10.0, gt=0.0)
    """Deadline of each migration step (prepare, a stage, commit)."""

    @property
    def parallel_workers(self) -> int:
        """vLLM workers of this engine, each holding a shard of the KV cache (TP x PP)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def listen_host(self) -> str:
        """The address the listening sockets bind: ``bind_host``, else ``host``."""
        return resolve_bind_host(self.bind_host, self.host)

    @property
    def zmq_address(self) -> str:
        """The request socket's address as routers reach it (the Redis record's)."""
        return tcp_url(self.host, self.zmq_port)

    @property
    def zmq_bind(self) -> str:
        return tcp_url(self.listen_host, self.zmq_port)

    @property
    def http_address(self) -> str:
        """The HTTP server's base URL as others reach it (the Redis record's)."""
        return http_url(self.host, self.http_port)

    @property
    def kv_data_address(self) -> str:
        """The KV agent's data socket as other engines reach it (record and prepare replies)."""
        return tcp_url(self.host, self.kv_port)

    @property
    def kv_data_bind(self) -> str:
        return tcp_url(self.listen_host, self.kv_port)

    @property
    def kv_agent_address(self) -> str:
        """The KV agent's control socket, on the loopback address alone whatever ``host`` and
        ``bind_host`` are: its commands hand out KV bytes and send KV anywhere, and only this
        engine (its own pod) calls it."""
        return tcp_url(LOOPBACK, self.kv_port + 1)

    @property
    def control_address(self) -> str:
        """The EngineControl gRPC server as other engines and routers reach it (``host:port``)."""
        return host_port(self.host, self.control_port)

    @property
    def control_bind(self) -> str:
        return host_port(self.listen_host, self.control_port)


CLI_ALIASES: dict[str, str] = {
    "--heartbeat-ttl": "heartbeat_ttl_s",
    "--drain-timeout": "drain_timeout_s",
    "--migration-step-timeout": "migration_step_timeout_s",
}
"""Flag spellings of earlier releases -> the field each sets: manifests written for them keep
working."""
