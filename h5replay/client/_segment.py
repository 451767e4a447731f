"""ActorSegment: one episode streamed to the server in batches, then committed or aborted.

The segment's rows, state and messages are the client core's (h5replay.client._core.segments);
this front runs them on the blocking driver of its client (`SegmentClient`: an ActorClient, or a
shard's client over several servers), which also holds the commits in flight.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import Any, Literal, Protocol, overload

import numpy as np

from h5replay.client._commits import PendingCommit, _Flight
from h5replay.client._core.actor import ActorState, Ready, Settled, push_request
from h5replay.client._core.segments import (
    SegmentFacts,
    SegmentRows,
    SegmentState,
    abort,
    commit_request,
    send_rows,
    wait_appends,
)
from h5replay.client._drive import BlockingDriver
from h5replay.config import ClientConfig
from h5replay.errors import ClosedError
from h5replay.priorities import Given, one_row_priorities
from h5replay.records import Receipt

__all__ = ["ActorSegment", "SegmentClient"]


class SegmentClient(Protocol):
    """What a segment needs of the client that opened it (an ActorClient)."""

    config: ClientConfig

    @property
    def state(self) -> ActorState: ...

    @property
    def driver(self) -> BlockingDriver: ...

    def _send_commit(self, request: Any, *, track: bool, settled: Settled | None = None) -> _Flight: ...

    def _queue_commit(self, rows: dict[str, np.ndarray], n: int, priorities: Given | None, key: bytes,
                      settled: Settled, final: dict[str, np.ndarray] | None = None) -> PendingCommit: ...


class ActorSegment(SegmentFacts):
    """One episode being streamed: `append`, `extend`, then `commit` or `abort`.

    The server hears of the segment only when its first full message leaves: an episode that
    fits in one message travels as a single push at commit (one round trip in all).
    """

    def __init__(self, client: SegmentClient, key: bytes | None = None) -> None:
        self._client = client
        self._config = client.config
        self._actor = client.state
        self._driver = client.driver
        self._seg = SegmentState(key)
        self._rows = SegmentRows(self._actor.schema, self._actor.rows_per_message, self._config.batch_seconds,
                                 time.monotonic)

    @property
    def abandon_on_failure(self) -> bool:
        """Abort the segment when its commit in flight is refused and leaves it open (a full
        disk, the rate limit): set by `push_episode`, whose caller holds the episode."""
        return self._seg.abandon_on_failure

    @abandon_on_failure.setter
    def abandon_on_failure(self, value: bool) -> None:
        self._seg.abandon_on_failure = value

    @property
    def _state(self) -> str:
        return self._seg.status

    def append(self, step: Any, priority: float | Mapping[str, float] | None = None) -> None:
        """Add one step (with its priority for every prioritized table of the server, or by table
        name: `{"replay": 2.0}`); checked against the space
        now, sent in a batch soon. A step of exactly the stored dtypes and shapes (a dict of
        ndarrays) is copied straight into the batch."""
        self._seg.require_open("append to")
        rows = self._rows
        if priority is None and rows.put_exact(step):
            self._seg.length += 1
            if rows.due():
                self._driver.run(send_rows(self._seg, rows, self._config.max_in_flight))
            return
        given = self._actor.check_priorities(None if priority is None else one_row_priorities(priority), 1)
        self._add(self._actor.encode_one(step), 1, given)

    def extend(self, batch: Any, priorities: Any = None) -> None:
        """Add a batch of steps (a leading axis on every leaf), with one priority per step if given
        (an array for every prioritized table, or {table: array})."""
        self._seg.require_open("extend")
        encoded, n = self._actor.encode_batch(batch)
        self.extend_encoded(encoded, n, self._actor.check_priorities(priorities, n))

    def extend_encoded(self, encoded: dict[str, np.ndarray], n: int, priorities: Given | None = None) -> None:
        """Add rows already checked and in storage form (from `ActorClient.encode_batch`), with
        priorities already checked (`check_priorities`; None: none given)."""
        self._seg.require_open("extend")
        self._add(encoded, n, priorities)

    def _send_buffered(self) -> None:
        """Send the rows buffered now as one append (opening the segment on the server first)."""
        self._driver.run(send_rows(self._seg, self._rows, self._config.max_in_flight))

    def _add(self, encoded: dict[str, np.ndarray], n: int, priorities: Given | None) -> None:
        self._seg.length += n
        for rows in self._rows.add(encoded, n, priorities):
            self._driver.run(send_rows(self._seg, rows, self._config.max_in_flight))

    def set_final(self, final: Any) -> None:
        """The observation after the episode's last step (the value of the server's one
        observation key, or a dict of its observation keys), sent with the commit. Checked now.

        Raises:
            ConfigError: the server keeps no final observations (`serve --observation-keys`).
            SpaceMismatchError: it is not the observation part of the server's space.
        """
        self._seg.require_open("set the final observation of")
        self._seg.final = self._actor.encode_final(final)

    def set_final_encoded(self, final: dict[str, np.ndarray] | None) -> None:
        """`set_final` of a final already checked and in storage form (`encode_final`)."""
        self._seg.final = final

    @overload
    def commit(self, *, wait: Literal[True] = True, final: Any = None) -> Receipt: ...
    @overload
    def commit(self, *, wait: Literal[False], final: Any = None) -> PendingCommit: ...
    @overload
    def commit(self, *, wait: bool, final: Any = None) -> Receipt | PendingCommit: ...

    def commit(self, *, wait: bool = True, final: Any = None) -> Receipt | PendingCommit:
        """Send what is buffered, wait for every append, then commit. Returns after the server has
        the episode in the file, flushed. Raises and aborts if any part was refused. A commit
        whose reply does not come is sent again with the episode's key (see `_conclude`); the
        server answers a retry of an applied commit with its receipt, never storing it twice.

        With `wait=False` the appends are still waited for (a refused append must never let a
        partial episode be committed), and the commit itself is left in flight: a
        `PendingCommit` is returned (see `ActorClient.push_episode`). The segment is "committing"
        until it settles. An episode that never left the client (it fits in one message) leaves
        at once while fewer than `max_in_flight` messages are unacknowledged; else it waits in
        the client with the next ones committed so, and they leave together in one message when
        there is room: at the client's next commit, push, `flush()` or `close()`, or a
        PendingCommit's `done()` or `result()`. Call `flush()` before leaving the client idle.

        `final`: the episode's final observation, as `set_final` takes it.

        Raises:
            RateLimitedError: the server's rate limit held the commit back for the client's
                `rate_limit_timeout`; the segment stays open on the server: call commit again.
        """
        seg = self._seg
        seg.require_open("commit")
        if final is not None:
            self.set_final(final)
        if seg.segment_id is None:
            return self._push_whole(wait)
        self._send_buffered()
        self._driver.run(wait_appends(seg))
        return self._conclude(commit_request(seg, self._config.rate_limit_timeout), wait)

    def _conclude(self, request: Any, wait: bool) -> Receipt | PendingCommit:
        """Send the request that commits the episode, again with the same key when no reply comes
        within `timeout` (`commit_attempts` in all, within the client's `commit_timeout`); its
        reply is the receipt. Refused for a full disk (DiskFullError) or by the rate limit, the
        segment stays open: commit again later, or abort."""
        seg = self._seg
        try:
            pending = PendingCommit(self._client._send_commit(request, track=not wait, settled=self._settled), seg.key)
        except BaseException:
            seg.status = "failed"  # it never left: not in doubt
            raise
        seg.status = "committing"
        if not wait:
            return pending
        try:
            return pending.result()
        except Exception:
            raise  # `_settled` has set the state
        except BaseException:  # interrupted while waiting: the commit may or may not be applied
            seg.status, seg.in_doubt = "failed", True
            raise

    def _settled(self, receipt: Receipt | None, error: Exception | None) -> None:
        """The commit's outcome came (or none came in time): the segment's state follows it."""
        if error is None:
            self._rows.clear()
        if self._seg.settled(receipt, error):
            with contextlib.suppress(Exception):
                self.abort()

    def _push_whole(self, wait: bool) -> Receipt | PendingCommit:
        """Commit an episode that never left the client: one push, one round trip (with
        `wait=False`, perhaps in one message with the next ones)."""
        seg = self._seg
        taken = self._rows.peek()  # kept until the commit settles: a refused one may be made again
        if taken is None:
            seg.status, seg.receipt = "committed", Receipt(-1, -1, 0)
            return seg.receipt if wait else PendingCommit.done_with(seg.receipt, seg.key)
        arrays, n, given = taken
        if not wait:  # it may share a message with the next episodes committed so (see _queue_commit)
            seg.status = "committing"
            return self._client._queue_commit(arrays, n, given, seg.key, self._settled, seg.final)
        return self._conclude(push_request([Ready(arrays, n, given, seg.key, seg.final)], self._config.rate_limit_timeout),
                              wait)

    def abort(self) -> None:
        """Drop the episode: nothing of it becomes visible. Safe to call twice."""
        self._driver.run(abort(self._seg, self._rows))

    def __enter__(self) -> ActorSegment:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if self._seg.status != "open":
            return
        if exc_type is None:
            self.commit()
        else:
            try:
                self.abort()
            except ClosedError:
                pass
