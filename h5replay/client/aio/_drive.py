"""The asyncio driver of the client core's plans (h5replay.client._core): each operation is awaited
on an `AsyncConnection`, so many plans run at once on one event loop.

A coroutine cancelled while its plan waits has the CancelledError thrown into the plan, which
forgets its requests and re-raises it. `stream` drives a plan that delivers values (`batches`)
as an async iterator; closing it throws `LoopLeft` in, and the plan's cleanup (forgetting what
travels) runs at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from h5replay.client._core.ops import (
    READS,
    Deliver,
    FlushPriorities,
    Forget,
    LoopLeft,
    Now,
    Op,
    Plan,
    Send,
    Sleep,
    Wait,
)
from h5replay.client.aio._connection import AsyncConnection

__all__ = ["AsyncDriver"]

T = TypeVar("T")


class AsyncDriver:
    """Runs plans over the writer's connection and the readers' (the same object when the server
    answers reads itself)."""

    def __init__(self, writer: AsyncConnection, reads: AsyncConnection,
                 flush: Callable[[], Awaitable[None]] | None = None) -> None:
        self.writer = writer
        self.reads = reads
        self._flush = flush  # awaits the priority updates sent with wait=False (None: there are none)

    async def _do(self, op: Op) -> Any:
        if isinstance(op, Send):
            return await (self.reads if op.target == READS else self.writer).send(op.request, op.timeout)
        if isinstance(op, Wait):
            return await (self.reads if op.target == READS else self.writer).wait(op.request_id, op.timeout)
        if isinstance(op, Forget):
            (self.reads if op.target == READS else self.writer).forget(op.request_id)
        elif isinstance(op, Now):
            return asyncio.get_running_loop().time()
        elif isinstance(op, Sleep):
            await asyncio.sleep(op.seconds)
        elif isinstance(op, FlushPriorities):
            if self._flush is not None:
                await self._flush()
        elif not isinstance(op, Deliver):
            raise TypeError(f"a plan yielded {op!r}, which is no operation")
        return None

    async def run(self, plan: Plan[T]) -> T:
        """The plan's result (its exception raised), every operation awaited in turn."""
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                op = plan.send(value) if error is None else plan.throw(error)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            value, error = None, None
            try:
                value = await self._do(op)
            except BaseException as exc:  # cancellation too: the plan forgets what travels
                error = exc

    async def stream(self, plan: Plan[Any]) -> AsyncIterator[Any]:
        """The values the plan delivers, in order; closing the iterator lets the plan clean up."""
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                op = plan.send(value) if error is None else plan.throw(error)
            except StopIteration:
                return
            value, error = None, None
            if isinstance(op, Deliver):
                try:
                    yield op.value
                except GeneratorExit:
                    self._leave(plan)
                    raise
                continue
            try:
                value = await self._do(op)
            except BaseException as exc:
                error = exc

    def _leave(self, plan: Plan[Any]) -> None:
        """The caller left the loop: the plan forgets what travels (nothing here waits: an async
        generator being closed may not)."""
        error: BaseException | None = LoopLeft()
        value: Any = None
        while True:
            try:
                op = plan.send(value) if error is None else plan.throw(error)
            except (StopIteration, LoopLeft):
                return
            value, error = None, None
            if isinstance(op, Forget):
                (self.reads if op.target == READS else self.writer).forget(op.request_id)
            else:  # only a consuming plan would wait here, and this driver streams none
                plan.close()
                return
