"""ActorClient: stream steps into episodes on an h5replay server; commit or abort them.

Steps are checked against the server's space here, before they leave the process, then batched
into messages (by rows, bytes or time) and pipelined: up to `max_in_flight` appends travel before
the actor waits for an acknowledgement, so a fast actor cannot outrun the server's memory. A
commit returns only after the server has the episode in the file, flushed; or, with `wait=False`,
at once with a `PendingCommit`, so that the actor's next episode is on its way while the server
writes this one (up to `max_in_flight` commits unacknowledged; `flush()` waits for them all).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import sys
import threading
import time
import typing
from collections.abc import Callable, Sequence
from typing import Any, Literal, overload

import numpy as np

from h5replay import protocol as P
from h5replay.client._connection import Connection, NotSentError, Retried, curve_keys, say_hello
from h5replay.client._shards import InDoubt, ShardedActor, ShardedSegment
from h5replay.config import DEFAULT_ENDPOINT, ClientConfig, process_name
from h5replay.errors import (
    ClosedError,
    ConfigError,
    DiskFullError,
    RateLimitedError,
    SegmentStateError,
    ServerUnavailableError,
)
from h5replay.records import Receipt
from h5replay.sampling import check_priorities, rows_at_once
from h5replay.spaces import Schema, Space, space_from_json

__all__ = ["ActorClient", "ActorSegment", "PendingCommit", "Receipt"]


_NO_PRIORITIES = np.zeros(0, dtype=np.float64)


def _check_priorities(priorities: Any, n: int) -> np.ndarray:
    """Priorities for n steps as sent (empty: none given), checked here before anything leaves."""
    return _NO_PRIORITIES if priorities is None else check_priorities(priorities, n)


def _receipt(reply: Any) -> Receipt:
    """The receipt of a commit or push reply: global ids, or (-1, -1, 0) when nothing was recorded."""
    if reply.episode_id is None or reply.first_row_id is None or reply.length == 0:
        return Receipt(-1, -1, 0)
    return Receipt(int(reply.episode_id), int(reply.first_row_id), int(reply.length))


def _own_copies(encoded: dict[str, np.ndarray], given: dict[str, Any]) -> dict[str, np.ndarray]:
    """`encoded` with a copy of every array that shares memory with the caller's `given` leaves."""
    return {path: arr.copy() if isinstance(given.get(path), np.ndarray) and np.may_share_memory(arr, given[path])
            else arr for path, arr in encoded.items()}


_KEPT_FAILURES = 1000  # failed commit messages in flight kept for `flush` to report, at most (the newest)

#: Told how a commit in flight ended: (receipt, None) or (None, the error).
Settled = Callable[[Receipt | None, Exception | None], None]


#: An episode ready to go in a message: (rows by leaf, length, priorities or empty, idempotency key).
Ready = tuple[dict[str, np.ndarray], int, np.ndarray, bytes]


def _push_request(episodes: Sequence[Ready], limit: float) -> Callable[[int], P.Request]:
    """request_id -> the message that commits `episodes`: a push for one, push_episodes (their
    rows one after another, NaN priorities for steps given none) for several."""
    if len(episodes) == 1:
        rows, n, priorities, key = episodes[0]
        return lambda rid: P.PushEpisode(rid, n, rows, limit, priorities, key)
    lengths = np.array([n for _, n, _, _ in episodes], dtype=np.int64)
    total = int(lengths.sum())
    arrays = {path: np.concatenate([rows[path] for rows, _, _, _ in episodes]) for path in episodes[0][0]}
    given = np.concatenate([p if len(p) else np.full(n, np.nan) for _, n, p, _ in episodes]) \
        if any(len(p) for _, _, p, _ in episodes) else _NO_PRIORITIES
    keys = np.frombuffer(b"".join(key for _, _, _, key in episodes), dtype=np.uint8).reshape(len(episodes), -1)
    return lambda rid: P.PushEpisodes(rid, total, lengths, keys, arrays, limit, given)


def _receipts(reply: Any) -> list[Receipt]:
    """The receipts a commit, push or push_episodes reply carries, in the order sent."""
    if isinstance(reply, P.PushEpisodesReply):
        return [Receipt(int(e), int(f), int(n)) for e, f, n in reply.episodes]
    return [_receipt(reply)]


class _Flight:
    """One message that commits episodes (a commit, a push, a push of several): queued in the
    client (segments committed with wait=False, see `ActorClient._queue_commit`), then in flight
    (sent again with the same keys while no reply comes), then settled."""

    def __init__(self, conn: Connection | None, retried: Retried | None, settled: list[Settled | None] | None = None,
                 failures: collections.deque[_Flight] | None = None, receipts: list[Receipt] | None = None,
                 client: ActorClient | None = None) -> None:
        self.conn = conn
        self.retried = retried
        self.settled = settled  # one callback (or None) per episode, told its receipt or the error
        self.failures = failures  # where a failure waits for `flush` (messages in flight only)
        self.receipts = receipts
        self.error: Exception | None = None
        self.observed = False  # the caller saw the outcome through `result()` (or `flush` reported it)
        self.lock = threading.Lock()
        #: The client whose next message this is, while it waits there (None once sent).
        self.queued_in = client

    def done(self) -> bool:
        client = self.queued_in
        if client is not None:
            client._pump()  # it leaves now if there is room
            if self.queued_in is not None:
                return False
        retried, conn = self.retried, self.conn
        return retried is None or conn is None or conn.closed or conn.arrived(retried.request_id)

    def settle(self) -> None:
        """Wait for the outcome and keep it (the error too: `PendingCommit.result` raises it)."""
        client = self.queued_in
        if client is not None:
            client._send_queue()  # before this flight's lock: the client's lock comes first
        with self.lock:
            retried, conn = self.retried, self.conn
            if retried is None or conn is None:
                return
            try:
                self.receipts = _receipts(conn.wait_retried(retried))
            except Exception as exc:
                self._failed(exc)
            self.retried = None  # the request (and the episodes' arrays it holds) can go
        self._tell()

    def _failed(self, exc: Exception) -> None:
        self.error = exc
        if self.failures is not None:
            self.failures.append(self)

    def fail_unsent(self, exc: Exception) -> None:
        """It could not be sent (no server connected in time): not in doubt."""
        with self.lock:
            self.queued_in = None
            self._failed(exc)
        self._tell()

    def _tell(self) -> None:
        callbacks, self.settled = self.settled, None
        for i, callback in enumerate(callbacks or ()):
            if callback is not None:
                callback(self.receipts[i] if self.receipts and i < len(self.receipts) else None, self.error)


@dataclasses.dataclass
class _Queue:
    """The next message of a client, while its episodes wait for room in flight."""

    flight: _Flight
    episodes: list[Ready] = dataclasses.field(default_factory=list)
    rows: int = 0


class PendingCommit:
    """A commit on its way, from `push_episode(..., wait=False)`, `push_episodes(..., wait=False)`
    or `commit(wait=False)`.

    The episode has left the client, or (a segment's, while `max_in_flight` messages are out)
    waits in the client's next message (see `ActorSegment.commit`). `result()` sends it if it
    still waits, then waits for the server's acknowledgement, sending the commit again with its
    idempotency key when no reply comes (as a waited commit does), and returns the receipt, or
    raises what the commit would have raised. Its time runs from the send: `commit_timeout` in
    all. Episodes sent in one message settle together.
    """

    def __init__(self, flight: _Flight, key: bytes, index: int = 0) -> None:
        #: The episode's idempotency key: a commit of the same rows with it is never stored twice.
        self.key = key
        self._flight = flight
        self._index = index

    @classmethod
    def done_with(cls, receipt: Receipt, key: bytes = b"") -> PendingCommit:
        """One already settled (an empty episode, or a commit over several servers, waited for)."""
        return cls(_Flight(None, None, receipts=[receipt]), key)

    def done(self) -> bool:
        """Whether the outcome is here: `result()` then returns (or raises) without waiting."""
        return self._flight.done()

    def result(self) -> Receipt:
        """The receipt, once the server has the episode in the file, flushed (waits for it).

        Raises:
            ServerUnavailableError: no reply to any attempt within `commit_timeout`: the commit is
                in doubt (commit the same rows with `key` to settle it).
            DiskFullError, RateLimitedError, ...: the server refused the commit.
        """
        flight = self._flight
        flight.settle()
        flight.observed = True
        if flight.error is not None:
            raise flight.error
        return flight.receipts[self._index] if flight.receipts else Receipt(-1, -1, 0)

    def __repr__(self) -> str:
        flight = self._flight
        state = "queued" if flight.queued_in is not None else "in flight" if flight.retried is not None \
            else "failed" if flight.error is not None else "done"
        return f"PendingCommit({state}, key={self.key.hex()})"


class ActorClient:
    """Writes episodes to a server. One per thread is simplest; calls are serialised by a lock.

    Args:
        endpoint: the server's endpoint, e.g. "tcp://127.0.0.1:5555".
        timeout: seconds to wait for any reply before raising ServerUnavailableError.
        name: shown in the server's logs; over several servers it picks the home shard.
        config: full client settings (overrides endpoint and timeout).
        secret_key, server_key: CURVE certificate files (`h5replay keys generate`).
        endpoints: several servers ("shards", the same list in the same order for every client),
            instead of `endpoint`: the actor writes to its home shard (a stable hash of its name) and moves
            to the next live shard when that one stops answering, the episode in flight pushed
            again whole (see h5replay.client._shards).

    Raises:
        ServerUnavailableError: the server (every shard) did not answer the hello within `timeout`.
        ConfigError: the shards hold different spaces, or two endpoints reach the same file.
    """

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        timeout: float = 10.0,
        *,
        name: str | None = None,
        config: ClientConfig | None = None,
        secret_key: str | os.PathLike[str] | None = None,
        server_key: str | os.PathLike[str] | None = None,
        endpoints: Sequence[str] | None = None,
    ) -> None:
        self.config = config or ClientConfig(endpoint=endpoint, timeout=timeout, name=name or process_name("actor"))
        # Commits sent with wait=False and not yet settled (oldest first), and those that failed
        # unseen: `flush` reports them.
        self._in_flight: collections.deque[_Flight] = collections.deque()
        self._failures: collections.deque[_Flight] = collections.deque(maxlen=_KEPT_FAILURES)
        self._flights_lock = threading.RLock()  # over both: calls from several threads take turns
        self._queue: _Queue | None = None  # episodes of segments committed with wait=False, not yet sent
        #: Over several servers: the routing (h5replay.client._shards), which every call goes through.
        self._router: ShardedActor | None = None
        if endpoints is not None:
            self._router = ShardedActor(endpoints, self.config, secret_key, server_key)
            self._adopt(self._router.codec)
            return
        self._conn, hello = say_hello(self.config, "actor", curve_keys(secret_key, server_key))
        self.limits = hello.limits
        self.space: Space = space_from_json(hello.space)
        self.capacity = hello.capacity
        self.server_version = hello.server_version
        self.replay_id: str = hello.replay_id
        self.instance_id: str = hello.instance_id
        #: Seconds a commit or push may take in all: `commit_attempts` sends, each waiting `timeout`
        #: for its reply, and the rate limit's hold when the server has one (else it holds none).
        #: Seconds the server may hold a commit back (its rate limit), 0 when it has none.
        self.commit_hold = self.config.rate_limit_timeout if hello.sampling.get("writer_samples") else 0.0
        self.commit_timeout = self.config.commit_attempts * self.config.timeout + self.commit_hold
        self.schema = Schema(self.space)
        self._row_bytes = self.schema.row_bytes
        # Rows per message: the client's batching settings, within the server's message limits
        # (leaving room for the header).
        room = max(1, self.limits.max_message_bytes - P.ROWS_MESSAGE_OVERHEAD)
        self.rows_per_message = max(1, min(
            self.config.batch_rows,
            self.limits.max_rows_per_message,
            self.config.batch_bytes // max(1, self._row_bytes),
            room // max(1, self._row_bytes),
        ))
        # Rows of whole episodes one `push_episodes` message carries: not bound by `batch_rows`,
        # which sizes the messages of a streamed episode, but by the capacity (the server places a
        # message's episodes at once) and by the rate limit's window (the server admits a message
        # whole: one bigger than the window could never go ahead).
        self.rows_per_push = min(
            self.capacity or sys.maxsize,
            rows_at_once(hello.sampling, sampling=False) or sys.maxsize,
            max(self.rows_per_message, min(
                self.limits.max_rows_per_message,
                self.config.batch_bytes // max(1, self._row_bytes),
                room // max(1, self._row_bytes),
            )),
        )

    def _adopt(self, shard: ActorClient) -> None:
        """Take the figures of a shard's client as this client's (all shards hold the same space)."""
        self._conn = shard.connection
        self.limits, self.space, self.capacity = shard.limits, shard.space, shard.capacity
        self.server_version, self.replay_id, self.instance_id = shard.server_version, shard.replay_id, shard.instance_id
        self.schema, self._row_bytes, self.rows_per_message = shard.schema, shard._row_bytes, shard.rows_per_message
        self.rows_per_push = shard.rows_per_push
        self.commit_timeout, self.commit_hold = shard.commit_timeout, shard.commit_hold

    @property
    def shard(self) -> int:
        """The index (in `endpoints`) of the shard this actor writes to now; 0 for a single server."""
        return self._router.current if self._router is not None else 0

    @property
    def in_doubt(self) -> list[InDoubt]:
        """Over several servers: the episodes whose commit raised CommitInDoubtError (their shard
        lost the reply and did not answer again within the commit's time). The actor keeps each
        and settles it on that shard, with its idempotency key, once the shard answers; `receipt`
        is None until then. The newest 1000 settled ones are kept here, then those still in doubt."""
        return self._router.in_doubt if self._router is not None else []

    def settle(self, timeout: float | None = None) -> list[InDoubt]:
        """Wait up to `timeout` seconds (None: the client's timeout) for every episode in doubt to
        be settled on its shard; returns those still in doubt (none for a single server, whose
        commit either returns or raises). `close()` settles only on shards that answer at once.

        Raises:
            ConfigError: `timeout` is not a number of seconds >= 0 (nor None).
        """
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout >= 0):
            raise ConfigError(f"settle's timeout must be a number of seconds >= 0, or None, got {timeout!r}")
        return self._router.settle(timeout) if self._router is not None else []

    def segment(self) -> ActorSegment | ShardedSegment:
        """Open a segment (one episode). As a context manager it commits on normal exit and
        aborts on an exception. Over several servers the episode moves whole to the next live
        shard when its shard stops answering."""
        if self._router is not None:
            return self._router.segment()
        return ActorSegment(self)

    @overload
    def push_episode(self, batch: Any, priorities: Any = None, *, wait: Literal[True] = True) -> Receipt: ...
    @overload
    def push_episode(self, batch: Any, priorities: Any = None, *, wait: Literal[False]) -> PendingCommit: ...
    @overload
    def push_episode(self, batch: Any, priorities: Any = None, *, wait: bool) -> Receipt | PendingCommit: ...

    def push_episode(self, batch: Any, priorities: Any = None, *, wait: bool = True) -> Receipt | PendingCommit:
        """Send one whole episode (a leading axis on every leaf), with one priority per step if
        given (a prioritized server), and wait for its commit. Returns the global ids the server
        gave it; an empty episode records nothing: Receipt(-1, -1, 0). Blocks at most
        `commit_timeout`: a push whose reply does not come within `timeout` is sent again with the
        same idempotency key (`commit_attempts` sends in all, plus `rate_limit_timeout` when the
        server has a rate limit): the server never stores it twice.

        With `wait=False` it returns once the episode has left, with a `PendingCommit` (its
        `result()` is the receipt): the actor goes on to its next episode while the server writes
        this one. At most `config.max_in_flight` such commits are unacknowledged: the next one
        first waits for the oldest. `flush()` (and `close()`) waits for them all and raises the
        first failure not seen through `result()`. The batch is copied first (or encoded), so the
        caller may reuse its arrays at once. Over several servers the push is waited for, and a
        done `PendingCommit` returned.

        Raises:
            RateLimitedError: the server's rate limit held the commit back for `rate_limit_timeout`.
            CommitInDoubtError: over several servers, the shard lost the reply and did not answer
                again: the actor keeps the episode and settles it there (`in_doubt`, `settle`).
        """
        if self._router is not None:
            receipt = self._router.push_episode(batch, priorities)
            return receipt if wait else PendingCommit.done_with(receipt)
        encoded, n = self.encode_batch(batch)
        return self._push_encoded(encoded, n, _check_priorities(priorities, n), wait, batch)

    def _push_encoded(self, encoded: dict[str, np.ndarray], n: int, given: np.ndarray, wait: bool,
                      batch: Any = None) -> Receipt | PendingCommit:
        """`push_episode` of checked rows; `batch`: the caller's, whose arrays `encoded` may share."""
        if n == 0:
            empty = Receipt(-1, -1, 0)
            return empty if wait else PendingCommit.done_with(empty)
        if n <= self.rows_per_message:
            if not wait:  # the message (and its retries) must not borrow arrays the caller may reuse
                encoded, given = _own_copies(encoded, self.schema.flatten(batch)), given.copy()
            limit, key = self.config.rate_limit_timeout, os.urandom(P.IDEMPOTENCY_KEY_BYTES)
            pending = PendingCommit(self._send_commit(lambda rid: P.PushEpisode(rid, n, encoded, limit, given, key),
                                                      track=not wait), key)
            return pending.result() if wait else pending
        seg = ActorSegment(self)
        try:
            seg.extend_encoded(encoded, n, given)
            if wait:
                return seg.commit()
            seg.abandon_on_failure = True  # the caller holds the episode, not this segment
            return seg.commit(wait=False)
        except BaseException:
            # The caller holds the episode, not this segment: nothing of it may stay open on the
            # server (a commit refused for a full disk or by the rate limit would leave it open).
            with contextlib.suppress(Exception):
                seg.abort()
            raise

    @overload
    def push_episodes(self, batches: Sequence[Any], priorities: Sequence[Any] | None = None, *,
                      wait: Literal[True] = True) -> list[Receipt]: ...
    @overload
    def push_episodes(self, batches: Sequence[Any], priorities: Sequence[Any] | None = None, *,
                      wait: Literal[False]) -> list[PendingCommit]: ...
    @overload
    def push_episodes(self, batches: Sequence[Any], priorities: Sequence[Any] | None = None, *,
                      wait: bool) -> list[Receipt] | list[PendingCommit]: ...

    def push_episodes(self, batches: Sequence[Any], priorities: Sequence[Any] | None = None, *,
                      wait: bool = True) -> list[Receipt] | list[PendingCommit]:
        """Push several whole episodes (short ones, or those a vectorized environment ends
        together): as many as fit go in one message (`rows_per_push` rows), each episode with
        its own idempotency key, so the server's work and the round trips are shared. Every
        episode is checked before any leaves. `priorities`: one entry per episode, None or one
        per step. Returns one receipt per episode, in order (an empty one records nothing:
        Receipt(-1, -1, 0)); with `wait=False`, one `PendingCommit` per episode, as
        `push_episode` does. The server checks a message's episodes before it writes any of them.
        Over several servers, each episode is pushed as by `push_episode`.

        Raises:
            ConfigError: `priorities` has not one entry per episode.
            SpaceMismatchError: an episode does not fit the space (nothing was sent).
            The error of a message the server refused: with `wait=True`, after every message has
            settled; episodes of other messages may be committed (`wait=False` tells each apart).
        """
        if not isinstance(batches, Sequence) or isinstance(batches, (str, bytes, dict)):
            raise ConfigError(f"push_episodes takes a sequence of episodes, got {type(batches).__name__}")
        if priorities is not None and len(priorities) != len(batches):
            raise ConfigError(f"push_episodes got {len(priorities)} priority entries for {len(batches)} episodes: "
                              "give one per episode (None, or one per step)")
        each = priorities if priorities is not None else [None] * len(batches)
        if self._router is not None:
            receipts = [self._router.push_episode(batch, given) for batch, given in zip(batches, each)]
            return receipts if wait else [PendingCommit.done_with(r) for r in receipts]
        episodes = []  # (encoded, rows, priorities given or empty, batch): all checked before anything leaves
        for batch, given in zip(batches, each):
            encoded, n = self.encode_batch(batch)
            episodes.append((encoded, n, _check_priorities(given, n), batch))
        pending: list[PendingCommit | None] = [None] * len(episodes)
        group: list[int] = []  # episodes that go in the next message, in order
        rows = 0  # theirs
        for i, (encoded, n, given, batch) in enumerate(episodes):
            if n == 0:  # records nothing, sends nothing
                pending[i] = PendingCommit.done_with(Receipt(-1, -1, 0))
            elif n > self.rows_per_message:  # streamed through a segment of its own, after those before it
                self._push_group(episodes, group, pending)
                group, rows = [], 0
                pending[i] = typing.cast(PendingCommit, self._push_encoded(encoded, n, given, False, batch))
            else:
                if rows + n > self.rows_per_push:
                    self._push_group(episodes, group, pending)
                    group, rows = [], 0
                group.append(i)
                rows += n
        self._push_group(episodes, group, pending)
        commits = typing.cast("list[PendingCommit]", pending)
        if not wait:
            return commits
        for commit in commits:  # every message settles before the first failure is raised
            commit._flight.settle()
        return [commit.result() for commit in commits]

    def _push_group(self, episodes: list[tuple[dict[str, np.ndarray], int, np.ndarray, Any]],
                    group: list[int], pending: list[PendingCommit | None]) -> None:
        """Send episodes (indices into `episodes`, checked) in one message; their commits in flight
        go to `pending` at the same indices."""
        if not group:
            return
        if len(group) == 1:
            encoded, n, given, batch = episodes[group[0]]
            pending[group[0]] = typing.cast(PendingCommit, self._push_encoded(encoded, n, given, False, batch))
            return
        ready = [(episodes[i][0], episodes[i][1], episodes[i][2], os.urandom(P.IDEMPOTENCY_KEY_BYTES)) for i in group]
        flight = self._send_commit(_push_request(ready, self.config.rate_limit_timeout), track=True)
        for j, i in enumerate(group):
            pending[i] = PendingCommit(flight, ready[j][3], j)

    def _send_commit(self, request: Any, *, track: bool, settled: Settled | None = None) -> _Flight:
        """Send a commit (or push) that is sent again with its key while no reply comes; with
        `track`, it stays in flight (within `max_in_flight`) for `flush`.

        Raises:
            NotSentError: it could not leave (no server connected within the timeout).
        """
        with self._flights_lock:
            if self._queue is not None:  # commits leave in the order they were made
                self._send_queue()
            if not track:
                retried = self._conn.send_retried(request, self.commit_timeout, self.config.commit_attempts,
                                                  self.commit_hold)
                return _Flight(self._conn, retried, [settled])
            self._make_room()
            retried = self._conn.send_retried(request, self.commit_timeout, self.config.commit_attempts,
                                              self.commit_hold)
            flight = _Flight(self._conn, retried, [settled], self._failures)
            self._in_flight.append(flight)
            return flight

    def _queue_commit(self, rows: dict[str, np.ndarray], n: int, priorities: np.ndarray, key: bytes,
                      settled: Settled) -> PendingCommit:
        """Commit an episode that never left (a segment's, `wait=False`) in this client's next
        message: it leaves at once while fewer than `max_in_flight` messages are unacknowledged;
        else it waits, with the episodes committed after it, for the next of this client's commits
        or pushes, flush, close, or a PendingCommit's done() or result() to find room, or for the
        message to be full (`rows_per_push`). Under load, episodes so share messages."""
        with self._flights_lock:
            queue = self._queue
            if queue is not None and queue.rows + n > self.rows_per_push:
                self._send_queue()
                queue = None
            if queue is None:
                queue = self._queue = _Queue(_Flight(self._conn, None, [], self._failures, client=self))
            flight = queue.flight
            queue.episodes.append((rows, n, priorities, key))
            typing.cast("list[Settled | None]", flight.settled).append(settled)
            queue.rows += n
            self._pump()
            return PendingCommit(flight, key, len(queue.episodes) - 1)

    def _pump(self) -> None:
        """Without blocking: settle the commits whose replies are here, and send the queued
        message when there is room."""
        with self._flights_lock:
            in_flight = self._in_flight
            while in_flight and in_flight[0].done():
                in_flight.popleft().settle()
            if self._queue is not None and len(in_flight) < self.config.max_in_flight:
                self._send_queue()

    def _send_queue(self) -> None:
        """Send the queued message now (waiting for room in flight first)."""
        with self._flights_lock:
            queue, self._queue = self._queue, None
            if queue is None:
                return
            flight = queue.flight
            request = _push_request(queue.episodes, self.config.rate_limit_timeout)
            try:
                self._make_room()
                retried = self._conn.send_retried(request, self.commit_timeout, self.config.commit_attempts,
                                                  self.commit_hold)
            except Exception as exc:  # its episodes are told; the caller of this send may be another's
                flight.fail_unsent(exc)
                return
            flight.retried, flight.queued_in = retried, None
            self._in_flight.append(flight)

    def _drain(self) -> None:
        """Send the queued message, then wait for every commit in flight."""
        with self._flights_lock:
            self._send_queue()
            while self._in_flight:
                self._in_flight.popleft().settle()

    def _make_room(self) -> None:
        """Before another commit leaves: wait for the oldest while `max_in_flight` are unsettled."""
        in_flight = self._in_flight
        while in_flight and (len(in_flight) >= self.config.max_in_flight or in_flight[0].done()):
            in_flight.popleft().settle()

    def flush(self) -> None:
        """Wait for every commit sent with `wait=False` to be acknowledged (each within its
        `commit_timeout`). Raises the first failure since the last flush that `result()` did not
        show (a note says how many failed); each is reported once.
        """
        if self._router is not None:
            return
        with self._flights_lock:
            self._drain()
            failed = [flight for flight in self._failures if not flight.observed]
            self._failures.clear()
            for flight in failed:
                flight.observed = True
        if failed:
            error = failed[0].error
            if error is not None:
                if len(failed) > 1:
                    error.args = (f"{error.args[0] if error.args else error} (and {len(failed) - 1} more commit(s) in "
                                  "flight failed since the last flush; their PendingCommit.result() raises each)",
                                  *error.args[1:])
                raise error

    def info(self) -> dict[str, Any]:
        """The server's figures (length, episodes, clients, rows in, ...); over several servers,
        the current shard's, with "shard": its index."""
        if self._router is not None:
            return self._router.info()
        return dict(self._conn.request(lambda rid: P.Info(rid)).stats)  # type: ignore[attr-defined]

    def encode_one(self, step: Any) -> dict[str, np.ndarray]:
        """One step checked against the server's space, in storage form (a batch of one row)."""
        return self.schema.encode_one(step)

    def encode_batch(self, batch: Any) -> tuple[dict[str, np.ndarray], int]:
        """A batch checked against the server's space, in storage form; and its number of rows."""
        return self.schema.encode_batch(batch)

    @property
    def connection(self) -> Connection:
        if self._router is not None:
            return self._router.writer()[1].connection
        return self._conn

    def close(self) -> None:
        """Close the socket, after waiting for the commits in flight (`wait=False`): raises, once
        closed, the first of them that failed unseen, as `flush` does. Over several servers,
        after settling the episodes in doubt on shards that answer at once (`settle(timeout)`
        first to wait for the others). Safe to call twice."""
        if self._router is not None:
            self._router.close()
            return
        if self._conn.closed:
            return
        try:
            self._drain()
        finally:
            self._conn.close()
        self.flush()  # reports what failed unseen

    def __enter__(self) -> ActorClient:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
            return
        with contextlib.suppress(Exception):  # the exception under way is the one to see
            self.close()


class ActorSegment:
    """One episode being streamed: `append`, `extend`, then `commit` or `abort`.

    The server hears of the segment only when its first full message leaves: an episode that
    fits in one message travels as a single push at commit (one round trip in all).
    """

    def __init__(self, client: ActorClient, key: bytes | None = None) -> None:
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
        self._priorities: np.ndarray | None = None  # per buffered row (NaN: none given), once one is
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

    def append(self, step: Any, priority: float | None = None) -> None:
        """Add one step (with its priority, for a prioritized server); checked against the space
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
        given = _check_priorities(None if priority is None else [priority], 1)
        self._add(self._client.encode_one(step), 1, given)

    def extend(self, batch: Any, priorities: Any = None) -> None:
        """Add a batch of steps (a leading axis on every leaf), with one priority per step if given."""
        self._require_open("extend")
        encoded, n = self._client.encode_batch(batch)
        self.extend_encoded(encoded, n, _check_priorities(priorities, n))

    def extend_encoded(self, encoded: dict[str, np.ndarray], n: int, priorities: np.ndarray | None = None) -> None:
        """Add rows already checked and in storage form (from `ActorClient.encode_batch`), with
        priorities already checked (empty or None: none given)."""
        self._require_open("extend")
        self._add(encoded, n, priorities if priorities is not None else _NO_PRIORITIES)

    def _add(self, encoded: dict[str, np.ndarray], n: int, priorities: np.ndarray) -> None:
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
            if len(priorities) or self._priorities is not None:
                if self._priorities is None:
                    self._priorities = np.full(self._batch_capacity, np.nan)
                self._priorities[first : first + take] = priorities[offset : offset + take] if len(priorities) else np.nan
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
        priorities = self._priorities[:n] if self._priorities is not None else _NO_PRIORITIES
        # The message owns these arrays until it is sent (frames leave without a copy).
        self._batch, self._priorities, self._buffered_rows = None, None, 0
        while len(self._pending) >= self._config.max_in_flight:
            self._settle_oldest()
        segment_id = self.segment_id
        self._pending.append(self._conn.send(lambda rid: P.Append(rid, segment_id, n, arrays, priorities)))

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

    @overload
    def commit(self, *, wait: Literal[True] = True) -> Receipt: ...
    @overload
    def commit(self, *, wait: Literal[False]) -> PendingCommit: ...
    @overload
    def commit(self, *, wait: bool) -> Receipt | PendingCommit: ...

    def commit(self, *, wait: bool = True) -> Receipt | PendingCommit:
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

        Raises:
            RateLimitedError: the server's rate limit held the commit back for the client's
                `rate_limit_timeout`; the segment stays open on the server: call commit again.
        """
        self._require_open("commit")
        if self.segment_id is None:
            return self._push_whole(wait)
        self._send_buffered()
        while self._pending:
            self._settle_oldest()
        segment_id, limit, key = self.segment_id, self._config.rate_limit_timeout, self.key
        return self._conclude(lambda rid: P.Commit(rid, segment_id, limit, key), wait)

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
        priorities = self._priorities[:n] if self._priorities is not None else _NO_PRIORITIES
        limit, key = self._config.rate_limit_timeout, self.key
        if not wait:  # it may share a message with the next episodes committed so (see _queue_commit)
            self._state = "committing"
            return self._client._queue_commit(arrays, n, priorities, key, self._settled)
        return self._conclude(lambda rid: P.PushEpisode(rid, n, arrays, limit, priorities, key), wait)

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
