"""The router's shutdown is bounded: a background task that ignores cancellation, or a client
whose close never returns, is logged and left behind instead of holding the process."""

from __future__ import annotations

import asyncio
import logging

import pytest

from shoal_router import main


async def _stubborn(release: asyncio.Event) -> None:
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        await release.wait()  # ignores the cancellation until the test lets it go


async def _quick() -> None:
    await asyncio.sleep(3600)


async def test_a_task_that_ignores_cancellation_is_logged_and_left(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(main, "STOP_WAIT_S", 0.2)
    release = asyncio.Event()
    stubborn = asyncio.create_task(_stubborn(release), name="stubborn")
    quick = asyncio.create_task(_quick(), name="quick")
    await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with caplog.at_level(logging.WARNING, logger="shoal.router"):
        await main._stop_tasks([stubborn, quick])
    assert loop.time() - started < 2.0
    assert quick.cancelled() and not stubborn.done()
    assert "task stubborn did not stop" in caplog.text and "test_router_shutdown.py" in caplog.text
    release.set()
    await stubborn


async def test_a_close_that_never_returns_is_given_up(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(main, "STOP_WAIT_S", 0.2)
    closed: list[str] = []

    async def close() -> None:
        closed.append("started")
        await asyncio.Event().wait()

    with caplog.at_level(logging.WARNING, logger="shoal.router"):
        await main._bounded("the stuck client", close())
    assert closed == ["started"]
    assert "closing the stuck client took over" in caplog.text
