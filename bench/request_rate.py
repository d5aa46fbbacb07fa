"""Request-rate benchmark: how many short requests one router takes in, answers and closes a
second, its CPU per request, and the latency clients see; side by side with the Rust
``vllm-router`` relaying the same requests.

Method
------
The fleet of ``bench.relay`` (a Redis, ``--engines`` simulated engines emitting tokens as
fast as this machine lets them, real router processes). ``--clients`` clients each hold one
keep-alive connection to the router and send one request after another, for ``--seconds``
after a warm-up: a ``/v1/completions`` request for ``--tokens`` tokens of a 4-token prompt
(token ids, no tokenizer), as JSON (``stream: false``) or as SSE (``--kinds``). The client is a
bare asyncio protocol on uvloop with httptools' parser, as in the relay benchmark. It reports:

* requests/s: responses completed over the round's time;
* router CPU per request: the router's CPU time (user + system, through psutil) over the
  round divided by the requests it answered; the same for the engines;
* latency p50/p99: from the request's first byte written to its response's last byte read.

The same rounds run with the clients talking to ``vllm-router`` (round robin) whose one worker is
the Shoal router, so both handle the same requests and each one's CPU per request is read on
them. On two cores the router, the engines and the client share the CPU: requests/s is a floor
set by the whole machine; CPU per request is the router's own cost. Results go between
``<!-- requests:begin -->`` and ``<!-- requests:end -->`` of ``docs/benchmarks.md``. Run it with
``python -m bench.request_rate`` (``make bench-requests``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import httptools
import psutil
import uvloop

from bench.harness import publish, quantile, stamp, table
from bench.relay import MODEL, cpu_seconds, fleet

BEGIN, END = "<!-- requests:begin -->", "<!-- requests:end -->"


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)
    tokens: int = 0
    errors: list[str] = field(default_factory=list)


class KeepAlive(asyncio.Protocol):
    """One keep-alive connection that sends one request at a time and reads its response
    with httptools' parser; ``send`` resolves with the status and body."""

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._body: list[bytes] = []
        self._reply: asyncio.Future[tuple[int, bytes]] | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def send(self, request: bytes) -> asyncio.Future[tuple[int, bytes]]:
        self._body = []
        self._reply = asyncio.get_running_loop().create_future()
        self._transport.write(request)
        return self._reply

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"bad HTTP from the router: {exc}")

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._reply is not None and not self._reply.done():
            self._reply.set_result((self._parser.get_status_code(), b"".join(self._body)))

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(f"connection lost: {exc!r}")
        if not self.closed.done():
            self.closed.set_result(None)

    def _fail(self, error: str) -> None:
        if self._reply is not None and not self._reply.done():
            self._reply.set_exception(ConnectionError(error))
        self._transport.close()


def request_bytes(url: str, tokens: int, stream: bool, i: int) -> bytes:
    body = {
        "model": MODEL,
        "prompt": [100 + i % 997, 200 + i % 991, 300, 400],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    data = json.dumps(body).encode()
    netloc = urllib.parse.urlsplit(url).netloc
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


def completion_tokens(body: bytes, stream: bool) -> int:
    """The output tokens a response's usage reports."""
    if not stream:
        return int(json.loads(body)["usage"]["completion_tokens"])
    for event in body.split(b"\n\n"):
        if event.startswith(b"data: {") and b'"choices":[]' in event:
            return int(json.loads(event[6:])["usage"]["completion_tokens"])
    raise ValueError("no usage event in the stream")


async def client(url: str, i: int, tokens: int, stream: bool, until: float, tally: Tally) -> None:
    """Requests one after another on one connection until ``until`` (perf_counter)."""
    address = urllib.parse.urlsplit(url)
    loop = asyncio.get_running_loop()
    _, conn = await loop.create_connection(KeepAlive, address.hostname, address.port)
    request = request_bytes(url, tokens, stream, i)
    clock = time.perf_counter
    try:
        while clock() < until:
            sent = clock()
            try:
                status, body = await asyncio.wait_for(conn.send(request), 60)
            except (ConnectionError, TimeoutError) as exc:
                tally.errors.append(repr(exc))
                return
            if status != 200:
                tally.errors.append(f"HTTP {status}: {body[:200]!r}")
                continue
            got = completion_tokens(body, stream)
            if got != tokens:
                tally.errors.append(f"{got} tokens arrived, {tokens} were asked for")
            tally.latencies.append(clock() - sent)
            tally.tokens += got
    finally:
        conn._transport.close()


async def round_of(url: str, clients: int, tokens: int, stream: bool, seconds: float) -> Tally:
    tally = Tally()
    until = time.perf_counter() + seconds
    await asyncio.gather(*(client(url, i, tokens, stream, until, tally) for i in range(clients)))
    return tally


def measure(
    args: argparse.Namespace,
    clients: int,
    stream: bool,
    folder: Path,
    front: bool,
    router_src: str | None = None,
) -> dict[str, float]:
    with fleet(args, 1, folder, router_src, front) as running:
        uvloop.run(round_of(running.urls[0], min(clients, 8), args.tokens, stream, 1.0))  # warm-up
        router = [psutil.Process(pid) for pid in running.pids]
        engines = [psutil.Process(pid) for pid in running.engine_pids]
        fronts = [psutil.Process(running.front_pid)] if running.front_pid else []
        router_before, engine_before, front_before = (
            cpu_seconds(router),
            cpu_seconds(engines),
            cpu_seconds(fronts),
        )
        client_before = cpu_seconds([psutil.Process()])
        started = time.perf_counter()
        tally = uvloop.run(round_of(running.urls[0], clients, args.tokens, stream, args.seconds))
        wall = time.perf_counter() - started
        client_cpu = cpu_seconds([psutil.Process()]) - client_before
        router_cpu = cpu_seconds(router) - router_before
        engine_cpu = cpu_seconds(engines) - engine_before
        front_cpu = cpu_seconds(fronts) - front_before
    done = len(tally.latencies)
    latencies = tally.latencies

    def per_request(cpu: float) -> float:
        return cpu / done * 1e6 if done else float("nan")

    row = {
        "clients": clients,
        "stream": stream,
        "front": front,
        "requests": done,
        "errors": len(tally.errors),
        "requests_per_s": done / wall,
        "router_us": per_request(router_cpu),
        "engine_us": per_request(engine_cpu),
        "front_us": per_request(front_cpu) if front else float("nan"),
        "client_us": per_request(client_cpu),
        "router_cores": router_cpu / wall,
        "p50_ms": quantile(latencies, 0.5) * 1000 if done else float("nan"),
        "p99_ms": quantile(latencies, 0.99) * 1000 if done else float("nan"),
    }
    kind = "SSE " if stream else "JSON"
    label = ("vllm-router + " if front else "") + ("baseline" if router_src else "router")
    front_note = f", vllm-router {row['front_us']:.0f} us/request" if front else ""
    print(
        f"  {label:<20} {kind} {clients:>4} clients: {row['requests_per_s']:7.0f} requests/s, router "
        f"{row['router_us']:.0f} us/request ({row['router_cores']:.2f} cores){front_note}, engines "
        f"{row['engine_us']:.0f} us/request, client {row['client_us']:.0f} us/request, latency p50 "
        f"{row['p50_ms']:.2f} ms p99 {row['p99_ms']:.2f} ms, {len(tally.errors)} errors",
        flush=True,
    )
    if tally.errors:
        print(f"    first error: {tally.errors[0]}", flush=True)
    return row


def section(args: argparse.Namespace, rows: list[dict[str, float]]) -> str:
    lines = [
        BEGIN,
        "## Request rate: short requests through one router",
        "",
        f"`make bench-requests`: {args.engines} simulated engines (A100 step model at x{args.sim_speed:g}) "
        f"and one router; each client holds one keep-alive connection and sends a `/v1/completions` "
        f"request for {args.tokens} token{'' if args.tokens == 1 else 's'} of a 4-token prompt after "
        f"another, for {args.seconds:g} s. "
        f"The router, the engines and the client share this machine's {os.cpu_count()} cores, so "
        "requests/s is bounded by the whole machine; CPU per request is each process's own cost. "
        "With vllm-router, the clients talk to the Rust `vllm-router` (round robin) whose one worker "
        "is the Shoal router: both handle the same requests.",
        "",
        stamp(),
        "",
    ]
    header = [
        "response", "clients", "in front", "requests/s", "Shoal router CPU per request",
        "vllm-router CPU per request", "engines' CPU per request", "latency p50", "p99", "errors",
    ]  # fmt: skip
    cells = [
        [
            "SSE" if r["stream"] else "JSON",
            f"{r['clients']}",
            "vllm-router" if r["front"] else "-",
            f"{r['requests_per_s']:,.0f}",
            f"{r['router_us']:.0f} us",
            f"{r['front_us']:.0f} us" if r["front"] else "-",
            f"{r['engine_us']:.0f} us",
            f"{r['p50_ms']:.2f} ms",
            f"{r['p99_ms']:.2f} ms",
            f"{r['errors']}",
        ]
        for r in rows
    ]
    lines += table(header, "lrlrrrrrrr", cells)
    lines.append(END)
    return "\n".join(lines)


def compare(rows: list[dict[str, float]], baseline_rows: list[dict[str, float]]) -> str:
    """A markdown table of the baseline router against this one, round by round."""
    header = [
        "response", "clients", "in front", "requests/s, baseline", "this router",
        "router CPU per request, baseline", "this router",
    ]  # fmt: skip
    cells = [
        [
            "SSE" if new["stream"] else "JSON",
            f"{new['clients']}",
            "vllm-router" if new["front"] else "-",
            f"{old['requests_per_s']:,.0f}",
            f"{new['requests_per_s']:,.0f}",
            f"{old['router_us']:.0f} us",
            f"{new['router_us']:.0f} us",
        ]
        for new, old in zip(rows, baseline_rows, strict=True)
    ]
    return "\n".join(table(header, "lrlrrrr", cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--clients", default="16,64,256", help="clients per round, comma-separated")
    parser.add_argument("--kinds", default="json,sse", help="json and/or sse responses")
    parser.add_argument("--tokens", type=int, default=1, help="tokens each request asks for")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of a round")
    parser.add_argument("--sim-speed", type=float, default=8.0)
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--no-vllm-router", action="store_true", help="skip the rounds through vllm-router")
    parser.add_argument("--no-docs", action="store_true", help="print only; leave docs/benchmarks.md")
    parser.add_argument(
        "--baseline-src",
        help="also run every round with the router package at this path (another checkout's "
        "services/router/src), for a before/after in one run",
    )
    args = parser.parse_args()
    args.router_cpu = 0.0  # the relay fleet's option: no CPU quota here
    rows: list[dict[str, float]] = []
    baseline_rows: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="shoal-requests-") as tmp:
        for kind in args.kinds.split(","):
            for clients in (int(c) for c in args.clients.split(",")):
                for front in (False,) if args.no_vllm_router else (False, True):
                    print(
                        f"  starting the fleet: {kind}, {clients} clients{', vllm-router' * front}",
                        flush=True,
                    )
                    folder = Path(tempfile.mkdtemp(prefix=f"{kind}-c{clients}-", dir=tmp))
                    rows.append(measure(args, clients, kind == "sse", folder, front))
                    if args.baseline_src:
                        folder = Path(tempfile.mkdtemp(prefix=f"baseline-{kind}-c{clients}-", dir=tmp))
                        baseline_rows.append(
                            measure(args, clients, kind == "sse", folder, front, args.baseline_src)
                        )
    if baseline_rows:
        print(compare(rows, baseline_rows))
    publish(section(args, rows), BEGIN, END, print_only=args.no_docs)
    if any(r["errors"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
