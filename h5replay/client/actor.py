"""ActorClient: stream steps into episodes on an h5replay server; commit or abort them.

Steps are checked against the server's space here, before they leave the process, then batched
into messages (by rows, bytes or time) and pipelined: up to `max_in_flight` appends travel before
the actor waits for an acknowledgement, so a fast actor cannot outrun the server's memory. A
commit returns only after the server has the episode in the file, flushed.
"""

from __future__ import annotations

import collections
import contextlib
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from h5replay import protocol as P
from h5replay.client._connection import Connection, NotSentError, curve_keys, say_hello
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
from h5replay.sampling import check_priorities
from h5replay.spaces import Schema, Space, space_from_json

__all__ = ["ActorClient", "ActorSegment", "Receipt"]


_NO_PRIORITIES = np.zeros(0, dtype=np.float64)


def _check_priorities(priorities: Any, n: int) -> np.ndarray:
    """Priorities for n steps as sent (empty: none given), checked here before anything leaves."""
    return _NO_PRIORITIES if priorities is None else check_priorities(priorities, n)


def _receipt(reply: Any) -> Receipt:
    """The receipt of a commit or push reply: global ids, or (-1, -1, 0) when nothing was recorded."""
    if reply.episode_id is None or reply.first_row_id is None or reply.length == 0:
        return Receipt(-1, -1, 0)
    return Receipt(int(reply.episode_id), int(reply.first_row_id), int(reply.length))


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

    def _adopt(self, shard: ActorClient) -> None:
        """Take the figures of a shard's client as this client's (all shards hold the same space)."""
        self._conn = shard.connection
        self.limits, self.space, self.capacity = shard.limits, shard.space, shard.capacity
        self.server_version, self.replay_id, self.instance_id = shard.server_version, shard.replay_id, shard.instance_id
        self.schema, self._row_bytes, self.rows_per_message = shard.schema, shard._row_bytes, shard.rows_per_message
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

    def push_episode(self, batch: Any, priorities: Any = None) -> Receipt:
        """Send one whole episode (a leading axis on every leaf), with one priority per step if
        given (a prioritized server), and wait for its commit. Returns the global ids the server
        gave it; an empty episode records nothing: Receipt(-1, -1, 0). Blocks at most
        `commit_timeout`: a push whose reply does not come within `timeout` is sent again with the
        same idempotency key (`commit_attempts` sends in all, plus `rate_limit_timeout` when the
        server has a rate limit): the server never stores it twice.

        Raises:
            RateLimitedError: the server's rate limit held the commit back for `rate_limit_timeout`.
            CommitInDoubtError: over several servers, the shard lost the reply and did not answer
                again: the actor keeps the episode and settles it there (`in_doubt`, `settle`).
        """
        if self._router is not None:
            return self._router.push_episode(batch, priorities)
        encoded, n = self.encode_batch(batch)
        given = _check_priorities(priorities, n)
        if n == 0:
            return Receipt(-1, -1, 0)
        if n <= self.rows_per_message:
            limit, key = self.config.rate_limit_timeout, os.urandom(P.IDEMPOTENCY_KEY_BYTES)
            return _receipt(self._conn.request_again(lambda rid: P.PushEpisode(rid, n, encoded, limit, given, key),
                                                     self.commit_timeout, self.config.commit_attempts, self.commit_hold))
        seg = self.segment()
        try:
            seg.extend_encoded(encoded, n, given)
            return seg.commit()
        except BaseException:
            # The caller holds the episode, not this segment: nothing of it may stay open on the
            # server (a commit refused for a full disk or by the rate limit would leave it open).
            with contextlib.suppress(Exception):
                seg.abort()
            raise

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
        """Close the socket (after every commit was acknowledged; over several servers, after
        settling the episodes in doubt on shards that answer at once: `settle(timeout)` first to
        wait for the others). Safe to call twice."""
        if self._router is not None:
            self._router.close()
            return
        self._conn.close()

    def __enter__(self) -> ActorClient:
        return self

    def __exit__(self, *exc: object) -> None:
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

    def commit(self) -> Receipt:
        """Send what is buffered, wait for every append, then commit. Returns after the server has
        the episode in the file, flushed. Raises and aborts if any part was refused. A commit
        whose reply does not come is sent again with the episode's key (see `_conclude`); the
        server answers a retry of an applied commit with its receipt, never storing it twice.

        Raises:
            RateLimitedError: the server's rate limit held the commit back for the client's
                `rate_limit_timeout`; the segment stays open on the server: call commit again.
        """
        self._require_open("commit")
        if self.segment_id is None:
            return self._push_whole()
        self._send_buffered()
        while self._pending:
            self._settle_oldest()
        segment_id, limit, key = self.segment_id, self._config.rate_limit_timeout, self.key
        return self._conclude(lambda rid: P.Commit(rid, segment_id, limit, key))

    def _conclude(self, request: Any) -> Receipt:
        """Send the request that commits the episode, again with the same key when no reply comes
        within `timeout` (`commit_attempts` in all, within the client's `commit_timeout`); its
        reply is the receipt. Refused for a full disk (DiskFullError) or by the rate limit, the
        segment stays open: commit again later, or abort."""
        config = self._config
        try:
            reply = self._conn.request_again(request, self._client.commit_timeout, config.commit_attempts,
                                             self._client.commit_hold)
        except (DiskFullError, RateLimitedError):
            raise  # still open: the server keeps the segment (a push's rows stay here); commit again
        except NotSentError:
            self._state = "failed"
            raise
        except BaseException as exc:
            self._state = "failed"
            self.in_doubt = isinstance(exc, ServerUnavailableError)
            raise
        self._state = "committed"
        self.receipt = _receipt(reply)
        return self.receipt

    def _push_whole(self) -> Receipt:
        """Commit an episode that never left the client: one push, one round trip."""
        n, batch = self._buffered_rows, self._batch
        if not n or batch is None:
            self._batch, self._priorities, self._buffered_rows = None, None, 0
            self._state = "committed"
            self.receipt = Receipt(-1, -1, 0)
            return self.receipt
        arrays = {path: rows[:n] for path, rows in batch.items()}
        priorities = self._priorities[:n] if self._priorities is not None else _NO_PRIORITIES
        limit, key = self._config.rate_limit_timeout, self.key
        receipt = self._conclude(lambda rid: P.PushEpisode(rid, n, arrays, limit, priorities, key))
        self._batch, self._priorities, self._buffered_rows = None, None, 0
        return receipt

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
