"""The floor under the router's relay delay: a bare uvloop server that does nothing but write.

It accepts ``--streams`` HTTP connections, answers each with a chunked SSE response, and once
all of them are in, every ``--period-ms`` (an engine step) writes one SSE event of the size the
router writes to every connection in one go, ``--tokens`` times, then ends each stream with a
usage event as the router does. No decoding, no mailboxes, no ASGI: one ``transport.write`` per
event, the least any single-threaded Python server pays to hand a step's tokens to its
clients. For each event it records the time from the start of its burst to the moment the write
returned (the router's ``shoal_router_relay_delay_seconds`` measures the same span from the
engine batch being read), and prints, as one JSON line at the end: the delays' p50 / p90 / p99
(ms), its CPU per write (us) and the kernel's share of it.

``bench.relay`` runs it beside each paced round (same streams, same tokens, the engines'
step time as the period) and reads it with the same client.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import resource
import time
from typing import cast

import uvloop

from bench.harness import quantiles

HEADERS = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"
)
# The size of one of the router's SSE events for a one-token completion chunk.
EVENT = (
    b'data: {"id":"cmpl-00000000000000000000000000000000","object":"text_completion",'
    b'"created":1764900000,"model":"sim-relay","choices":[{"index":0,"text":" x",'
    b'"logprobs":null,"finish_reason":null}]}\n\n'
)


def chunk(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(body), body)


class Connection(asyncio.Protocol):
    def __init__(self, server: FanOut) -> None:
        self._server = server
        self._request = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._request is None:
            return  # the request was read already
        self._request += data
        if b"\r\n\r\n" in self._request:
            self._request = None  # type: ignore[assignment]
            self.transport.write(HEADERS)
            self._server.joined(self)


class FanOut:
    def __init__(self, streams: int, tokens: int, period_s: float, threads: int = 1) -> None:
        self.streams, self.tokens, self.period_s, self.threads = streams, tokens, period_s, threads
        self.connections: list[Connection] = []
        self.delays: list[float] = []
        self.done = asyncio.get_running_loop().create_future()
        self._relay: asyncio.Task[None] | None = None

    async def _relay_threads(self, event: bytes) -> None:
        """The same bursts, each split over ``threads`` threads that write to the connections'
        descriptors with ``os.write`` (which lets go of the interpreter's lock during the system
        call), so that the kernel's share of the writes runs on several cores at once."""
        clock = time.perf_counter
        fds = [c.transport.get_extra_info("socket").fileno() for c in self.connections]
        groups = [fds[i :: self.threads] for i in range(self.threads)]

        def write(group: list[int], started: float) -> list[float]:
            out = []
            for fd in group:
                os.write(fd, event)
                out.append(clock() - started)
            return out

        with concurrent.futures.ThreadPoolExecutor(self.threads) as pool:
            next_step = clock()
            for _ in range(self.tokens):
                next_step += self.period_s
                started = clock()
                for done in [pool.submit(write, group, started) for group in groups]:
                    self.delays.extend(done.result())
                await asyncio.sleep(max(0.0, next_step - clock()))

    def joined(self, connection: Connection) -> None:
        self.connections.append(connection)
        if len(self.connections) == self.streams:
            self._relay = asyncio.ensure_future(self.relay())

    async def relay(self) -> None:
        event, clock, delays = chunk(EVENT), time.perf_counter, self.delays
        usage = chunk(
            b'data: {"id":"cmpl-0","object":"text_completion","created":1764900000,"model":"sim-relay",'
            b'"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":%d,"total_tokens":%d}}\n\n'
            % (self.tokens, self.tokens + 4)
        )
        ending = usage + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        before = resource.getrusage(resource.RUSAGE_SELF)
        next_step = clock()
        if self.threads > 1:
            await self._relay_threads(event)
        else:
            for _ in range(self.tokens):
                next_step += self.period_s
                started = clock()
                for connection in self.connections:
                    connection.transport.write(event)
                    delays.append(clock() - started)
                await asyncio.sleep(max(0.0, next_step - clock()))
        after = resource.getrusage(resource.RUSAGE_SELF)
        for connection in self.connections:
            connection.transport.write(ending)
        self.done.set_result((after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime))


async def serve(args: argparse.Namespace) -> None:
    fan_out = FanOut(args.streams, args.tokens, args.period_ms / 1000, args.threads)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Connection(fan_out), "127.0.0.1", args.port, backlog=4096)
    print("ready", flush=True)
    user, system = await fan_out.done
    writes = len(fan_out.delays)
    p50, p90, p99 = quantiles(fan_out.delays, [0.5, 0.9, 0.99])
    print(
        json.dumps(
            {
                "writes": writes,
                "delay_p50_ms": p50 * 1000,
                "delay_p90_ms": p90 * 1000,
                "delay_p99_ms": p99 * 1000,
                "cpu_us_per_write": (user + system) / writes * 1e6,
                "system_share": system / (user + system) if user + system else 0.0,
            }
        ),
        flush=True,
    )
    await asyncio.sleep(1.0)  # let the clients read the ends of their streams
    server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--streams", type=int, required=True)
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--period-ms", type=float, required=True)
    parser.add_argument("--threads", type=int, default=1, help="write each burst from this many threads")
    uvloop.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
