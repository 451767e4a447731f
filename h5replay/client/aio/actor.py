"""AsyncActorClient: an actor's episodes as coroutines, on asyncio (`zmq.asyncio`).

The same verbs as `ActorClient`, run by the same plans of the client core
(h5replay.client._core.actor and .segments): steps are checked, batched into messages, opened,
appended, committed and retried with their idempotency key exactly as the blocking client does;
only the waiting differs. Many coroutines may use one client at once (each request has its own
future). Timeouts raise `ServerUnavailableError`, never `asyncio.TimeoutError`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
from collections.abc import Sequence
from typing import Any, Literal, overload

import numpy as np

from h5replay import protocol as P
from h5replay.client._connection import curve_keys
from h5replay.client._core.actor import (
    ActorState,
    Ready,
    actor_hello,
    check_settle_timeout,
    episode_entries,
    group_pushes,
    own_copies,
    push_request,
    receipts,
    send_commit,
    settle_commit,
)
from h5replay.client._core.ops import checked
from h5replay.client._shards import InDoubt
from h5replay.client.aio._commits import AsyncPendingCommit, _copy_outcome, _Outcome
from h5replay.client.aio._connection import AsyncConnection
from h5replay.client.aio._drive import AsyncDriver
from h5replay.client.aio._segment import AsyncActorSegment
from h5replay.client.aio._shard_actor import AsyncShardedActor, AsyncShardedSegment
from h5replay.config import DEFAULT_ENDPOINT, ClientConfig, process_name
from h5replay.errors import ClosedError, ConfigError
from h5replay.priorities import Given
from h5replay.records import Receipt
from h5replay.spaces import Schema, Space

__all__ = ["AsyncActorClient", "AsyncActorSegment", "AsyncPendingCommit", "AsyncShardedActorClient"]

_KEPT_FAILURES = 1000  # failed commits in flight kept for `flush` to report, at most (the newest)


class AsyncActorClient:
    """Writes episodes to one server, as coroutines. Connects at `async with` (or `await
    connect()`); every verb connects first when that was not done.

    ::

        async with AsyncActorClient("tcp://127.0.0.1:5555") as actor:
            await actor.push_episode({"obs": obs, "reward": rewards})
            async with actor.segment() as seg:
                for step in steps:
                    await seg.append(step)

    Args:
        endpoint, timeout, name, config, secret_key, server_key: as `ActorClient`.
        endpoints: several servers ("shards"), instead of `endpoint`: as `ActorClient(endpoints=)`,
            the same routing on asyncio (`AsyncShardedActorClient`).

    With `wait=False`, up to `config.max_in_flight` commits are unacknowledged (the next one
    waits for the oldest; a push that fits in one message waits in the client's next message,
    with those pushed after it, and they leave together); `flush()` (and `aclose()`) waits for
    them all and raises the first failure not seen through `result()`. Segments committed with
    `wait=False` that fit in one message queue so as well.

    Cancellation: a streamed episode whose coroutine is cancelled mid-append is aborted (nothing
    of it becomes visible); a cancelled commit may have been applied, but whole, never in part.

    Raises:
        ConfigError: only one of secret_key / server_key.
    """

    def __new__(cls, endpoint: str = DEFAULT_ENDPOINT, timeout: float = 10.0, *,
                endpoints: Sequence[str] | None = None, **kwargs: Any) -> AsyncActorClient:
        # AsyncActorClient(endpoints=...) is the front of several servers: AsyncShardedActorClient.
        return super().__new__(AsyncShardedActorClient if endpoints is not None and cls is AsyncActorClient
                               else cls)

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
            raise ConfigError(f"{type(self).__name__} is the client of one server: give endpoints= to "
                              "AsyncActorClient itself (its front for several servers)")
        self.config = config or ClientConfig(endpoint=endpoint, timeout=timeout, name=name or process_name("actor"))
        self._curve = curve_keys(secret_key, server_key)
        self._state: ActorState | None = None
        self._conn: AsyncConnection | None = None
        self._driver: AsyncDriver | None = None
        self._connecting: asyncio.Lock | None = None
        self._in_flight: collections.deque[_Outcome] = collections.deque()  # tracked commits, oldest first
        self._failures: collections.deque[_Outcome] = collections.deque(maxlen=_KEPT_FAILURES)
        # Episodes pushed with wait=False while the window was full: the client's next message.
        self._queue: list[Ready] = []
        self._queue_outcome: _Outcome | None = None
        self._queue_rows = 0
        self._sending: list[asyncio.Task[None]] = []  # queued messages on their way, in push order
        self._closed = False

    # ------------------------------------------------------------------ connecting

    async def connect(self) -> AsyncActorClient:
        """Say hello to the server (once; later calls return at once). Returns self.

        Raises:
            ServerUnavailableError: no answer within `timeout`.
            ClosedError: the client was closed.
        """
        if self._closed:
            raise ClosedError("this actor was closed")
        if self._state is not None:
            return self
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._state is None:
                conn = AsyncConnection(self.config.endpoint, self.config, curve=self._curve)
                try:
                    hello = await AsyncDriver(conn, conn).run(actor_hello(self.config.name))
                except BaseException:
                    await conn.aclose()
                    raise
                conn.limits = hello.limits
                self._conn, self._driver = conn, AsyncDriver(conn, conn)
                self._state = ActorState(self.config, hello)
        return self

    async def _ready(self) -> tuple[ActorState, AsyncDriver]:
        if self._state is None or self._driver is None:
            await self.connect()
        if self._closed:
            raise ClosedError("this actor was closed")
        return self._state, self._driver  # type: ignore[return-value]

    @property
    def state(self) -> ActorState:
        """What this client knows of its server (h5replay.client._core.actor), once connected.

        Raises:
            ConfigError: not connected yet.
        """
        if self._state is None:
            raise ConfigError("this actor is not connected yet: `await actor.connect()` (or `async with`) first")
        return self._state

    @property
    def space(self) -> Space:
        return self.state.space

    @property
    def schema(self) -> Schema:
        return self.state.schema

    @property
    def limits(self) -> P.Limits:
        return self.state.limits

    @property
    def capacity(self) -> int | None:
        return self.state.capacity

    @property
    def keeps_finals(self) -> bool:
        """Whether the server keeps episodes' final observations (`serve --observation-keys`)."""
        return self.state.keeps_finals

    @property
    def rows_per_message(self) -> int:
        return self.state.rows_per_message

    @property
    def rows_per_push(self) -> int:
        return self.state.rows_per_push

    @property
    def commit_timeout(self) -> float:
        return self.state.commit_timeout

    # ------------------------------------------------------------------ episodes

    def segment(self) -> AsyncActorSegment:
        """Open a segment (one episode); connect first. As an async context manager it commits on
        normal exit and aborts on an exception (a cancellation too)."""
        return AsyncActorSegment(self)

    @overload
    async def push_episode(self, batch: Any, priorities: Any = None, *, wait: Literal[True] = True,
                           final: Any = None) -> Receipt: ...
    @overload
    async def push_episode(self, batch: Any, priorities: Any = None, *, wait: Literal[False],
                           final: Any = None) -> AsyncPendingCommit: ...
    @overload
    async def push_episode(self, batch: Any, priorities: Any = None, *, wait: bool,
                           final: Any = None) -> Receipt | AsyncPendingCommit: ...

    async def push_episode(self, batch: Any, priorities: Any = None, *, wait: bool = True,
                           final: Any = None) -> Receipt | AsyncPendingCommit:
        """Send one whole episode and wait for its commit, as `ActorClient.push_episode` does
        (checked before it leaves; sent again with its key while no reply comes, within
        `commit_timeout`). With `wait=False`, returns once it has left, with an
        `AsyncPendingCommit`; the caller may reuse its arrays at once.

        Raises:
            SpaceMismatchError, ConfigError: the episode (or its priorities, its final) does not
                fit the server: nothing was sent.
            RateLimitedError: the server's rate limit held the commit back for `rate_limit_timeout`.
        """
        state, _ = await self._ready()
        encoded, n = state.encode_batch(batch)
        given, end = state.check_priorities(priorities, n), state.encode_final(final)
        pending = await self._push_encoded(state, encoded, n, given, end, batch, wait)
        return await pending.result() if wait else pending

    async def _push_encoded(self, state: ActorState, encoded: dict[str, np.ndarray], n: int, given: Given | None,
                            final: dict[str, np.ndarray] | None, batch: Any, wait: bool) -> AsyncPendingCommit:
        """One checked episode on its way: empty (done), one push, or streamed through a segment."""
        if n == 0:
            return AsyncPendingCommit.done_with(Receipt(-1, -1, 0))
        if n <= state.rows_per_message:
            if not wait:  # the message (and its retries) must not borrow arrays the caller may reuse
                encoded = own_copies(encoded, state.schema.flatten(batch))
                given = given and {table: values.copy() for table, values in given.items()}
            ready = Ready(encoded, n, given, os.urandom(P.IDEMPOTENCY_KEY_BYTES), final)
            if not wait and self._must_queue():
                return self._enqueue(state, ready)
            return await self._send_commit(push_request([ready], self.config.rate_limit_timeout), ready.key,
                                           track=not wait)
        seg = AsyncActorSegment(self)
        try:
            await seg.extend_encoded(encoded, n, given)
            seg.set_final_encoded(final)
            seg._seg.abandon_on_failure = True  # the caller holds the episode, not this segment
            return await seg._commit_pending(track=not wait)
        except BaseException:
            # The caller holds the episode, not this segment: nothing of it may stay open on the server.
            with contextlib.suppress(Exception):
                await seg.abort()
            raise

    @overload
    async def push_episodes(self, batches: Sequence[Any], priorities: Sequence[Any] | None = None, *,
                            wait: Literal[True] = True, finals: Sequence[Any] | None = None) -> list[Receipt]: ...
    @overload
    async def push_episodes(self, batches: Sequence[Any], priorities: Sequence[Any] | None = None, *,
                            wait: Literal[False], finals: Sequence[Any] | None = None) -> list[AsyncPendingCommit]: ...
    @overload
    async def push_episodes(self, batches: Sequence[Any], priorities: Sequence[Any] | None = None, *, wait: bool,
                            finals: Sequence[Any] | None = None) -> list[Receipt] | list[AsyncPendingCommit]: ...

    async def push_episodes(self, batches: Sequence[Any], priorities: Sequence[Any] | None = None, *,
                            wait: bool = True,
                            finals: Sequence[Any] | None = None) -> list[Receipt] | list[AsyncPendingCommit]:
        """Push several whole episodes, as many as fit in one message, each with its own key, as
        `ActorClient.push_episodes` does; every episode is checked before any leaves. Returns one
        receipt per episode, in order (with `wait=False`, one `AsyncPendingCommit` each).

        Raises:
            ConfigError: `priorities` or `finals` has not one entry per episode.
            SpaceMismatchError: an episode does not fit the space (nothing was sent).
            H5ReplayError: the error of a message the server refused, after every message settled.
        """
        each, ends = episode_entries(batches, priorities, finals)
        state, _ = await self._ready()
        episodes = []  # (encoded, rows, priorities, final, batch): all checked before anything leaves
        for batch, given, final in zip(batches, each, ends):
            encoded, n = state.encode_batch(batch)
            episodes.append((encoded, n, state.check_priorities(given, n), state.encode_final(final), batch))
        pending: list[AsyncPendingCommit | None] = [None] * len(episodes)
        for kind, group in group_pushes([e[1] for e in episodes], state.rows_per_message, state.rows_per_push):
            if kind == "empty":
                pending[group[0]] = AsyncPendingCommit.done_with(Receipt(-1, -1, 0))
            elif len(group) == 1:
                encoded, n, given, final, batch = episodes[group[0]]
                pending[group[0]] = await self._push_encoded(state, encoded, n, given, final, batch, False)
            else:
                ready = [Ready(episodes[i][0], episodes[i][1], episodes[i][2], os.urandom(P.IDEMPOTENCY_KEY_BYTES),
                               episodes[i][3]) for i in group]
                first = await self._send_commit(push_request(ready, self.config.rate_limit_timeout), ready[0].key,
                                                track=True)
                for j, i in enumerate(group):
                    pending[i] = AsyncPendingCommit(first._outcome, ready[j].key, j)
        commits = [commit for commit in pending if commit is not None]
        if not wait:
            return commits
        await asyncio.wait({commit._settling for commit in commits})  # never cancels them
        return [await commit.result() for commit in commits]

    async def _send_commit(self, request: Any, key: bytes, *, track: bool, settled: Any = None,
                           outcome: _Outcome | None = None) -> AsyncPendingCommit:
        """Send a commit (or push), then settle it in a task of its own (sent again with its key
        while no reply comes); with `track`, it counts in the in-flight window and `flush` waits
        for it. `settled(receipt, error)` is told the outcome; `outcome`: the one its episodes'
        pendings already hold (queued episodes), resolved with it.

        Raises:
            NotSentError: it could not leave (no server connected within the timeout).
        """
        state, driver = await self._ready()
        if outcome is None and (self._queue or self._sending):  # commits leave in the order made
            if self._queue:
                self._launch_queue()
            await asyncio.wait(list(self._sending))
        if track:
            await self._make_room()
        retried = await driver.run(send_commit(state, request))

        async def settle() -> list[Receipt]:
            try:
                found = receipts(await driver.run(settle_commit(retried)))
            except Exception as exc:
                if settled is not None:
                    settled(None, exc)
                raise
            if settled is not None:
                settled(found[0] if found else None, None)
            return found

        task = asyncio.get_running_loop().create_task(settle(), name="h5replay-commit")
        if outcome is None:
            outcome = _Outcome(task)
        else:
            task.add_done_callback(lambda done: _copy_outcome(done, outcome.future))
        if track:
            self._in_flight.append(outcome)
            outcome.future.add_done_callback(lambda done: self._settled(outcome))
        return AsyncPendingCommit(outcome, key)

    def _settled(self, outcome: _Outcome) -> None:
        """A tracked commit ended: out of the window (queued episodes may leave now); a failure
        waits for `flush` unless seen."""
        with contextlib.suppress(ValueError):
            self._in_flight.remove(outcome)
        future = outcome.future
        if not future.cancelled() and future.exception() is not None:
            self._failures.append(outcome)
        if self._queue and not self._closed:
            self._launch_queue()

    async def _make_room(self) -> None:
        """Before another commit leaves: wait for the oldest while `max_in_flight` are unsettled."""
        while len(self._in_flight) >= self.config.max_in_flight:
            await asyncio.wait([self._in_flight[0].future])

    def _must_queue(self) -> bool:
        """Whether an unwaited episode of one message waits in the client's next message: the
        window is full, or earlier ones wait there (commits leave in the order made)."""
        return bool(self._queue or self._sending or len(self._in_flight) >= self.config.max_in_flight)

    def _enqueue(self, state: ActorState, ready: Ready) -> AsyncPendingCommit:
        """An episode that fits in one message, pushed with wait=False while `max_in_flight`
        messages are out: it waits in the client's next message, with the episodes pushed after
        it (up to `rows_per_push` rows), which leaves when a reply makes room (`_launch_queue`)."""
        if self._queue and self._queue_rows + ready.n > state.rows_per_push:
            self._launch_queue()
        if self._queue_outcome is None:
            self._queue_outcome = _Outcome(asyncio.get_running_loop().create_future())
        self._queue.append(ready)
        self._queue_rows += ready.n
        return AsyncPendingCommit(self._queue_outcome, ready.key, len(self._queue) - 1)

    def _launch_queue(self) -> None:
        """Send the queued episodes as one message, in a task of their own (it waits for room);
        the messages leave in the order their episodes were pushed."""
        episodes, outcome = self._queue, self._queue_outcome
        self._queue, self._queue_outcome, self._queue_rows = [], None, 0
        if not episodes or outcome is None:
            return
        previous = self._sending[-1] if self._sending else None

        async def send() -> None:
            if previous is not None:
                await asyncio.wait([previous])  # in push order
            try:
                await self._send_commit(push_request(episodes, self.config.rate_limit_timeout), episodes[0].key,
                                        track=True, outcome=outcome)
            except BaseException as exc:  # never left: its episodes' pendings raise it, flush reports it
                if not outcome.future.done():
                    outcome.future.set_exception(exc)
                    self._failures.append(outcome)

        task = asyncio.get_running_loop().create_task(send(), name="h5replay-queued-commit")
        self._sending.append(task)
        task.add_done_callback(self._sending.remove)

    async def _drain(self) -> None:
        """Send what is queued, then wait for every commit in flight."""
        while self._queue or self._sending or self._in_flight:
            if self._queue:
                self._launch_queue()
            waiting: list[asyncio.Future[Any]] = [*self._sending, *(outcome.future for outcome in self._in_flight)]
            await asyncio.wait(waiting)

    async def flush(self) -> None:
        """Wait for every commit sent with `wait=False` to be acknowledged. Raises the first
        failure since the last flush that `result()` did not show (a note says how many failed);
        each is reported once."""
        await self._drain()
        failed = [outcome for outcome in self._failures if not outcome.observed]
        self._failures.clear()
        for outcome in failed:
            outcome.observed = True
        if failed:
            error = failed[0].future.exception()
            if error is not None:
                if len(failed) > 1:
                    error.args = (f"{error.args[0] if error.args else error} (and {len(failed) - 1} more commit(s) in "
                                  "flight failed since the last flush; their result() raises each)", *error.args[1:])
                raise error

    async def info(self) -> dict[str, Any]:
        """The server's figures (length, episodes, clients, rows in, ...)."""
        _, driver = await self._ready()
        request_id = await driver.writer.send(lambda rid: P.Info(rid))
        return dict(checked(await driver.writer.wait(request_id)).stats)

    def encode_one(self, step: Any) -> dict[str, np.ndarray]:
        """One step checked against the server's space, in storage form (connect first)."""
        return self.state.encode_one(step)

    def encode_batch(self, batch: Any) -> tuple[dict[str, np.ndarray], int]:
        """A batch checked against the server's space, in storage form; and its number of rows."""
        return self.state.encode_batch(batch)

    def encode_final(self, final: Any) -> dict[str, np.ndarray] | None:
        """An episode's final observation in storage form, checked (None: none; see `ActorState.encode_final`)."""
        return self.state.encode_final(final)

    def check_priorities(self, priorities: Any, n: int) -> Given | None:
        """Priorities for n steps checked against the server's tables (None: none given)."""
        return self.state.check_priorities(priorities, n)

    @property
    def instance_id(self) -> str:
        """The server process's id, from its hello ("" before)."""
        return self._state.instance_id if self._state is not None else ""

    @property
    def replay_id(self) -> str:
        """The id of the server's file, from its hello ("" before)."""
        return self._state.replay_id if self._state is not None else ""

    @property
    def server_version(self) -> str:
        return self._state.server_version if self._state is not None else ""

    def _drop(self) -> None:
        """Close the socket now, without waiting (a shard router drops the client of a shard that
        stopped answering); waiters raise ClosedError. Safe twice."""
        self._closed = True
        if self._conn is not None:
            self._conn.close()

    # ------------------------------------------------------------------ closing

    async def aclose(self) -> None:
        """Wait for the commits in flight (`wait=False`), close the socket, then raise the first of
        them that failed unseen, as `flush` does. Safe to call twice."""
        if self._closed:
            return
        try:
            await self._drain()
        finally:
            self._closed = True
            if self._conn is not None:
                await self._conn.aclose()
        await self.flush()

    async def __aenter__(self) -> AsyncActorClient:
        return await self.connect()

    async def __aexit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            await self.aclose()
            return
        with contextlib.suppress(Exception):  # the exception under way is the one to see
            await self.aclose()


class AsyncShardedActorClient(AsyncActorClient):
    """`AsyncActorClient(endpoints=[...])`: an actor over several servers ("shards"), on asyncio.

    The routing of `ActorClient(endpoints=)`: it writes to its home shard (a stable hash of its
    name) and moves to the next live shard when that one stops answering, the episode in flight
    pushed again whole; an episode whose commit reply was lost is kept (`in_doubt`) and settled on
    its shard (`await settle()`); each shard's verbs are made by its own `AsyncActorClient`. Calls
    of one actor (its segments' too) run one at a time. Commits over several servers are always
    waited for: with `wait=False` a done `AsyncPendingCommit` is returned.
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
            raise ConfigError("AsyncShardedActorClient needs endpoints= (the servers, the same list for every client)")
        self.config = config or ClientConfig(endpoint=endpoint, timeout=timeout, name=name or process_name("actor"))
        curve_keys(secret_key, server_key)  # both or neither, checked now
        self._router = AsyncShardedActor(endpoints, self.config, secret_key, server_key,
                                         client_class=AsyncActorClient, segment_class=AsyncActorSegment)
        self.endpoints = self._router.endpoints

    async def connect(self) -> AsyncShardedActorClient:
        """Say hello to every shard at once (once); then only the shard written to stays connected.

        Raises:
            ServerUnavailableError: no shard answered within `timeout`.
            ConfigError: the shards hold different spaces, or two endpoints reach the same file.
        """
        await self._router.connect()
        return self

    @property
    def state(self) -> ActorState:
        """What this client knows of its servers (every shard holds the same space and limits)."""
        if self._router._codec is None:
            raise ConfigError("this actor is not connected yet: `await actor.connect()` (or `async with`) first")
        return self._router.codec.state  # type: ignore[no-any-return]

    @property
    def shard(self) -> int:
        """The index (in `endpoints`) of the shard this actor writes to now."""
        return self._router.current

    @property
    def instance_id(self) -> str:
        """Empty: each shard is its own server process."""
        return ""

    @property
    def replay_id(self) -> str:
        """Empty: each shard's file has its own."""
        return ""

    @property
    def server_version(self) -> str:
        return ""

    @property
    def shards(self) -> AsyncShardedActor:
        """The routing: `current`, `home`, `num_failovers`."""
        return self._router

    @property
    def in_doubt(self) -> list[InDoubt]:
        """The episodes whose commit raised CommitInDoubtError (see `ActorClient.in_doubt`)."""
        return self._router.in_doubt

    async def settle(self, timeout: float | None = None) -> list[InDoubt]:
        """Wait up to `timeout` seconds for every episode in doubt to be settled on its shard;
        returns those still in doubt (see `ActorClient.settle`)."""
        check_settle_timeout(timeout)
        return await self._router.run(self._router.settle_plan(timeout))

    def segment(self) -> AsyncShardedSegment:  # type: ignore[override]
        """Open a segment (one episode), which moves whole to the next live shard when its shard
        stops answering. As an async context manager it commits on normal exit and aborts on an
        exception (a cancellation too)."""
        return self._router.segment()

    async def push_episode(self, batch: Any, priorities: Any = None, *, wait: bool = True,  # type: ignore[override]
                           final: Any = None) -> Receipt | AsyncPendingCommit:
        """`AsyncActorClient.push_episode` over the shards, always waited for."""
        await self._router.connect()
        receipt: Receipt = await self._router.run(self._router.push_episode_plan(
            AsyncShardedSegment(self._router), batch, priorities, final))
        return receipt if wait else AsyncPendingCommit.done_with(receipt)

    async def push_episodes(self, batches: Sequence[Any], priorities: Sequence[Any] | None = None, *,
                            wait: bool = True, finals: Sequence[Any] | None = None) -> list[Any]:
        """Each episode pushed as by `push_episode`, in order (every one checked first)."""
        await self._router.connect()
        each, ends = episode_entries(batches, priorities, finals)
        return [await self.push_episode(batch, given, wait=wait, final=end)
                for batch, given, end in zip(batches, each, ends)]

    async def flush(self) -> None:
        """Nothing is in flight over several servers: commits are waited for."""

    async def info(self) -> dict[str, Any]:
        """The current shard's figures, with "shard": its index."""
        return await self._router.run(self._router.info_plan())

    async def aclose(self) -> None:
        """Settle what is in doubt on shards that answer now (`settle(timeout)` first to wait for
        the others), then close every shard's client. Safe to call twice."""
        await self._router.aclose()

    def _drop(self) -> None:
        self._router.close()
