"""KV-transfer wire contracts: the engine service <-> its KV agent, and agent <-> agent.

Every engine's vLLM worker runs a KV agent (``shoal_engine.kv.agent``) with two sockets:

* a control socket (ZeroMQ REP) for its own engine service: send a request's blocks to another
  engine, open a link ahead of time, free a staging area, read blocks back (tests compare them
  byte for byte);
* a data socket (a TCP or Unix stream) where other agents push staged blocks: each message is
  a 4-byte big-endian length and a ``DataMessage``. A ``StageHeader`` is followed by the chunk's
  bytes, one layer after the other (or, with ``via`` set, by nothing: the layers come over the
  pair's torch.distributed group, made by a ``PairJoin`` first), and answered by one
  length-prefixed ``StageAck``.

msgspec only, never pickle. Every message is a tagged struct, so one decoder reads the union.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec


class _Tagged(msgspec.Struct, tag=True, omit_defaults=True, kw_only=True):
    pass


# ---- engine service -> its agent (control socket) --------------------------------------


class SendBlocks(_Tagged):
    """Send blocks ``[first_block, ...)`` of a request to ``target`` (an agent's data address)
    into staging area ``migration_id``: the blocks full when the call runs (they never change
    again, so they go while the request decodes), and with ``partial`` its last, partly
    filled block too (for a request stopped and held, or one still ``running``: the steps vLLM
    runs after the send write past the tokens sent). A send during which vLLM preempted the
    request fails."""

    request_id: str
    migration_id: str
    target: str
    first_block: int
    max_blocks: int = 1 << 30
    partial: bool = False
    # Pace the send, so that a pre-copy leaves the engine's compute to its other requests: at
    # most this many bytes per second (0: as fast as it goes), and sending for at most this
    # share of the time since it began (0: no limit; after each chunk it waits out the rest).
    max_bytes_per_s: int = 0
    max_busy_share: float = 0.0
    # A paced send stops between chunks once it has run this long (0: never), and reports how
    # far it got (``SentBlocks.next_block``).
    max_seconds: float = 0.0
    # With ``partial``: let the request's blocks go once the send is over, sent or not (as a
    # ``Release`` does), so that the stopped request's hand-over waits for one call, not two.
    release: bool = False
    # With ``partial``, for a request that still runs: its last block goes as far as it is
    # written now (``SentBlocks.tokens_written``); the steps after write past that, and the
    # target computes those few tokens itself instead of waiting for the block again.
    running: bool = False


class Connect(_Tagged):
    """Open the transport's connection to ``target`` (an agent's data address) now, so that
    the first migration there does not pay for it."""

    target: str


class Hold(_Tagged):
    """Keep a request's blocks when it stops, until ``Release`` (or ``hold_s`` passes)."""

    request_id: str
    hold_s: float = 30.0


class Release(_Tagged):
    request_id: str


class FreeStaging(_Tagged):
    migration_id: str


class ReadBlocks(_Tagged):
    """Return the bytes of a request's blocks (all layers), for checks and tests."""

    request_id: str
    first_block: int
    num_blocks: int


class ReadStaged(_Tagged):
    migration_id: str


class AgentStatus(_Tagged):
    pass


class ReadSteps(_Tagged):
    """When the forward passes since ``since`` ended (``time.monotonic``, the machine's clock)."""

    since: float


AgentCommand = (
    SendBlocks | Connect | Hold | Release | FreeStaging | ReadBlocks | ReadStaged | AgentStatus | ReadSteps
)


class SentBlocks(_Tagged):
    """Reply to ``SendBlocks``: the request's next unsent block and what went over."""

    next_block: int
    blocks: int
    bytes: int
    seconds: float
    # Tokens whose KV the request had when the call ran; the blocks sent so far cover
    # ``min(next_block * block_size, tokens_written)`` of them.
    tokens_written: int
    # vLLM preempted the request while its blocks were on their way (they may belong to
    # another request now): nothing this call sent counts, ``next_block`` is where it began.
    preempted: bool = False


def lost_send(command: SendBlocks, sent_bytes: int, seconds: float) -> SentBlocks | AgentError:
    """The reply to a send during which vLLM preempted its request (its blocks freed, maybe
    reused): a pre-copy stage counts for nothing and goes again from the same block once the
    request has its blocks back; the send after a migration's stop (in the one step vLLM may
    still run) fails the move, and the source runs the request on."""
    if command.partial:
        return AgentError(message=f"request {command.request_id} lost its blocks while they were sent")
    return SentBlocks(
        next_block=command.first_block,
        blocks=0,
        bytes=sent_bytes,
        seconds=seconds,
        tokens_written=0,
        preempted=True,
    )


class BlockBytes(_Tagged):
    """Reply to ``ReadBlocks`` / ``ReadStaged``: blocks in order, all layers of block 0 first."""

    first_block: int
    num_blocks: int
    data: bytes


class Status(_Tagged):
    block_size: int
    num_layers: int
    bytes_per_block: int
    staging_areas: dict[str, int]
    staged_bytes: int
    tracked_requests: int
    # Source agents' connections the data port serves now.
    sources: int = 0


class Steps(_Tagged):
    """Reply to ``ReadSteps``: the ends of the forward passes, oldest first."""

    ended: list[float]


# An agent keeps the ends of this many forward passes: minutes of steps.
STEPS_KEPT = 4096


def steps_since(ends: Iterable[float], since: float) -> Steps:
    """The reply to ``ReadSteps(since)`` from an agent's kept step ends (oldest first)."""
    return Steps(ended=[t for t in ends if t >= since])


class AgentError(_Tagged):
    message: str


AgentReply = SentBlocks | BlockBytes | Status | Steps | AgentError | None


# ---- agent -> agent (data socket) --------------------------------------------------------


class StageHeader(_Tagged):
    migration_id: str
    first_block: int
    num_blocks: int
    bytes_per_block: int
    # "" (the layers follow as frames), "gloo" or "nccl" (they follow on the pair group).
    via: str = ""
    # Another chunk of the same send follows at once: over a pair group the receiver reads its
    # header and posts its receives before it waits for this chunk's bytes.
    more: bool = False


class PairJoin(_Tagged):
    """Join the sender's two-rank process group: it is rank 0 and hosts the rendezvous store."""

    pair_id: str
    backend: str
    store_host: str
    store_port: int


DataMessage = StageHeader | PairJoin


class StageAck(_Tagged):
    migration_id: str
    staged_blocks: int
    error: str = ""


agent_command_decoder = msgspec.msgpack.Decoder(AgentCommand)
agent_reply_decoder = msgspec.msgpack.Decoder(AgentReply)
data_message_decoder = msgspec.msgpack.Decoder(DataMessage)
stage_ack_decoder = msgspec.msgpack.Decoder(StageAck)
encoder = msgspec.msgpack.Encoder()
