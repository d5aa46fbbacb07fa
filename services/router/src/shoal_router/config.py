"""Router settings: one frozen model, loaded once in ``main`` and passed down."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shoal_protos.addresses import resolve_bind_host, tcp_url
from shoal_protos.records import default_redis_url
from shoal_router.core.scheduling import Scheduler


class RouterConfig(BaseModel):
    """Every setting is a flag of ``shoal-router`` (``shoal_protos.settings_cli``), named after
    its field: ``max_inflight_requests`` is ``--max-inflight-requests``."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    models: list[str] = Field(default_factory=list)
    """Model names this router serves. Engines of other models found in Redis are served too;
    a listed model with no live engine answers 503 instead of 404."""

    cluster: str = Field(default="default", min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    """Cluster name: prefixes every Redis key (must match the engines')."""

    router_id: str = Field(default="router-0", min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    """Unique id of this router; prefixes its request ids."""

    redis_url: str = Field(default_factory=default_redis_url)
    """Redis holding the fleet state; by default ``$REDIS_URL``, else the local one. A password
    belongs in the environment: every process on the node can read a command line."""

    redis_timeout_s: float = Field(default=1.0, gt=0.0)
    """Deadline of each Redis call: a poll that hangs fails and the next poll retries."""

    tokenizer_address: str = "127.0.0.1:50051"
    """host:port of the gRPC tokenizer service (an IPv6 host in brackets: ``[fd00::1]:50051``)."""

    host: str = "127.0.0.1"
    """Address engines are told to send outputs to (the ZeroMQ reply address of every request);
    the HTTP and ZeroMQ sockets bind it too unless ``bind_host`` says otherwise. On Kubernetes
    the pod's IP."""

    bind_host: str | None = None
    """Address the HTTP server and the ZeroMQ output socket bind; None: ``host``. ``::`` listens
    on every IPv6 and IPv4 address (so that ``kubectl port-forward``, which connects to the pod's
    loopback, reaches them), ``0.0.0.0`` on every IPv4 one."""

    port: int = Field(default=8000, ge=1, le=65535)
    """HTTP port of the OpenAI API."""

    zmq_port: int = Field(default=5700, ge=1, le=65535)
    """Port of the PULL socket where engines send outputs."""

    redis_restart_grace_s: float = Field(default=10.0, ge=0.0)
    """After Redis restarts empty, how long engines whose records vanished keep serving while
    they register again (a missing record otherwise means the engine died)."""

    engine_silence_grace_s: float = Field(default=1.0, ge=0.0)
    """How long an engine whose heartbeat lapsed keeps its requests (getting no new ones) before
    they go on elsewhere; a heartbeat within it brings the engine back with nothing lost."""

    fleet_poll_interval_s: float = Field(default=0.1, gt=0.0, le=5.0)
    """How often the engine registry and load reports are read from Redis."""

    max_inflight_requests: int = Field(default=4096, ge=1)
    """Requests in flight at once; more wait in the admission queue."""

    max_queued_requests: int = Field(default=1024, ge=0)
    """Requests waiting for a slot at once; more are answered 429 with ``Retry-After``."""

    queue_timeout_s: float = Field(default=30.0, gt=0.0)
    """Longest wait for a slot; then 429 with ``Retry-After``."""

    zmq_curve_key_file: str | None = None
    """The fleet's CURVE key file (``shoal_protos.curve``): frames to and from engines are
    encrypted and only fleet members connect. None: plain ZeroMQ."""

    fleet_tls_dir: str | None = None
    """The fleet's TLS folder (``shoal_protos.tls``), for the balancer's calls to engines'
    EngineControl where the engines ask for mutual TLS. None: plain calls."""

    engine_send_hwm: int = Field(default=10_000, ge=1)
    """Frames queued per engine socket before the engine counts as overloaded (503)."""

    tokenizer_timeout_s: float = Field(default=10.0, gt=0.0)
    """Deadline of each tokenizer call."""

    max_dispatch_attempts: int = Field(default=3, ge=1)
    """Engines that may serve one request: one that refuses it (draining) or dies while serving
    it hands it to the next, which continues after the tokens already delivered."""

    scheduler: str = "least_load"
    """How an engine is picked for each request: a profile (``least_load``, ``round_robin``,
    ``prefix_affinity``, ``session_affinity``, ``prefix_cache``) or scorer weights such as
    ``prefix_cache=8,least_load=1`` (see ``core.scheduling``). ``prefix_cache`` follows what
    the engines' prefix caches hold (their ``--prefix-events``, on by default)."""

    prefix_blocks: int = Field(default=4, ge=1, le=1024)
    """Prompt blocks (``prefix_block_tokens`` tokens each) that prefix affinity keys on."""

    prefix_block_tokens: int = Field(default=16, ge=1, le=4096)
    """Tokens per block of prefix affinity's hash: a unit of the hash alone, whatever the
    engines' KV block size (each engine's own counts a prompt's KV demand)."""

    session_header: str = Field(default="x-session-id", min_length=1, pattern=r"^[A-Za-z0-9\-]+$")
    """The request header session affinity keys on."""

    hold_below: float = 2.0
    """Freeness (KV blocks left per batch slot, the request's prompt counted) under which a new
    request waits at the router for room instead of going to an engine that would preempt for
    it (``core.hold``)."""

    hold_max_s: float = Field(default=1.0, ge=0.0, le=60.0)
    """The longest a request waits for KV room before it goes out anyway (0: never held)."""

    balance: bool = False
    """Compete for the cluster's leader lease and, holding it, move running requests from
    crowded engines to free ones (``core.rebalance``; engines need ``--migration``)."""

    balance_interval_s: float = Field(default=1.0, gt=0.0)
    """How often the leader compares the engines."""

    balance_threshold: float = Field(default=0.1, gt=0.0, le=1.0)
    """Lead in freeness (fraction of the KV cache per batch slot) that calls for a move."""

    balance_cooldown_s: float = Field(default=5.0, ge=0.0)
    """An engine that took part in a balancing move is left alone this long after it."""

    consolidate_below: float = Field(default=0.0, ge=0.0, lt=1.0)
    """With ``balance``: empty the least-loaded engine while the model's load (KV blocks and
    batch slots in use) over the engines left stays below this fraction, so the autoscaler can
    remove it (0: never)."""

    consolidate_release: float = Field(default=0.7, gt=0.0, le=1.0)
    """Give an emptying engine back to dispatch once the load over the others passes this."""

    leader_ttl_s: float = Field(default=5.0, gt=0.0)
    """The leader lease's lifetime: a dead leader's successor takes over after it."""

    retry_after_s: int = Field(default=1, ge=1)
    """``Retry-After`` of 503 answers when no engine can serve."""

    api_keys_file: str | None = None
    """Keys file (``NAME SHA256_HEX`` per line) guarding ``/v1/*``; None: no auth."""

    key_requests_per_minute: int = Field(default=0, ge=0)
    """Requests per minute per API key, for keys whose line sets no ``rpm=`` (0: no limit)."""

    key_tokens_per_minute: int = Field(default=0, ge=0)
    """Prompt plus output tokens per minute per API key, for keys whose line sets no ``tpm=``
    (0: no limit)."""

    admin_keys_file: str | None = None
    """Keys file guarding ``/metrics`` and the fleet page; None: open."""

    @property
    def listen_host(self) -> str:
        """The address the listening sockets bind: ``bind_host``, else ``host``."""
        return resolve_bind_host(self.bind_host, self.host)

    @property
    def reply_to(self) -> str:
        """The output socket's address as engines reach it."""
        return tcp_url(self.host, self.zmq_port)

    @property
    def zmq_bind(self) -> str:
        return tcp_url(self.listen_host, self.zmq_port)

    @field_validator("scheduler")
    @classmethod
    def _known_scheduler(cls, value: str) -> str:
        Scheduler(value)  # raises ValueError naming what is wrong
        return value

    @model_validator(mode="after")
    def _release_above_start(self) -> RouterConfig:
        if self.consolidate_below and self.consolidate_release <= self.consolidate_below:
            raise ValueError(
                f"consolidate_release ({self.consolidate_release}) must be above consolidate_below "
                f"({self.consolidate_below})"
            )
        return self


CLI_ALIASES: dict[str, str] = {
    "--model": "models",
    "--tokenizer": "tokenizer_address",
    "--max-inflight": "max_inflight_requests",
    "--max-queued": "max_queued_requests",
    "--queue-timeout": "queue_timeout_s",
    "--max-attempts": "max_dispatch_attempts",
    "--key-rpm": "key_requests_per_minute",
    "--key-tpm": "key_tokens_per_minute",
    "--hold-max": "hold_max_s",
    "--balance-interval": "balance_interval_s",
    "--balance-cooldown": "balance_cooldown_s",
    "--redis-restart-grace": "redis_restart_grace_s",
    "--engine-silence-grace": "engine_silence_grace_s",
}
"""Flag spellings of earlier releases -> the field each sets: manifests written for them keep
working."""
