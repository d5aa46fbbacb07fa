"""Fleet state in Redis: key names and the msgspec JSON records stored under them.

Every key lives under ``shoal:v1:<cluster>:`` so several clusters, and later versions of these
records, can share one Redis. Records are JSON so ``redis-cli get`` shows them as they are::

    shoal:v1:<cluster>:engines            SET of engine ids (an index; entries may be stale)
    shoal:v1:<cluster>:engine:<id>        EngineRecord, expires unless the engine heartbeats
    shoal:v1:<cluster>:load:<id>          LoadReport, rewritten at least every 100 ms
    shoal:v1:<cluster>:owner:<request>    OwnerRecord: the engine serving a request and its
                                          fencing generation (moves only forward)
    shoal:v1:<cluster>:migration:<id>     MigrationRecord, kept for a day
    shoal:v1:<cluster>:migrations         LIST of recent migration ids, newest first
    shoal:v1:<cluster>:prefix-events:<id> STREAM of the engine's prefix-cache changes
    shoal:v1:<cluster>:prefix-snapshot:<id>  every block in its prefix cache (``prefix``)

A stale id in the index is harmless: its ``engine:`` key has expired, so readers skip it and
remove it from the index.
"""

from __future__ import annotations

import enum
import os

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

KEY_VERSION = "v1"


class EngineState(enum.StrEnum):
    ACTIVE = "ACTIVE"
    """Takes new requests."""
    DRAINING = "DRAINING"
    """Finishes what it runs and takes nothing new (SIGTERM, scale-down)."""
    DEAD = "DEAD"
    """Stopped; kept only until the record expires."""


class EngineRecord(msgspec.Struct, omit_defaults=True, kw_only=True):
    engine_id: str
    model: str
    # The engine's PULL socket for ADD/ABORT frames.
    zmq_address: str
    # Base URL of /health and /metrics.
    http_address: str
    state: EngineState = EngineState.ACTIVE
    max_model_len: int
    kv_blocks_total: int = 0
    # Tokens per KV block (vLLM's block size), the unit of ``kv_blocks_total`` and of the load
    # reports' block counts; 0: not said (an engine from before it was), taken as 16.
    kv_block_size: int = 0
    # Requests the engine runs at once (its batch slots); 0: not said.
    max_num_seqs: int = 0
    pid: int = 0
    hostname: str = ""
    protocol_version: int
    started_at: float
    # gRPC EngineControl (migrations, drain); empty when migration is off.
    control_address: str = ""
    # The KV agent's data address (where migrated blocks are sent); empty when migration is off.
    kv_address: str = ""


class LoadReport(msgspec.Struct, omit_defaults=True, kw_only=True):
    engine_id: str
    # Grows by one with each report, so readers can tell a fresh report from one they saw.
    seq: int
    # Wall-clock time (seconds) when the engine wrote the report.
    time: float
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    # Mean engine step time over the last report period, in milliseconds.
    step_time_ms: float = 0.0
    # KV blocks routers should count as used on top of ``kv_blocks_used``: headroom the engine
    # keeps for its priority requests (Llumnix's virtual usage), so dispatch sends it less and
    # balancing moves other requests away.
    kv_blocks_reserved: int = 0
    # Requests (ADD frames) the engine took in from each router since it started, by the
    # router's output address (``AddRequest.reply_to``): a router counts what it sent that the
    # report cannot cover yet as exactly what it sent past this count.
    received: dict[str, int] = msgspec.field(default_factory=dict)
    # Requests of each router (by its output address) live on the engine as the report was
    # written: a router knows its own requests there exactly and as of now, so it counts only
    # the other routers' from the report. An engine's counts can be a report behind: the report
    # written just before its last requests ended says they run until the next one, and a
    # router reading it then would think an idle engine busy. None: the engine does not say.
    live: dict[str, int] | None = None


class OwnerRecord(msgspec.Struct, omit_defaults=True, kw_only=True):
    request_id: str
    engine_id: str
    generation: int
    router: str = ""


MIGRATION_PHASES = ("prepare", "precopy", "warm", "tail", "stop", "last_stage", "commit", "handover")
"""The parts of a move its source times (``MigrationRecord.phase_ms``), in the order they run."""

TARGET_PHASES = ("admit", "queue", "first_step", "output")
"""The parts of the hand-over its target times (``MigrationRecord.target_phase_ms``), from the
commit reaching it to the moved request's first token there: ``admit``, until the engine's
scheduler holds the request (the engine service and the engine's front end); ``queue``, until it
is first scheduled (the step in flight ends first); ``first_step``, until that step has sampled
its first token (the last blocks injected, the forward pass, sampling); ``output``, until the
token is back in the engine service."""


class MigrationRecord(msgspec.Struct, omit_defaults=True, kw_only=True):
    migration_id: str
    request_id: str
    source: str
    target: str
    reason: str
    # MIGRATED, REFUSED, FAILED or GONE.
    outcome: str
    detail: str = ""
    # Why it ended so, one word (``MigrationResult.code``); empty in records from before.
    code: str = ""
    stages: int = 0
    bytes: int = 0
    blocks: int = 0
    kv_tokens: int = 0
    # Of those, the leading tokens the target took into its prefix cache before the stop.
    warm_tokens: int = 0
    # The request's first full blocks the target held already (prefix cache): none of them sent.
    target_cached_blocks: int = 0
    total_tokens: int = 0
    downtime_ms: float = 0.0
    duration_ms: float = 0.0
    # Milliseconds of each part of the move on the source (``MIGRATION_PHASES``) it went through.
    phase_ms: dict[str, float] = {}
    # The mean time between the source's forward passes during the move and in as long a window
    # just before it (``MigrationResult.source_step_ms``; 0: not measured).
    source_step_ms: float = 0.0
    source_step_ms_before: float = 0.0
    # Wall clock when the source stopped the request; the target adds the gap its client saw
    # (its first token there minus the last one here) as ``stall_ms`` when it has one.
    stopped_at: float = 0.0
    stall_ms: float | None = None
    # Milliseconds of each part of the hand-over on the target (``TARGET_PHASES``), added with
    # ``stall_ms`` where its engine stamps them.
    target_phase_ms: dict[str, float] = {}
    finished_at: float = 0.0


class Keys:
    """Key names for one cluster."""

    def __init__(self, cluster: str) -> None:
        if not cluster or ":" in cluster:
            raise ValueError(f"cluster name {cluster!r} must be non-empty and contain no ':'")
        self.prefix = f"shoal:{KEY_VERSION}:{cluster}:"

    @property
    def engines(self) -> str:
        return self.prefix + "engines"

    def engine(self, engine_id: str) -> str:
        return f"{self.prefix}engine:{engine_id}"

    def load(self, engine_id: str) -> str:
        return f"{self.prefix}load:{engine_id}"

    def owner(self, request_id: str) -> str:
        return f"{self.prefix}owner:{request_id}"

    def migration(self, migration_id: str) -> str:
        return f"{self.prefix}migration:{migration_id}"

    @property
    def migrations(self) -> str:
        return self.prefix + "migrations"

    @property
    def epoch(self) -> str:
        """Set (without expiry) by every router poll that finds it missing: its absence means
        Redis lost its data (a restart without persistence), so every engine record vanished at
        once, and routers give engines time to register again instead of dropping them."""
        return self.prefix + "epoch"

    @property
    def leader(self) -> str:
        """The lease of the router that issues the cluster's balancing migrations (its id)."""
        return self.prefix + "leader"

    def prefix_events(self, engine_id: str) -> str:
        """The engine's prefix-cache changes (``shoal_protos.prefix.PrefixEvent``)."""
        return f"{self.prefix}prefix-events:{engine_id}"

    def prefix_snapshot(self, engine_id: str) -> str:
        """Every block in the engine's prefix cache (``shoal_protos.prefix.PrefixSnapshot``)."""
        return f"{self.prefix}prefix-snapshot:{engine_id}"

    def emptying(self, engine_id: str) -> str:
        """Present (the leader's id, with a TTL the leader renews) while the leader empties the
        engine for consolidation: routers send it no new requests."""
        return f"{self.prefix}emptying:{engine_id}"


json_encoder = msgspec.json.Encoder()
engine_record_decoder = msgspec.json.Decoder(EngineRecord)
load_report_decoder = msgspec.json.Decoder(LoadReport)
owner_record_decoder = msgspec.json.Decoder(OwnerRecord)
migration_record_decoder = msgspec.json.Decoder(MigrationRecord)


LOCAL_REDIS_URL = "redis://127.0.0.1:6379/0"
"""The Redis a service uses when told of none."""


def default_redis_url() -> str:
    """The Redis URL engines and routers use unless ``--redis-url`` names one: ``$REDIS_URL``,
    where a password belongs (every process on the node can read a command line), else
    ``LOCAL_REDIS_URL``."""
    return os.environ.get("REDIS_URL", LOCAL_REDIS_URL)


def state_client(url: str, timeout_s: float) -> aioredis.Redis:
    """A Redis client for fleet state, for loops that write or read it every few tens of ms.

    A call that finds its pooled connection closed by the server (Redis restarted, or dropped
    the client) is tried once more at once, on a new connection: otherwise the first call on
    every pooled connection after a restart fails, a move or a drain among them. Anything else
    fails after ``timeout_s`` and is not retried: the loop's next tick is the retry, and a call
    stuck in backoff would hold a heartbeat back past its TTL.
    """
    return aioredis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    )
