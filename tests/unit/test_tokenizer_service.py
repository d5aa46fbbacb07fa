"""The tokenizer service with SmolLM2's real tokenizer behind a real gRPC server: a prompt of
megabytes is tokenized off the server's event loop (the loop goes on answering meanwhile),
input over the size limit is refused with INVALID_ARGUMENT before any work, and the prompt's
blocks are hashed in the block sizes asked for."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from shoal_protos import tokenizer_pb2 as pb
from shoal_protos import tokenizer_pb2_grpc as pb_grpc
from shoal_protos.prefix import chain_hashes
from shoal_router.ipc.tokenizing import TokenizerClient
from shoal_tokenizer import main as tokenizer_main
from shoal_tokenizer.config import pod_cpus
from shoal_tokenizer.service import load_model
from tests.integration.support import MODELS, free_port

SMOL = MODELS / "SmolLM2-135M-Instruct"
LIMIT = 4_000_000


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
async def stub(port: int) -> AsyncIterator[pb_grpc.TokenizerStub]:
    config = tokenizer_main.parse_args(
        ["--models", f"smol={SMOL}", "--port", str(port), "--threads", "2", "--max-input-chars", str(LIMIT)]
    )
    server, _ = await tokenizer_main.start_server(config, {"smol": load_model("smol", SMOL)})
    channel = grpc.aio.insecure_channel(
        f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 64 << 20)]
    )
    try:
        yield pb_grpc.TokenizerStub(channel)
    finally:
        await channel.close()
        await server.stop(None)


async def test_a_huge_prompt_is_tokenized_while_the_loop_goes_on(stub: pb_grpc.TokenizerStub) -> None:
    # Client and server share this event loop: a tokenizer working on the loop would stop the
    # ticker for as long as the prompt takes.
    text = "hello world, this is a long prompt. " * 100_000  # 3.6 million characters
    gaps: list[float] = []

    async def tick() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    started = time.monotonic()
    reply = await stub.Tokenize(pb.TokenizeRequest(model="smol", text=text, add_special_tokens=False))
    took = time.monotonic() - started
    ticker.cancel()
    assert len(reply.token_ids) > 800_000
    # The ticker ran all along: its longest wait is a small part of the tokenizing's time.
    assert max(gaps) < took / 3, (max(gaps), took)
    small = await stub.Tokenize(pb.TokenizeRequest(model="smol", text="hello", add_special_tokens=False))
    assert len(small.token_ids) == 1


async def test_input_over_the_limit_is_refused_with_a_clear_reason(stub: pb_grpc.TokenizerStub) -> None:
    too_long = "x" * (LIMIT + 1)
    requests = [
        pb.TokenizeRequest(model="smol", text=too_long),
        pb.TokenizeRequest(
            model="smol",
            chat=pb.ChatMessages(
                messages=[pb.ChatMessage(role="user", content=too_long[: LIMIT // 2 + 1])] * 2
            ),
        ),
    ]
    for request in requests:
        for call in (stub.Tokenize, stub.CountTokens):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call(request)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"over this tokenizer's limit of {LIMIT:,}" in (refused.value.details() or "")


async def test_the_prompts_blocks_are_hashed_in_each_block_size_asked_for(
    stub: pb_grpc.TokenizerStub, port: int
) -> None:
    text = "the same words again and again, " * 200
    reply = await stub.Tokenize(
        pb.TokenizeRequest(model="smol", text=text, add_special_tokens=False, block_sizes=[16, 128, 16])
    )
    ids = list(reply.token_ids)
    assert len(ids) > 1000
    assert [b.block_size for b in reply.block_hashes] == [16, 128]
    for blocks in reply.block_hashes:
        assert list(blocks.hashes) == chain_hashes(ids, blocks.block_size)
        assert len(blocks.hashes) == len(ids) // blocks.block_size
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=text)], add_generation_prompt=True)
    reply = await stub.Tokenize(pb.TokenizeRequest(model="smol", chat=chat, block_sizes=[16]))
    assert list(reply.block_hashes[0].hashes) == chain_hashes(list(reply.token_ids), 16)
    assert not (await stub.Tokenize(pb.TokenizeRequest(model="smol", text=text))).block_hashes
    # As the router's client hands them to dispatch.
    client = TokenizerClient(f"127.0.0.1:{port}", 30.0)
    try:
        tokenized = await client.tokenize_chat("smol", [("user", text)], block_sizes=(16,))
        assert tokenized.ids == list(reply.token_ids)
        assert tokenized.block_hashes == {16: chain_hashes(tokenized.ids, 16)}
        assert (await client.tokenize_text("smol", text)).block_hashes == {}
    finally:
        await client.close()
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Tokenize(pb.TokenizeRequest(model="smol", text=text, block_sizes=[0]))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "block sizes must be 1 to 65536" in (refused.value.details() or "")


def test_the_threads_default_to_the_cpus_this_process_may_use() -> None:
    assert 1 <= pod_cpus() <= len(os.sched_getaffinity(0))
    assert tokenizer_main.parse_args(["--models", "m=/m"]).threads == pod_cpus()
