"""AsyncActorSegment: one episode streamed through an AsyncActorClient, as coroutines.

The same plans of the client core (h5replay.client._core.segments) as `ActorSegment`: rows
batched into messages, the segment opened by its first full message, appended, committed (or
pushed whole when it fits in one message) with its idempotency key, aborted when cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from typing import Any, Literal, overload

import numpy as np

from h5replay.client._core.actor import ActorState, Ready, push_request
from h5replay.client._core.segments import (
    SegmentFacts,
    SegmentRows,
    SegmentState,
    abort,
    commit_request,
    fail,
    send_rows,
    wait_appends,
)
from h5replay.client.aio._commits import AsyncPendingCommit, _one_outcome
from h5replay.client.aio._drive import AsyncDriver
from h5replay.priorities import Given, one_row_priorities
from h5replay.records import Receipt

__all__ = ["AsyncActorSegment"]


class AsyncActorSegment(SegmentFacts):
    """One episode being streamed, as coroutines: `await append`, `await extend`, then `await
    commit` or `await abort`. The same rules as `ActorSegment`: the server hears of it when its
    first full message leaves; an episode that fits in one message leaves whole at commit."""

    def __init__(self, client: Any, key: bytes | None = None) -> None:  # an AsyncActorClient (whose module imports this)
        self._client = client
        self._seg = SegmentState(key)
        self._rows: SegmentRows | None = None  # once the client is connected

    async def _ready(self) -> tuple[ActorState, AsyncDriver, SegmentRows]:
        state, driver = await self._client._ready()
        if self._rows is None:
            self._rows = SegmentRows(state.schema, state.rows_per_message, self._client.config.batch_seconds,
                                     time.monotonic)
        return state, driver, self._rows

    @property
    def state(self) -> str:
        """"open", "committing", "committed", "aborted" or "failed"."""
        return self._seg.status

    async def append(self, step: Any, priority: float | Mapping[str, float] | None = None) -> None:
        """Add one step (with its priority, as `ActorSegment.append` takes it); checked now, sent in
        a batch soon. A cancellation while its batch is sent aborts the episode."""
        self._seg.require_open("append to")
        state, driver, rows = await self._ready()
        if priority is None and rows.put_exact(step):
            self._seg.length += 1
            if rows.due():
                await self._send(driver, rows)
            return
        given = state.check_priorities(None if priority is None else one_row_priorities(priority), 1)
        await self._add(driver, rows, state.encode_one(step), 1, given)

    async def extend(self, batch: Any, priorities: Any = None) -> None:
        """Add a batch of steps (a leading axis on every leaf), with one priority per step if given."""
        self._seg.require_open("extend")
        state, driver, rows = await self._ready()
        encoded, n = state.encode_batch(batch)
        await self._add(driver, rows, encoded, n, state.check_priorities(priorities, n))

    async def extend_encoded(self, encoded: dict[str, np.ndarray], n: int, priorities: Given | None = None) -> None:
        """Add rows already checked and in storage form (`encode_batch`, `check_priorities`)."""
        self._seg.require_open("extend")
        _, driver, rows = await self._ready()
        await self._add(driver, rows, encoded, n, priorities)

    async def _add(self, driver: AsyncDriver, rows: SegmentRows, encoded: dict[str, np.ndarray], n: int,
                   priorities: Given | None) -> None:
        self._seg.length += n
        for taken in rows.add(encoded, n, priorities):
            await self._send(driver, taken)

    async def _send(self, driver: AsyncDriver, rows: Any) -> None:
        try:
            await driver.run(send_rows(self._seg, rows, self._client.config.max_in_flight))
        except asyncio.CancelledError:
            if self._seg.status == "open":  # cancelled before any reply said so: drop the episode
                rows_left = self._rows
                if rows_left is not None:
                    rows_left.clear()
                await driver.run(fail(self._seg, wait=False))
            raise

    def set_final(self, final: Any) -> None:
        """The observation after the episode's last step, sent with the commit (connect first;
        checked now). See `ActorSegment.set_final`."""
        self._seg.require_open("set the final observation of")
        self._seg.final = self._client.state.encode_final(final)

    def set_final_encoded(self, final: dict[str, np.ndarray] | None) -> None:
        self._seg.final = final

    @overload
    async def commit(self, *, wait: Literal[True] = True, final: Any = None) -> Receipt: ...
    @overload
    async def commit(self, *, wait: Literal[False], final: Any = None) -> AsyncPendingCommit: ...
    @overload
    async def commit(self, *, wait: bool, final: Any = None) -> Receipt | AsyncPendingCommit: ...

    async def commit(self, *, wait: bool = True, final: Any = None) -> Receipt | AsyncPendingCommit:
        """Send what is buffered, wait for every append, then commit (see `ActorSegment.commit`).
        With `wait=False` the appends are still waited for, and the commit is left in flight.

        Raises:
            RateLimitedError: the server's rate limit held the commit back; the segment stays
                open: commit again.
        """
        self._seg.require_open("commit")
        await self._ready()
        if final is not None:
            self.set_final(final)
        pending = await self._commit_pending(track=not wait)
        return await pending.result() if wait else pending

    async def _commit_pending(self, *, track: bool) -> AsyncPendingCommit:
        seg = self._seg
        state, driver, rows = await self._ready()
        limit = self._client.config.rate_limit_timeout
        if seg.segment_id is None:  # never left the client: one push
            taken = rows.peek()  # kept until the commit settles: a refused one may be made again
            if taken is None:
                seg.status, seg.receipt = "committed", Receipt(-1, -1, 0)
                return AsyncPendingCommit.done_with(seg.receipt, seg.key)
            ready = Ready(taken.arrays, taken.n, taken.priorities, seg.key, seg.final)
            client = self._client
            if track and client._must_queue():  # shares the client's next message (see push_episode)
                seg.status = "committing"
                pending: AsyncPendingCommit = client._enqueue(state, ready)
                index = pending._index
                pending._settling.add_done_callback(lambda done: self._settled(*_one_outcome(done, index)))
                return pending
            request = push_request([ready], limit)
        else:
            await self._send(driver, rows)
            await driver.run(wait_appends(seg))
            request = commit_request(seg, limit)
        try:
            sent: AsyncPendingCommit = await self._client._send_commit(request, seg.key, track=track,
                                                                       settled=self._settled)
        except BaseException:
            seg.status = "failed"  # it never left: not in doubt
            raise
        seg.status = "committing"
        return sent

    def _settled(self, receipt: Receipt | None, error: Exception | None) -> None:
        if error is None and self._rows is not None:
            self._rows.clear()
        if self._seg.settled(receipt, error):
            asyncio.get_running_loop().create_task(self._abandon(), name="h5replay-abort")

    async def _abandon(self) -> None:
        with contextlib.suppress(Exception):
            await self.abort()

    async def abort(self) -> None:
        """Drop the episode: nothing of it becomes visible. Safe to call twice."""
        if self._seg.status != "open":
            return
        _, driver, rows = await self._ready()
        await driver.run(abort(self._seg, rows))

    async def __aenter__(self) -> AsyncActorSegment:
        await self._ready()
        return self

    async def __aexit__(self, exc_type: object, *rest: object) -> None:
        if self._seg.status != "open":
            return
        if exc_type is None:
            await self.commit()
            return
        if self._rows is not None:
            self._rows.clear()
        _, driver, _ = await self._ready()
        # Leaving on an exception (a cancellation too): never wait for the server's word here.
        with contextlib.suppress(Exception):
            await driver.run(fail(self._seg, wait=False))

