"""AsyncShardedActor: the actor over several servers on asyncio.

The same routing plans as the blocking actor over shards (h5replay.client._shards.actor and
.segment: the home shard, the episode in flight moved whole when its shard is lost, an episode
in doubt kept and settled on its shard with its key), each shard's verb awaited on its own
`AsyncActorClient` / `AsyncActorSegment`. One call of the actor runs at a time (an asyncio lock,
let go while `settle` pauses), as the blocking router's thread lock does.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, overload

import numpy as np

from h5replay.client._shards._router import ActorPlan, Call
from h5replay.client._shards.actor import ActorRouting
from h5replay.client._shards.segment import SegmentRouting
from h5replay.client.aio._commits import AsyncPendingCommit
from h5replay.client.aio._shard_learner import AsyncRouting
from h5replay.errors import ClosedError
from h5replay.priorities import Given
from h5replay.records import Receipt

__all__ = ["AsyncShardedActor", "AsyncShardedSegment"]

T = TypeVar("T")


class AsyncShardedActor(AsyncRouting[Any], ActorRouting[Any]):
    """The routing of `AsyncActorClient(endpoints=[...])`: `await connect()` says hello to every
    shard at once (then only the shard written to stays connected), and every verb is a routing
    plan run here.

    Raises (at connect):
        ConfigError: the shards hold different spaces, or two endpoints reach the same file.
        ServerUnavailableError: no shard answered within the timeout.
    """

    def _new_client(self, endpoint: str) -> Any:
        return self._hello(endpoint)

    async def connect(self) -> None:
        self._check()
        await self._connect(self._after_hellos)

    async def run(self, plan: ActorPlan[T]) -> T:
        """The plan's result, each Call awaited in turn; a cancellation is thrown into the plan."""
        await self.connect()
        lock = self._serial()
        await lock.acquire()
        held = True
        try:
            value: Any = None
            error: BaseException | None = None
            while True:
                try:
                    op = plan.send(value) if error is None else plan.throw(error)
                except StopIteration as stop:
                    return stop.value  # type: ignore[no-any-return]
                value, error = None, None
                try:
                    if isinstance(op, Call):
                        value = op.fn()
                        if inspect.isawaitable(value):
                            value = await value
                    else:
                        lock.release()
                        held = False
                        await asyncio.sleep(op.seconds)
                        await lock.acquire()
                        held = True
                except BaseException as exc:  # noqa: B036 (cancellation too: the plan decides)
                    error = exc
        finally:
            if held:
                lock.release()

    def segment(self) -> AsyncShardedSegment:
        self._check()
        return AsyncShardedSegment(self)

    async def aclose(self) -> None:
        """Settle what is in doubt on shards that answer now, then close every shard's client,
        waiting for each. Safe to call twice."""
        if self.closed:
            return
        try:
            if self._hellos_done:
                await self.run(self._closing_plan())
            async with self._serial():
                await self._aclose_shards()
        finally:
            self.close()


class AsyncShardedSegment(SegmentRouting):
    """One episode written through `AsyncActorClient(endpoints=[...])`: `await append`, `await
    extend`, then `await commit` or `await abort` (see `ShardedSegment`). As an async context
    manager it commits on normal exit and aborts on an exception (a cancellation too)."""

    async def append(self, step: Any, priority: float | Mapping[str, float] | None = None) -> None:
        """Add one step (with its priority); checked now, sent soon."""
        await self._actor.connect()
        encoded, given = self._encoded_step(step, priority)
        await self._actor.run(self.add_plan(encoded, 1, given))

    async def extend(self, batch: Any, priorities: Any = None) -> None:
        """Add a batch of steps (a leading axis on every leaf), with one priority per step if given."""
        await self._actor.connect()
        await self._actor.run(self.add_plan(*self._encoded_batch(batch, priorities)))

    async def extend_encoded(self, encoded: dict[str, np.ndarray], n: int, priorities: Given | None = None) -> None:
        """Add rows already checked and in storage form (from `encode_batch`)."""
        await self._actor.run(self.add_plan(encoded, n, priorities))

    @overload
    async def commit(self, *, wait: Literal[True] = True, final: Any = None) -> Receipt: ...
    @overload
    async def commit(self, *, wait: Literal[False], final: Any = None) -> AsyncPendingCommit: ...

    async def commit(self, *, wait: bool = True, final: Any = None) -> Receipt | AsyncPendingCommit:
        """See `SegmentRouting.commit_plan`; always waited for (`wait=False`: a done pending)."""
        receipt: Receipt = await self._actor.run(self.commit_plan(final))
        return receipt if wait else AsyncPendingCommit.done_with(receipt, self.key)

    async def abort(self) -> None:
        """Drop the episode: nothing of it becomes visible. Safe to call twice."""
        await self._actor.run(self.abort_plan())

    async def __aenter__(self) -> AsyncShardedSegment:
        return self

    async def __aexit__(self, exc_type: object, *rest: object) -> None:
        if self._state != "open":
            return
        if exc_type is None:
            await self.commit()
            return
        try:
            await self._actor.run(self.abort_plan())
        except (ClosedError, asyncio.CancelledError):
            pass
