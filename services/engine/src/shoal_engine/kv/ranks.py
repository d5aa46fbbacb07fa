"""Where each vLLM worker of an engine keeps its KV agent.

An engine of several workers (tensor parallel size x pipeline parallel size) holds its KV cache
in shards: with tensor parallelism each worker holds its share of every layer's KV heads, with
pipeline parallelism its stage's layers. Each worker runs its own KV agent next to its shard,
on ports of its own: rank 0 on the engine's KV ports, each further rank ``RANK_PORT_STRIDE``
ports past the one before. A move sends each rank's shard to the same rank on its target, so
the port of a target's rank ``r`` is found from the target's one data address.

The rank is vLLM's: ``tp_rank + pp_rank x tensor_parallel_size``.
"""

from __future__ import annotations

from shoal_protos.addresses import split_host_port, tcp_url

RANK_PORT_STRIDE = 2
"""Ports each worker's agent takes: its data socket, and its control socket one above."""


def rank_address(address: str, rank: int) -> str:
    """The agent address of worker ``rank`` of the engine whose rank-0 agent is at ``address``
    (``tcp://host:port``; an ``ipc://`` path gets the rank as a suffix)."""
    if rank == 0:
        return address
    if address.startswith("ipc://"):
        return f"{address}.rank{rank}"
    host, port = split_host_port(address)
    return tcp_url(host, port + RANK_PORT_STRIDE * rank)


def worker_addresses(control: str, data: str, rank: int) -> tuple[str, str]:
    """The control and data addresses of worker ``rank``'s agent, from rank 0's: no two workers
    of one engine ask for the same port."""
    return rank_address(control, rank), rank_address(data, rank)
