"""The asyncio driver of the client core's plans (h5replay.client._core): each operation is awaited
on an `AsyncConnection`, so many plans run at once on one event loop.

A coroutine cancelled while its plan waits has the CancelledError thrown into the plan, which
forgets its requests and re-raises it. `stream` drives a plan that delivers values (`batches`)
as an async iterator; closing it throws `LoopLeft` in, and the plan's cleanup (forgetting what
travels, or cancelling and keeping what a consuming draw drew) runs before it closes.
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

    async def run(self, plan: Plan[T], error: BaseException | None = None) -> T:
        """The plan's result (its exception raised), every operation awaited in turn; with
        `error`, the plan is resumed by throwing it in."""
        value: Any = None
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
        """The values the plan delivers, in order; closing the iterator lets the plan clean up,
        awaiting what its cleanup waits for (a consuming stream cancels and keeps what was drawn)."""
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
                    await self._leave(plan)  # an async generator may await while it closes
                    raise
                continue
            try:
                value = await self._do(op)
            except BaseException as exc:  # cancellation too: the plan cleans up, then re-raises it
                error = exc

    async def _leave(self, plan: Plan[Any]) -> None:
        """The caller left the loop: the plan's cleanup runs to its end (LoopLeft swallowed), in a
        task of its own that a second cancellation does not stop half-way."""
        async def clean_up() -> None:
            try:
                await self.run(plan, LoopLeft())
            except LoopLeft:
                pass

        await asyncio.shield(asyncio.get_running_loop().create_task(clean_up(), name="h5replay-leave"))
