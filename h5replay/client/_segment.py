"""ActorSegment: one episode streamed to the server in batches, then committed or aborted.

Rows wait in one preallocated batch per leaf and leave as append messages (up to `max_in_flight`
unacknowledged); an episode that fits in one message leaves whole at commit, as one push. The
segment goes through its client (`SegmentClient`: an ActorClient, or a shard's client over several
servers) for the connection and for commits in flight.
"""

from __future__ import annotations

import collections
import contextlib
import os
import time
from collections.abc import Mapping
from typing import Any, Literal, Protocol, overload

import numpy as np

from h5replay import protocol as P
from h5replay.client._commits import PendingCommit, Ready, Settled, _Flight, _push_request
from h5replay.client._connection import Connection, NotSentError
from h5replay.config import ClientConfig
from h5replay.errors import ClosedError, DiskFullError, RateLimitedError, SegmentStateError, ServerUnavailableError
from h5replay.priorities import Given, PriorityColumns, one_row_priorities
from h5replay.records import Receipt
from h5replay.spaces import Schema

__all__ = ["ActorSegment", "SegmentClient"]


class SegmentClient(Protocol):
    """What a segment needs of the client that opened it (an ActorClient)."""

    config: ClientConfig
    rows_per_message: int
    schema: Schema

    @property
    def connection(self) -> Connection: ...

    def encode_one(self, step: Any) -> dict[str, np.ndarray]: ...

    def encode_batch(self, batch: Any) -> tuple[dict[str, np.ndarray], int]: ...

    def check_priorities(self, priorities: Any, n: int) -> Given | None: ...

    def _send_commit(self, request: Any, *, track: bool, settled: Settled | None = None) -> _Flight: ...

    def _queue_commit(self, rows: dict[str, np.ndarray], n: int, priorities: Given | None, key: bytes,
                      settled: Settled, final: dict[str, np.ndarray] | None = None) -> PendingCommit: ...

    def encode_final(self, final: Any) -> dict[str, np.ndarray] | None: ...


class ActorSegment:
    """One episode being streamed: `append`, `extend`, then `commit` or `abort`.

    The server hears of the segment only when its first full message leaves: an episode that
    fits in one message travels as a single push at commit (one round trip in all).
    """

    def __init__(self, client: SegmentClient, key: bytes | None = None) -> None:
        self._client = client
        #: The episode's idempotency key (`key`, or 16 random bytes), sent with every commit attempt.
        self.key = key if key is not None else os.urandom(P.IDEMPOTENCY_KEY_BYTES)
        self._conn = client.connection
        self._config = client.config
        self.segment_id: int | None = None  # assigned by the server when the first batch leaves
        self._pending: collections.deque[int] = collections.deque()
        # Rows wait in one preallocated batch per leaf; a full batch leaves as one message.
        self._batch_capacity = client.rows_per_message
        self._batch: dict[str, np.ndarray] | None = None
        self._columns: list[np.ndarray] = []  # the batch's arrays, in the schema's leaf order
        self._put_exact_row = client.schema.put_exact_row
        self._priorities: PriorityColumns | None = None  # per buffered row, once one is given one
        self._final: dict[str, np.ndarray] | None = None  # the episode's final observation, once given
        self._buffered_rows = 0
        self._buffered_since = 0.0
        self.length = 0
        self.receipt: Receipt | None = None
        #: Whether the commit (or push) was sent and no reply came: the server may have applied
        #: it. Commit the same rows again with `key` to settle it without storing it twice.
        self.in_doubt = False
        #: Abort the segment when its commit in flight is refused and leaves it open (a full
        #: disk, the rate limit): set by `push_episode`, whose caller holds the episode.
        self.abandon_on_failure = False
        self._state = "open"

    def __len__(self) -> int:
        return self.length

    def _require_open(self, what: str) -> None:
        if self._state != "open":
            raise SegmentStateError(f"cannot {what} a segment that was {self._state}")

    def append(self, step: Any, priority: float | Mapping[str, float] | None = None) -> None:
        """Add one step (with its priority for every prioritized table of the server, or by table
        name: `{"replay": 2.0}`); checked against the space
        now, sent in a batch soon. A step of exactly the stored dtypes and shapes (a dict of
        ndarrays) is copied straight into the batch."""
        self._require_open("append to")
        if priority is None and self._priorities is None and self._batch is not None:
            row = self._buffered_rows
            if self._put_exact_row(self._columns, row, step):  # the per-step hot path: a row copy per leaf
                self._buffered_rows = row + 1
                self.length += 1
                if self._batch_due():
                    self._send_buffered()
                return
        given = self._client.check_priorities(None if priority is None else one_row_priorities(priority), 1)
        self._add(self._client.encode_one(step), 1, given)

    def extend(self, batch: Any, priorities: Any = None) -> None:
        """Add a batch of steps (a leading axis on every leaf), with one priority per step if given
        (an array for every prioritized table, or {table: array})."""
        self._require_open("extend")
        encoded, n = self._client.encode_batch(batch)
        self.extend_encoded(encoded, n, self._client.check_priorities(priorities, n))

    def extend_encoded(self, encoded: dict[str, np.ndarray], n: int, priorities: Given | None = None) -> None:
        """Add rows already checked and in storage form (from `ActorClient.encode_batch`), with
        priorities already checked (`check_priorities`; None: none given)."""
        self._require_open("extend")
        self._add(encoded, n, priorities)

    def _add(self, encoded: dict[str, np.ndarray], n: int, priorities: Given | None) -> None:
        offset = 0
        while offset < n:
            if self._batch is None:
                self._batch = {
                    path: np.empty((self._batch_capacity, *leaf.shape), leaf.storage_dtype)
                    for path, leaf in self._client.schema.leaves
                }
                self._columns = list(self._batch.values())  # in the schema's leaf order
                self._buffered_since = time.monotonic()
            take = min(n - offset, self._batch_capacity - self._buffered_rows)
            first = self._buffered_rows
            for path, arr in encoded.items():  # a copy: the caller may reuse its arrays at once
                self._batch[path][first : first + take] = arr[offset : offset + take]
            if priorities or self._priorities is not None:
                if self._priorities is None:
                    self._priorities = PriorityColumns()
                self._priorities.put(first, take, priorities and {t: p[offset : offset + take] for t, p in priorities.items()})
            self._buffered_rows += take
            self.length += take
            offset += take
            if self._batch_due():
                self._send_buffered()

    def _batch_due(self) -> bool:
        """Whether the buffered rows leave now: the batch is full, or its first row is old enough."""
        return (self._buffered_rows == self._batch_capacity
                or time.monotonic() - self._buffered_since >= self._config.batch_seconds)

    def _send_buffered(self) -> None:
        if not self._buffered_rows or self._batch is None:
            return
        if self.segment_id is None:
            reply = self._conn.request(lambda rid: P.OpenSegment(rid))
            self.segment_id = int(reply.segment_id)  # type: ignore[attr-defined]
        n = self._buffered_rows
        arrays = {path: batch[:n] for path, batch in self._batch.items()}
        every, tables, by_table = P.priorities_to_wire(None if self._priorities is None else self._priorities.rows(n))
        # The message owns these arrays until it is sent (frames leave without a copy).
        self._batch, self._priorities, self._buffered_rows = None, None, 0
        while len(self._pending) >= self._config.max_in_flight:
            self._settle_oldest()
        segment_id = self.segment_id
        self._pending.append(self._conn.send(lambda rid: P.Append(rid, segment_id, n, arrays, every, tables, by_table)))

    def _settle_oldest(self) -> None:
        request_id = self._pending.popleft()
        try:
            self._conn.wait(request_id)
        except BaseException:
            self._fail()
            raise

    def _fail(self) -> None:
        """An append was refused or lost: the episode cannot be committed whole; abort it."""
        self._state = "aborted"
        for request_id in self._pending:
            self._conn.forget(request_id)
        self._pending.clear()
        segment_id = self.segment_id
        if segment_id is None:
            return  # the server never heard of it
        try:
            self._conn.request(lambda rid: P.Abort(rid, segment_id))
        except Exception:  # the server may already have dropped it; it is gone either way
            pass

    def set_final(self, final: Any) -> None:
        """The observation after the episode's last step (the value of the server's one
        observation key, or a dict of its observation keys), sent with the commit. Checked now.

        Raises:
            ConfigError: the server keeps no final observations (`serve --observation-keys`).
            SpaceMismatchError: it is not the observation part of the server's space.
        """
        self._require_open("set the final observation of")
        self._final = self._client.encode_final(final)

    def set_final_encoded(self, final: dict[str, np.ndarray] | None) -> None:
        """`set_final` of a final already checked and in storage form (`encode_final`)."""
        self._final = final

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
        self._require_open("commit")
        if final is not None:
            self.set_final(final)
        if self.segment_id is None:
            return self._push_whole(wait)
        self._send_buffered()
        while self._pending:
            self._settle_oldest()
        segment_id, limit, key, finals = self.segment_id, self._config.rate_limit_timeout, self.key, self._final or {}
        return self._conclude(lambda rid: P.Commit(rid, segment_id, limit, key, finals), wait)

    def _conclude(self, request: Any, wait: bool) -> Receipt | PendingCommit:
        """Send the request that commits the episode, again with the same key when no reply comes
        within `timeout` (`commit_attempts` in all, within the client's `commit_timeout`); its
        reply is the receipt. Refused for a full disk (DiskFullError) or by the rate limit, the
        segment stays open: commit again later, or abort."""
        try:
            pending = PendingCommit(self._client._send_commit(request, track=not wait, settled=self._settled), self.key)
        except BaseException:
            self._state = "failed"  # it never left: not in doubt
            raise
        self._state = "committing"
        if not wait:
            return pending
        try:
            return pending.result()
        except Exception:
            raise  # `_settled` has set the state
        except BaseException:  # interrupted while waiting: the commit may or may not be applied
            self._state, self.in_doubt = "failed", True
            raise

    def _settled(self, receipt: Receipt | None, error: Exception | None) -> None:
        """The commit's outcome came (or none came in time): the segment's state follows it."""
        if error is None:
            self._state = "committed"
            self.receipt = receipt
            self._batch, self._priorities, self._buffered_rows = None, None, 0
        elif isinstance(error, (DiskFullError, RateLimitedError)):
            self._state = "open"  # the server keeps the segment (a push's rows stay here): commit again
            if self.abandon_on_failure:
                with contextlib.suppress(Exception):
                    self.abort()
        else:
            self._state = "failed"
            self.in_doubt = isinstance(error, ServerUnavailableError) and not isinstance(error, NotSentError)

    def _push_whole(self, wait: bool) -> Receipt | PendingCommit:
        """Commit an episode that never left the client: one push, one round trip (with
        `wait=False`, perhaps in one message with the next ones)."""
        n, batch = self._buffered_rows, self._batch
        if not n or batch is None:
            self._batch, self._priorities, self._buffered_rows = None, None, 0
            self._state = "committed"
            self.receipt = Receipt(-1, -1, 0)
            return self.receipt if wait else PendingCommit.done_with(self.receipt, self.key)
        arrays = {path: rows[:n] for path, rows in batch.items()}
        given = None if self._priorities is None else self._priorities.rows(n)
        limit, key = self._config.rate_limit_timeout, self.key
        if not wait:  # it may share a message with the next episodes committed so (see _queue_commit)
            self._state = "committing"
            return self._client._queue_commit(arrays, n, given, key, self._settled, self._final)
        return self._conclude(_push_request([Ready(arrays, n, given, key, self._final)], limit), wait)

    def abort(self) -> None:
        """Drop the episode: nothing of it becomes visible. Safe to call twice."""
        if self._state != "open":
            return
        self._batch, self._buffered_rows = None, 0
        self._fail()

    def __enter__(self) -> ActorSegment:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if self._state != "open":
            return
        if exc_type is None:
            self.commit()
        else:
            try:
                self.abort()
            except ClosedError:
                pass
