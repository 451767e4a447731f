"""One episode streamed in messages: its rows waiting to leave, its state, and the plans that open,
append, abort it on the server. Pure: no socket, no lock; the clock is the caller's.

Rows wait in one preallocated batch per leaf (`SegmentRows`); a full batch (or one whose first
row is `batch_seconds` old) leaves as one append message, up to `max_in_flight` unacknowledged.
An episode that fits in one message never opens a segment on the server: it leaves whole at
commit, as one push. A refused or lost append aborts the episode: it can never be committed in
part.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np

from h5replay import protocol as P
from h5replay.client._core.actor import NotSentError
from h5replay.client._core.ops import WRITER, Forget, Plan, RequestFactory, Send, Wait, checked
from h5replay.errors import DiskFullError, RateLimitedError, SegmentStateError, ServerUnavailableError
from h5replay.priorities import Given, PriorityColumns
from h5replay.records import Receipt
from h5replay.spaces import Schema

__all__ = ["Rows", "SegmentFacts", "SegmentRows", "SegmentState", "abort", "commit_request", "fail", "send_rows", "wait_appends"]


class Rows(NamedTuple):
    """Rows taken from a segment's batch to leave in one message."""

    arrays: dict[str, np.ndarray]  # by leaf, in storage form (the message owns them)
    n: int
    priorities: Given | None  # per row, by table (None: none given)


class SegmentRows:
    """The rows of an episode that have not left yet, in one preallocated batch per leaf.

    Args:
        schema: the server's space in storage form.
        capacity: rows of one message (`ActorState.rows_per_message`).
        batch_seconds: rows leave once the first of them is this old, full or not.
        clock: monotonic seconds (the driver's).
    """

    def __init__(self, schema: Schema, capacity: int, batch_seconds: float, clock: Callable[[], float]) -> None:
        self.schema = schema
        self.capacity = capacity
        self.batch_seconds = batch_seconds
        self.clock = clock
        self._batch: dict[str, np.ndarray] | None = None
        self._columns: list[np.ndarray] = []  # the batch's arrays, in the schema's leaf order
        self._put_exact_row = schema.put_exact_row
        self._priorities: PriorityColumns | None = None  # per buffered row, once one is given one
        self._since = 0.0
        #: Rows waiting in the batch.
        self.buffered = 0

    def put_exact(self, step: Any) -> bool:
        """Copy a step of exactly the stored dtypes and shapes (a dict of ndarrays) straight into
        the batch (the per-step hot path: a row copy per leaf); False when it is not such a step,
        or the batch is not ready for it (then use `add`)."""
        if self._batch is None or self._priorities is not None:
            return False
        if not self._put_exact_row(self._columns, self.buffered, step):
            return False
        self.buffered += 1
        return True

    def add(self, encoded: Mapping[str, np.ndarray], n: int, priorities: Given | None) -> Iterator[Rows]:
        """Put `n` checked rows in (copied: the caller may reuse its arrays); yields each batch that
        is due as it fills, to be sent before the rest go in."""
        offset = 0
        while offset < n:
            if self._batch is None:
                self._batch = {path: np.empty((self.capacity, *leaf.shape), leaf.storage_dtype)
                               for path, leaf in self.schema.leaves}
                self._columns = list(self._batch.values())
                self._since = self.clock()
            take = min(n - offset, self.capacity - self.buffered)
            first = self.buffered
            for path, arr in encoded.items():
                self._batch[path][first : first + take] = arr[offset : offset + take]
            if priorities or self._priorities is not None:
                if self._priorities is None:
                    self._priorities = PriorityColumns()
                self._priorities.put(first, take, priorities and {t: p[offset : offset + take] for t, p in priorities.items()})
            self.buffered += take
            offset += take
            if self.due():
                rows = self.take()
                if rows is not None:
                    yield rows

    def due(self) -> bool:
        """Whether the buffered rows leave now: the batch is full, or its first row is old enough."""
        return self.buffered == self.capacity or (self.buffered > 0 and self.clock() - self._since >= self.batch_seconds)

    def peek(self) -> Rows | None:
        """The buffered rows (views of the batch, which stays as it is); None: there are none."""
        if not self.buffered or self._batch is None:
            return None
        n = self.buffered
        return Rows({path: batch[:n] for path, batch in self._batch.items()}, n,
                    None if self._priorities is None else self._priorities.rows(n))

    def take(self) -> Rows | None:
        """The buffered rows, to leave in one message (None: there are none); the batch starts
        again in new arrays (the message owns these until it is sent: frames leave without a copy)."""
        rows = self.peek()
        self.clear()
        return rows

    def clear(self) -> None:
        self._batch, self._columns, self._priorities, self.buffered = None, [], None, 0


class SegmentState:
    """Where one episode stands: open (rows may be added), committing, committed, aborted, failed.

    Args:
        key: the episode's idempotency key (None: 16 random bytes), sent with every commit attempt.
    """

    def __init__(self, key: bytes | None = None) -> None:
        self.key = key if key is not None else os.urandom(P.IDEMPOTENCY_KEY_BYTES)
        self.segment_id: int | None = None  # the server's, once the first message left
        self.pending: deque[int] = deque()  # appends not yet acknowledged, oldest first
        self.final: dict[str, np.ndarray] | None = None  # the episode's final observation, once given
        self.length = 0
        self.receipt: Receipt | None = None
        #: The commit was sent and no reply came: the server may have applied it.
        self.in_doubt = False
        #: Abort the segment when its commit is refused and leaves it open (a full disk, the rate
        #: limit): set by `push_episode`, whose caller holds the episode.
        self.abandon_on_failure = False
        self.status = "open"

    def require_open(self, what: str) -> None:
        if self.status != "open":
            raise SegmentStateError(f"cannot {what} a segment that was {self.status}")

    def settled(self, receipt: Receipt | None, error: Exception | None) -> bool:
        """The commit's outcome came (or none came in time): the state follows it. Returns
        whether the segment should now be aborted (refused, left open, and abandoned)."""
        if error is None:
            self.status, self.receipt = "committed", receipt
            return False
        if isinstance(error, (DiskFullError, RateLimitedError)):
            self.status = "open"  # the server keeps the segment (a push's rows stay here): commit again
            return self.abandon_on_failure
        self.status = "failed"
        self.in_doubt = isinstance(error, ServerUnavailableError) and not isinstance(error, NotSentError)
        return False


class SegmentFacts:
    """What a segment front (blocking or asyncio) shows of its `SegmentState` (`self._seg`)."""

    _seg: SegmentState

    @property
    def key(self) -> bytes:
        """The episode's idempotency key (given, or 16 random bytes), sent with every commit attempt."""
        return self._seg.key

    @property
    def segment_id(self) -> int | None:
        """Assigned by the server when the first batch leaves (None until then)."""
        return self._seg.segment_id

    @property
    def length(self) -> int:
        return self._seg.length

    @property
    def receipt(self) -> Receipt | None:
        """The commit's receipt, once it settled."""
        return self._seg.receipt

    @property
    def in_doubt(self) -> bool:
        """Whether the commit (or push) was sent and no reply came: the server may have applied
        it. Commit the same rows again with `key` to settle it without storing it twice."""
        return self._seg.in_doubt

    def __len__(self) -> int:
        return self._seg.length


def send_rows(seg: SegmentState, rows: SegmentRows | Rows, max_in_flight: int) -> Plan[None]:
    """Send rows as one append (opening the segment on the server first), once fewer than
    `max_in_flight` appends are unacknowledged; `rows` is the batch (its rows are taken once the
    segment is open) or rows already taken. A failure aborts the episode (see `fail`)."""
    if isinstance(rows, SegmentRows) and not rows.buffered:
        return
    if seg.segment_id is None:
        request_id = yield Send(WRITER, lambda rid: P.OpenSegment(rid))
        seg.segment_id = int(checked((yield Wait(WRITER, request_id))).segment_id)
    taken = rows.take() if isinstance(rows, SegmentRows) else rows
    if taken is None:
        return
    arrays, n, given = taken
    every, tables, by_table = P.priorities_to_wire(given)
    while len(seg.pending) >= max_in_flight:
        yield from _settle_oldest(seg)
    segment_id = seg.segment_id
    seg.pending.append((yield Send(WRITER, lambda rid: P.Append(rid, segment_id, n, arrays, every, tables, by_table))))


def wait_appends(seg: SegmentState) -> Plan[None]:
    """Wait for every append in flight (a failure aborts the episode)."""
    while seg.pending:
        yield from _settle_oldest(seg)


def _settle_oldest(seg: SegmentState) -> Plan[None]:
    request_id = seg.pending.popleft()
    try:
        checked((yield Wait(WRITER, request_id)))
    except GeneratorExit:
        raise
    except Exception:
        yield from fail(seg)
        raise
    except BaseException:  # interrupted, cancelled: abort without waiting for the server's word
        yield from fail(seg, wait=False)
        raise


def fail(seg: SegmentState, *, wait: bool = True) -> Plan[None]:
    """An append was refused or lost (or the caller aborts): the episode cannot be committed
    whole. Its appends in flight are forgotten and the server drops it (`wait`: for its word,
    errors ignored: it may have dropped it already; it is gone either way)."""
    seg.status = "aborted"
    for request_id in seg.pending:
        yield Forget(WRITER, request_id)
    seg.pending.clear()
    segment_id = seg.segment_id
    if segment_id is None:
        return  # the server never heard of it
    try:
        request_id = yield Send(WRITER, lambda rid: P.Abort(rid, segment_id))
        if wait:
            yield Wait(WRITER, request_id)
        else:
            yield Forget(WRITER, request_id)
    except GeneratorExit:
        raise
    except Exception:
        pass


def abort(seg: SegmentState, rows: SegmentRows) -> Plan[None]:
    """Drop the episode: nothing of it becomes visible. Nothing to do unless it is open."""
    if seg.status != "open":
        return
    rows.clear()
    yield from fail(seg)


def commit_request(seg: SegmentState, limit: float) -> RequestFactory:
    """request_id -> the commit of a streamed episode (every append acknowledged first)."""
    segment_id, key, finals = seg.segment_id, seg.key, seg.final or {}
    if segment_id is None:
        raise SegmentStateError("this segment was never opened on the server: push it whole")
    return lambda rid: P.Commit(rid, segment_id, limit, key, finals)
