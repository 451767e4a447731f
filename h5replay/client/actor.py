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
import os
import threading
import typing
from collections.abc import Sequence
from typing import Any, Literal, overload

import numpy as np

from h5replay import protocol as P
from h5replay.client._commits import PendingCommit, _Flight, _Queue
from h5replay.client._connection import Connection, curve_keys, say_hello
from h5replay.client._core.actor import (
    ActorState,
    Ready,
    Settled,
    check_settle_timeout,
    episode_entries,
    group_pushes,
    own_copies,
    push_request,
    send_commit,
)
from h5replay.client._drive import BlockingDriver
from h5replay.client._segment import ActorSegment
from h5replay.client._shards import InDoubt, ShardedActor, ShardedSegment
from h5replay.config import DEFAULT_ENDPOINT, ClientConfig, process_name
from h5replay.errors import ConfigError
from h5replay.priorities import Given
from h5replay.records import Receipt

__all__ = ["ActorClient", "ActorSegment", "PendingCommit", "Receipt", "ShardedActorClient"]


_KEPT_FAILURES = 1000  # failed commit messages in flight kept for `flush` to report, at most (the newest)


def _no_updates() -> None:
    """An actor holds no priority updates back (its driver's flush does nothing)."""


def _nobody_told(receipt: Receipt | None, error: Exception | None) -> None:
    """A push's outcome goes to its PendingCommit only (no segment follows it)."""


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

    def __new__(cls, endpoint: str = DEFAULT_ENDPOINT, timeout: float = 10.0, *,
                endpoints: Sequence[str] | None = None, **kwargs: Any) -> ActorClient:
        # ActorClient(endpoints=...) is the front of several servers: ShardedActorClient.
        return super().__new__(ShardedActorClient if endpoints is not None and cls is ActorClient else cls)

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
        if endpoints is not None:
            raise ConfigError(f"{type(self).__name__} is the client of one server: give endpoints= to ActorClient "
                              "itself (its front for several servers)")
        self.config = config or ClientConfig(endpoint=endpoint, timeout=timeout, name=name or process_name("actor"))
        # Commits sent with wait=False and not yet settled (oldest first), and those that failed
        # unseen: `flush` reports them.
        self._in_flight: collections.deque[_Flight] = collections.deque()
        self._failures: collections.deque[_Flight] = collections.deque(maxlen=_KEPT_FAILURES)
        self._flights_lock = threading.RLock()  # over both: calls from several threads take turns
        self._queue: _Queue | None = None  # episodes of segments committed with wait=False, not yet sent
        self._conn, hello = say_hello(self.config, "actor", curve_keys(secret_key, server_key))
        self._adopt_state(ActorState(self.config, hello), BlockingDriver(self._conn, self._conn, _no_updates))

    def _adopt_state(self, state: ActorState, driver: BlockingDriver) -> None:
        self._state, self._driver = state, driver
        self.limits, self.space, self.capacity = state.limits, state.space, state.capacity
        self.server_version, self.replay_id, self.instance_id = state.server_version, state.replay_id, state.instance_id
        self.schema = state.schema
        self.rows_per_message, self.rows_per_push = state.rows_per_message, state.rows_per_push
        self.commit_timeout, self.commit_hold = state.commit_timeout, state.commit_hold

    @property
    def state(self) -> ActorState:
        """What this client knows of its server (h5replay.client._core.actor)."""
        return self._state

    @property
    def driver(self) -> BlockingDriver:
        """Runs the core's plans on this client's connection."""
        return self._driver

    @property
    def keeps_finals(self) -> bool:
        """Whether the server keeps episodes' final observations (`serve --observation-keys`)."""
        return self._state.keeps_finals

    def encode_one(self, step: Any) -> dict[str, np.ndarray]:
        """One step checked against the server's space, in storage form (a batch of one row)."""
        return self._state.encode_one(step)

    def encode_batch(self, batch: Any) -> tuple[dict[str, np.ndarray], int]:
        """A batch checked against the server's space, in storage form; and its number of rows."""
        return self._state.encode_batch(batch)

    def encode_final(self, final: Any) -> dict[str, np.ndarray] | None:
        """An episode's final observation in storage form, checked before it leaves (None: none);
        see `ActorState.encode_final`."""
        return self._state.encode_final(final)

    def check_priorities(self, priorities: Any, n: int) -> Given | None:
        """Priorities for n steps checked against the server's tables (None: none given); see
        `ActorState.check_priorities`."""
        return self._state.check_priorities(priorities, n)

    @property
    def shard(self) -> int:
        """The index (in `endpoints`) of the shard this actor writes to now; 0 for a single server."""
        return 0

    @property
    def in_doubt(self) -> list[InDoubt]:
        """Over several servers: the episodes whose commit raised CommitInDoubtError (their shard
        lost the reply and did not answer again within the commit's time). The actor keeps each
        and settles it on that shard, with its idempotency key, once the shard answers; `receipt`
        is None until then. The newest 1000 settled ones are kept here, then those still in doubt."""
        return []

    def settle(self, timeout: float | None = None) -> list[InDoubt]:
        """Wait up to `timeout` seconds (None: the client's timeout) for every episode in doubt to
        be settled on its shard; returns those still in doubt (none for a single server, whose
        commit either returns or raises). `close()` settles only on shards that answer at once.

        Raises:
            ConfigError: `timeout` is not a number of seconds >= 0 (nor None).
        """
        check_settle_timeout(timeout)
        return []

    def segment(self) -> ActorSegment | ShardedSegment:
        """Open a segment (one episode). As a context manager it commits on normal exit and
        aborts on an exception. Over several servers the episode moves whole to the next live
        shard when its shard stops answering."""
        return ActorSegment(self)

    @overload
    def push_episode(self, batch: Any, priorities: Any = None, *, wait: Literal[True] = True,
                     final: Any = None) -> Receipt: ...
    @overload
    def push_episode(self, batch: Any, priorities: Any = None, *, wait: Literal[False],
                     final: Any = None) -> PendingCommit: ...
    @overload
    def push_episode(self, batch: Any, priorities: Any = None, *, wait: bool,
                     final: Any = None) -> Receipt | PendingCommit: ...

    def push_episode(self, batch: Any, priorities: Any = None, *, wait: bool = True,
                     final: Any = None) -> Receipt | PendingCommit:
        """Send one whole episode (a leading axis on every leaf), with one priority per step if
        given (an array for every prioritized table of the server, or {table: array}), and wait
        for its commit. Returns the global ids the server
        gave it; an empty episode records nothing: Receipt(-1, -1, 0). Blocks at most
        `commit_timeout`: a push whose reply does not come within `timeout` is sent again with the
        same idempotency key (`commit_attempts` sends in all, plus `rate_limit_timeout` when the
        server has a rate limit): the server never stores it twice.

        With `wait=False` it returns at once with a `PendingCommit` (its `result()` is the
        receipt): the actor goes on to its next episode while the server writes this one. At most
        `config.max_in_flight` commit messages are unacknowledged: an episode that fits in one
        message waits in the client's next message while they are (the episodes pushed after it
        join it, up to `rows_per_push` rows) and leaves when one is answered, as segments
        committed with `wait=False` do; a longer one first waits for the oldest. `flush()` (and `close()`) waits for them all and raises the
        first failure not seen through `result()`. The batch is copied first (or encoded), so the
        caller may reuse its arrays at once. Over several servers the push is waited for, and a
        done `PendingCommit` returned.

        Raises:
            RateLimitedError: the server's rate limit held the commit back for `rate_limit_timeout`.
            CommitInDoubtError: over several servers, the shard lost the reply and did not answer
                again: the actor keeps the episode and settles it there (`in_doubt`, `settle`).
        """
        encoded, n = self.encode_batch(batch)
        return self._push_encoded(encoded, n, self.check_priorities(priorities, n), wait, batch,
                                  self.encode_final(final))

    def _push_encoded(self, encoded: dict[str, np.ndarray], n: int, given: Given | None, wait: bool,
                      batch: Any = None, final: dict[str, np.ndarray] | None = None) -> Receipt | PendingCommit:
        """`push_episode` of checked rows; `batch`: the caller's, whose arrays `encoded` may share."""
        if n == 0:
            empty = Receipt(-1, -1, 0)
            return empty if wait else PendingCommit.done_with(empty)
        if n <= self.rows_per_message:
            if not wait:  # the message (and its retries) must not borrow arrays the caller may reuse
                encoded = own_copies(encoded, self.schema.flatten(batch))
                given = given and {table: values.copy() for table, values in given.items()}
            key = os.urandom(P.IDEMPOTENCY_KEY_BYTES)
            if not wait:  # leaves at once when there is room in flight, else with the next ones (_queue_commit)
                return self._queue_commit(encoded, n, given, key, _nobody_told, final)
            request = push_request([Ready(encoded, n, given, key, final)], self.config.rate_limit_timeout)
            return PendingCommit(self._send_commit(request, track=False), key).result()
        seg = ActorSegment(self)
        try:
            seg.extend_encoded(encoded, n, given)
            seg.set_final_encoded(final)
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
                      wait: Literal[True] = True, finals: Sequence[Any] | None = None) -> list[Receipt]: ...
    @overload
    def push_episodes(self, batches: Sequence[Any], priorities: Sequence[Any] | None = None, *,
                      wait: Literal[False], finals: Sequence[Any] | None = None) -> list[PendingCommit]: ...
    @overload
    def push_episodes(self, batches: Sequence[Any], priorities: Sequence[Any] | None = None, *,
                      wait: bool, finals: Sequence[Any] | None = None) -> list[Receipt] | list[PendingCommit]: ...

    def push_episodes(self, batches: Sequence[Any], priorities: Sequence[Any] | None = None, *,
                      wait: bool = True, finals: Sequence[Any] | None = None) -> list[Receipt] | list[PendingCommit]:
        """Push several whole episodes (short ones, or those a vectorized environment ends
        together): as many as fit go in one message (`rows_per_push` rows), each episode with
        its own idempotency key, so the server's work and the round trips are shared. Every
        episode is checked before any leaves. `priorities`: one entry per episode, None or one
        per step (or by table, as `push_episode` takes them). `finals`: one entry per episode, its
        final observation or None. Returns one receipt per episode, in order (an empty one records nothing:
        Receipt(-1, -1, 0)); with `wait=False`, one `PendingCommit` per episode, as
        `push_episode` does. The server checks a message's episodes before it writes any of them.
        Over several servers, each episode is pushed as by `push_episode`.

        Raises:
            ConfigError: `priorities` has not one entry per episode.
            SpaceMismatchError: an episode does not fit the space (nothing was sent).
            H5ReplayError: the error of a message the server refused: with `wait=True`, after every
                message has settled; episodes of other messages may be committed (`wait=False`
                tells each apart).
        """
        each, ends = episode_entries(batches, priorities, finals)
        episodes = []  # (encoded, rows, priorities given, batch, final): all checked before anything leaves
        for batch, given, final in zip(batches, each, ends):
            encoded, n = self.encode_batch(batch)
            episodes.append((encoded, n, self.check_priorities(given, n), batch, self.encode_final(final)))
        pending: list[PendingCommit | None] = [None] * len(episodes)
        for kind, group in group_pushes([e[1] for e in episodes], self.rows_per_message, self.rows_per_push):
            if kind == "empty":  # records nothing, sends nothing
                pending[group[0]] = PendingCommit.done_with(Receipt(-1, -1, 0))
            else:
                self._push_group(episodes, group, pending)
        commits = typing.cast("list[PendingCommit]", pending)
        if not wait:
            return commits
        for commit in commits:  # every message settles before the first failure is raised
            commit._flight.settle()
        return [commit.result() for commit in commits]

    def _push_group(self, episodes: list[tuple[dict[str, np.ndarray], int, Given | None, Any, Any]],
                    group: list[int], pending: list[PendingCommit | None]) -> None:
        """Send episodes (indices into `episodes`, checked) in one message; their commits in flight
        go to `pending` at the same indices."""
        if not group:
            return
        if len(group) == 1:
            encoded, n, given, batch, final = episodes[group[0]]
            pending[group[0]] = typing.cast(PendingCommit, self._push_encoded(encoded, n, given, False, batch, final))
            return
        ready = [Ready(episodes[i][0], episodes[i][1], episodes[i][2], os.urandom(P.IDEMPOTENCY_KEY_BYTES), episodes[i][4])
                 for i in group]
        flight = self._send_commit(push_request(ready, self.config.rate_limit_timeout), track=True)
        for j, i in enumerate(group):
            pending[i] = PendingCommit(flight, ready[j].key, j)

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
                retried = self._driver.run(send_commit(self._state, request))
                return _Flight(self._conn, self._driver, retried, [settled])
            self._make_room()
            retried = self._driver.run(send_commit(self._state, request))
            flight = _Flight(self._conn, self._driver, retried, [settled], self._failures)
            self._in_flight.append(flight)
            return flight

    def _queue_commit(self, rows: dict[str, np.ndarray], n: int, priorities: Given | None, key: bytes,
                      settled: Settled, final: dict[str, np.ndarray] | None = None) -> PendingCommit:
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
                queue = self._queue = _Queue(_Flight(self._conn, self._driver, None, [], self._failures, client=self))
            flight = queue.flight
            queue.episodes.append(Ready(rows, n, priorities, key, final))
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
            request = push_request(queue.episodes, self.config.rate_limit_timeout)
            try:
                self._make_room()
                retried = self._driver.run(send_commit(self._state, request))
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
        return dict(self._conn.request(lambda rid: P.Info(rid)).stats)  # type: ignore[attr-defined]

    @property
    def connection(self) -> Connection:
        return self._conn

    def close(self) -> None:
        """Close the socket, after waiting for the commits in flight (`wait=False`): raises, once
        closed, the first of them that failed unseen, as `flush` does. Over several servers,
        after settling the episodes in doubt on shards that answer at once (`settle(timeout)`
        first to wait for the others). Safe to call twice."""
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


class ShardedActorClient(ActorClient):
    """`ActorClient(endpoints=[...])`: an actor over several servers ("shards").

    It writes to its home shard (a stable hash of its name) and moves to the next live shard when
    that one stops answering, the episode in flight pushed again whole; every call goes through
    the shard router (h5replay.client._shards), whose shards' clients are one-server ActorClients.
    Commits over several servers are always waited for: with `wait=False` a done
    `PendingCommit` is returned.
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
        if endpoints is None:
            raise ConfigError("ShardedActorClient needs endpoints= (the servers, the same list for every client)")
        self.config = config or ClientConfig(endpoint=endpoint, timeout=timeout, name=name or process_name("actor"))
        self._router = ShardedActor(endpoints, self.config, secret_key, server_key, client_class=ActorClient,
                                    segment_class=ActorSegment)
        codec = self._router.codec  # all shards hold the same space: one shard's figures are every one's
        self._conn = codec.connection
        self._adopt_state(codec.state, codec.driver)

    @property
    def shard(self) -> int:
        """The index (in `endpoints`) of the shard this actor writes to now."""
        return self._router.current

    @property
    def in_doubt(self) -> list[InDoubt]:
        """The episodes whose commit raised CommitInDoubtError (see `ActorClient.in_doubt`)."""
        return self._router.in_doubt

    def settle(self, timeout: float | None = None) -> list[InDoubt]:
        """Wait up to `timeout` seconds for every episode in doubt to be settled on its shard;
        returns those still in doubt (see `ActorClient.settle`)."""
        check_settle_timeout(timeout)
        return self._router.settle(timeout)

    def segment(self) -> ShardedSegment:
        """Open a segment (one episode), which moves whole to the next live shard when its shard
        stops answering."""
        return self._router.segment()

    def push_episode(self, batch: Any, priorities: Any = None, *, wait: bool = True,  # type: ignore[override]
                     final: Any = None) -> Receipt | PendingCommit:
        """`ActorClient.push_episode` over the shards, always waited for."""
        receipt = self._router.push_episode(batch, priorities, final=final)
        return receipt if wait else PendingCommit.done_with(receipt)

    def push_episodes(self, batches: Sequence[Any], priorities: Sequence[Any] | None = None, *,  # type: ignore[override]
                      wait: bool = True, finals: Sequence[Any] | None = None) -> list[Receipt] | list[PendingCommit]:
        """Each episode pushed as by `push_episode`, in order (every one checked first)."""
        each, ends = episode_entries(batches, priorities, finals)
        receipts = [self._router.push_episode(batch, given, final=final) for batch, given, final in zip(batches, each, ends)]
        return receipts if wait else [PendingCommit.done_with(r) for r in receipts]

    def flush(self) -> None:
        """Nothing is in flight over several servers: commits are waited for."""

    def info(self) -> dict[str, Any]:
        """The current shard's figures, with "shard": its index."""
        return self._router.info()

    @property
    def connection(self) -> Connection:
        """The current shard's connection."""
        return self._router.writer()[1].connection

    def close(self) -> None:
        """Close every shard's client, after settling the episodes in doubt on shards that answer
        at once (`settle(timeout)` first to wait for the others). Safe to call twice."""
        self._router.close()
