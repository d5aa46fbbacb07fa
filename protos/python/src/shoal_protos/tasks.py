"""Tasks that must not end unseen.

A long-lived task (the router's ZeroMQ ingest, its fleet poll, its balancer) that ends on an
unexpected exception while its process goes on leaves a half-dead service: no outputs read, say,
while ``/health`` stays green and heartbeats go on. ``Supervisor`` starts such tasks; one that
ends other than by cancellation is logged with its traceback and recorded in ``failed``, which
the process's liveness probe reports (503), so that Kubernetes restarts it; ``on_failure`` lets
a process end at once instead (the engine does).

``background`` is for work nobody waits on (an abort sent to an old owner, a staging area freed,
a record written): the event loop keeps only a weak reference to a task, so it holds one until
the task ends, and logs the exception the task ends with, which would otherwise be lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

_RUNNING: set[asyncio.Task[Any]] = set()


class Supervisor:
    def __init__(self, on_failure: Callable[[str, BaseException], None] | None = None) -> None:
        self.failed: dict[str, str] = {}
        """Each task that ended while it should have run, by name: why."""
        self.stopping = False
        """Set when the process stops: its tasks may end then."""
        self._on_failure = on_failure

    def start(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Run ``coro`` as a task that must run until it is cancelled."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or self.stopping:
            return
        name = task.get_name()
        exc = task.exception()
        if exc is None:
            exc = RuntimeError(f"task {name} returned")
            logger.error("task %s returned while it should run on", name)
        else:
            logger.error("task %s failed", name, exc_info=exc)
        self.failed[name] = f"{type(exc).__name__}: {exc}"
        if self._on_failure is not None:
            self._on_failure(name, exc)


def background(coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
    """Run ``coro`` with nobody waiting on it: kept alive until it ends, its exception logged."""
    task = asyncio.get_running_loop().create_task(coro, name=name)
    _RUNNING.add(task)
    task.add_done_callback(_background_ended)
    return task


def _background_ended(task: asyncio.Task[Any]) -> None:
    _RUNNING.discard(task)
    if not task.cancelled() and task.exception() is not None:
        logger.error("background task %s failed", task.get_name(), exc_info=task.exception())
