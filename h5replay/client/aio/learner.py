"""AsyncLearnerClient: a learner's reads as coroutines, on asyncio (`zmq.asyncio`).

The same verbs as `LearnerClient`, run by the same plans of the client core
(h5replay.client._core) on an asyncio driver: requests are built, split and their replies
joined and checked exactly as the blocking client does; only the waiting differs. Many
coroutines may use one client at once (each request has its own future; replies are matched by
request id). Timeouts raise `ServerUnavailableError`, never `asyncio.TimeoutError`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import AsyncIterator, Sequence
from typing import Any

from h5replay.client._connection import curve_keys
from h5replay.client._core import batches as plan_batches
from h5replay.client._core import draws as plan_draws
from h5replay.client._core import reads as plan_reads
from h5replay.client._core.draws import Drawn
from h5replay.client._core.ops import Plan
from h5replay.client._core.state import LearnerState
from h5replay.client._reads import TableDraws, View, _positive, _reachable, _seed
from h5replay.client.aio._connection import AsyncConnection
from h5replay.client.aio._drive import AsyncDriver
from h5replay.client.aio._shard_learner import AsyncShardedLearner
from h5replay.config import DEFAULT_ENDPOINT, ClientConfig, process_name
from h5replay.errors import ClosedError, ConfigError
from h5replay.records import Episode, SampleInfo
from h5replay.spaces import Schema, Space
from h5replay.transitions import TransitionKeys

__all__ = ["AsyncLearnerClient", "AsyncShardedLearnerClient"]

log = logging.getLogger("h5replay.client")


class AsyncLearnerClient:
    """Reads from one server, as coroutines. Connects at `async with` (or `await connect()`);
    every verb connects first when that was not done.

    ::

        async with AsyncLearnerClient("tcp://127.0.0.1:5555") as learner:
            await learner.wait_for_size(1000)
            batch, info = await learner.sample(256, with_info=True)
            async for batch in learner.batches(256, prefetch=8):
                ...

    Args:
        endpoint, timeout, name, config, secret_key, server_key: as `LearnerClient`.
        endpoints: several servers ("shards"), instead of `endpoint`: as `LearnerClient(endpoints=)`,
            the same routing on asyncio (`AsyncShardedLearnerClient`).

    Consuming draws (a queue, a rate limit): a call cancelled while its rows are drawn does not
    lose them. Its draw goes on to its end (within `timeout` plus `rate_limit_timeout`) and what
    it drew is kept (`num_kept`), returned first by the next call of the same kind, which waits
    for it. Such draws of one client are made one after another, in call order.

    Raises:
        ConfigError: only one of secret_key / server_key.
    """

    def __new__(cls, endpoint: str = DEFAULT_ENDPOINT, timeout: float = 10.0, *,
                endpoints: Sequence[str] | None = None, **kwargs: Any) -> AsyncLearnerClient:
        # AsyncLearnerClient(endpoints=...) is the front of several servers: AsyncShardedLearnerClient.
        return super().__new__(AsyncShardedLearnerClient if endpoints is not None and cls is AsyncLearnerClient
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
                              "AsyncLearnerClient itself (its front for several servers)")
        self.config = config or ClientConfig(endpoint=endpoint, timeout=timeout, name=name or process_name("learner"))
        self._curve = curve_keys(secret_key, server_key)
        self._state: LearnerState | None = None
        self._conn: AsyncConnection | None = None
        self._reads: AsyncConnection | None = None
        self._driver: AsyncDriver | None = None
        self._connecting: asyncio.Lock | None = None
        self._draw_lock: asyncio.Lock | None = None  # consuming draws, one after another
        self._drawing: set[asyncio.Task[Drawn | None]] = set()
        self._updating: set[asyncio.Task[int]] = set()  # priority updates sent with wait=False
        self._update_errors: list[BaseException] = []
        #: Ids ignored by the priority updates sent with wait=False, as their replies came back.
        self.ignored_priority_updates = 0
        self._closed = False
        self.read_endpoint = ""
        self.server_version = self.replay_id = self.instance_id = ""

    # ------------------------------------------------------------------ connecting

    async def connect(self) -> AsyncLearnerClient:
        """Say hello to the server (once; later calls return at once). Returns self.

        Raises:
            ServerUnavailableError: no answer within `timeout`.
            ClosedError: the client was closed.
        """
        if self._closed:
            raise ClosedError("this learner was closed")
        if self._state is not None:
            return self
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._state is None:
                await self._hello()
        return self

    async def _hello(self) -> None:
        conn = AsyncConnection(self.config.endpoint, self.config, curve=self._curve)
        try:
            hello = await AsyncDriver(conn, conn).run(plan_reads.hello(self.config.name))
            conn.limits = hello.limits
            read_endpoint = _reachable(hello.read_endpoint, self.config.endpoint)
            reads = conn
            if read_endpoint != self.config.endpoint:
                reads = AsyncConnection(read_endpoint, self.config, curve=self._curve)
                reads.limits = hello.limits
        except BaseException:
            await conn.aclose()
            raise
        self._conn, self._reads, self._driver = conn, reads, AsyncDriver(conn, reads, self.flush_priorities)
        self._state = LearnerState(self.config, hello, separate_reads=reads is not conn)
        self._state.updates_pending = lambda: bool(self._updating or self._update_errors)
        self.read_endpoint = read_endpoint
        self.server_version, self.replay_id, self.instance_id = hello.server_version, hello.replay_id, hello.instance_id

    async def _ready(self) -> tuple[LearnerState, AsyncDriver]:
        if self._state is None or self._driver is None:
            await self.connect()
        if self._closed:
            raise ClosedError("this learner was closed")
        return self._state, self._driver  # type: ignore[return-value]

    def _known(self) -> LearnerState:
        if self._state is None:
            raise ConfigError("this learner is not connected yet: `await learner.connect()` (or `async with`) first")
        return self._state

    @property
    def space(self) -> Space:
        return self._known().space

    @property
    def schema(self) -> Schema:
        return self._known().schema

    @property
    def limits(self) -> Any:
        return self._known().limits

    @property
    def capacity(self) -> int | None:
        return self._known().capacity

    @property
    def sampling(self) -> dict[str, Any]:
        """The server's sampling settings (sampler, rate limit, ...) as its hello gave them."""
        return self._known().sampling

    @property
    def view(self) -> View | None:
        """The newest published state a reply of this client came from (None before any read)."""
        return self._state.view if self._state is not None else None

    @property
    def views(self) -> tuple[View | None, ...]:
        """Each shard's view (one entry for a single server)."""
        return (self.view,)

    @property
    def _view(self) -> View | None:
        return self.view

    @_view.setter
    def _view(self, view: View | None) -> None:  # the shard router hands a restarted shard its last view
        self._known().view = view

    @property
    def transition_keys(self) -> TransitionKeys | None:
        """The server's observation keys and reward / end-flag leaves (None: it keeps no finals)."""
        return self._known().transition_keys

    def _table(self, table: str | None) -> TableDraws:
        """How to draw from `table` (None: the server's only table); raises ConfigError as `sample`."""
        return self._known().table(table)

    def _num_kept(self, kind: Any) -> int:
        """Rows (windows) of draws of `kind` kept for this client (the shard router counts them as
        what this shard can give)."""
        return self._state.kept.count(kind) if self._state is not None else 0

    def _take_kept(self) -> dict[Any, list[tuple[Any, SampleInfo]]]:
        """Everything kept, taken out and decoded (a shard's client about to be dropped hands it over)."""
        state = self._known()
        return {kind: [(state.kind_schema(kind).decode(arrays), info) for arrays, info in parts]
                for kind, parts in state.kept.take_all().items()}

    @property
    def num_kept(self) -> int:
        """Rows (windows) consuming draws handed to this client that no call returned yet (see
        `LearnerClient.num_kept`); a cancelled call's rows count once its draw has ended."""
        return self._state.kept.count() if self._state is not None else 0

    # ------------------------------------------------------------------ figures

    async def info(self) -> dict[str, Any]:
        """The server's figures, with the buffer's own as this client's view shows them."""
        state, driver = await self._ready()
        return await driver.run(plan_reads.info(state))

    async def size(self) -> int:
        """Rows held, as a reader sees them (the blocking client's `len(learner)`)."""
        state, driver = await self._ready()
        return await driver.run(plan_reads.length(state))

    async def wait_for_size(self, size: int, timeout: float | None = None) -> int:
        """Wait until at least `size` rows may be sampled; returns the count seen. Polls `size()`,
        every 10 ms at first and every 0.2 s at most. `timeout`: seconds, None for no end.

        Raises:
            ConfigError: `size` is not an int >= 0, or `timeout` not a number >= 0.
            NotEnoughDataError: fewer than `size` rows after `timeout`.
            ServerUnavailableError: the server stopped answering.
        """
        state, driver = await self._ready()
        return await driver.run(plan_reads.wait_for_size(lambda: plan_reads.length(state), size, timeout))

    async def episodes(self) -> list[Episode]:
        """Every complete episode held, oldest first: Episode(episode_id, first_row_id, length)."""
        state, driver = await self._ready()
        table, _ = await driver.run(plan_reads.episode_table(state))
        return [Episode(*row) for row in table.tolist()]

    async def get_segments(self) -> list[tuple[int, int]]:
        """(logical start, length) of every complete episode held, oldest first (one server only)."""
        state, driver = await self._ready()
        table, view = await driver.run(plan_reads.episode_table(state))
        return [(first - view.begin, n) for _, first, n in table.tolist()]

    # ------------------------------------------------------------------ reads

    async def get(self, indices: Any) -> Any:
        """Rows at logical `indices`, as `LearnerClient.get`."""
        state, driver = await self._ready()
        return state.schema.decode(await driver.run(plan_reads.get(state, indices)))

    async def get_rows(self, row_ids: Any) -> Any:
        """Rows by global row id (any order, duplicates kept), as `LearnerClient.get_rows`."""
        state, driver = await self._ready()
        return state.schema.decode(await driver.run(plan_reads.get_rows(state, row_ids)))

    async def sample(self, batch_size: int, seed: int | None = None, *, with_info: bool = False,
                     table: str | None = None) -> Any:
        """`batch_size` rows drawn by the server's sampler, as `LearnerClient.sample` (kept rows
        first from a consuming server; see the class's note on cancellation)."""
        state, driver = await self._ready()
        return await self._draw(state, driver, plan_draws.sample(state, batch_size, seed, with_info, table), table)

    async def sample_sequences(self, batch_size: int, length: int, seed: int | None = None, *,
                               with_info: bool = False, table: str | None = None, pad: bool = False) -> Any:
        """`batch_size` windows of `length` consecutive steps, as `LearnerClient.sample_sequences`."""
        state, driver = await self._ready()
        plan = plan_draws.sample_sequences(state, batch_size, length, seed, with_info, table, pad)
        return await self._draw(state, driver, plan, table)

    async def sample_transitions(self, batch_size: int, *, n_step: int = 1, gamma: float = 0.99,
                                 with_info: bool = False, seed: int | None = None, table: str | None = None) -> Any:
        """`batch_size` n-step transitions, as `LearnerClient.sample_transitions`."""
        state, driver = await self._ready()
        plan = plan_draws.sample_transitions(state, batch_size, n_step, gamma, with_info, seed, table)
        return await self._draw(state, driver, plan, table)

    async def _draw(self, state: LearnerState, driver: AsyncDriver, plan: Plan[Drawn], table: str | None) -> Any:
        """The result of a draw plan. A consuming one runs in a task of its own that a cancelled
        caller cannot stop half-way: when the caller went away, its rows are kept."""
        if not state.table(table).consuming:
            return (await driver.run(plan)).result()
        if self._draw_lock is None:
            self._draw_lock = asyncio.Lock()
        lock = self._draw_lock
        abandoned = False

        async def draw() -> Drawn | None:
            async with lock:
                if abandoned:  # nothing drawn yet: nothing to keep
                    plan.close()
                    return None
                drawn = await driver.run(plan)
                if abandoned:
                    drawn.keep(state)
                    return None
                return drawn

        task = asyncio.get_running_loop().create_task(draw(), name="h5replay-draw")
        self._drawing.add(task)
        task.add_done_callback(self._drawn)
        try:
            drawn = await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                abandoned = True
            elif not task.cancelled() and task.exception() is None and task.result() is not None:
                task.result().keep(state)  # type: ignore[union-attr]
            raise
        if drawn is None:
            raise ClosedError("this learner was closed while it drew")
        return drawn.result()

    def _drawn(self, task: asyncio.Task[Drawn | None]) -> None:
        self._drawing.discard(task)
        if not task.cancelled() and task.exception() is not None and not isinstance(task.exception(), Exception):
            log.warning("a draw of a cancelled call ended with %r", task.exception())

    def batches(self, batch_size: int, *, prefetch: int = 4, sequence_length: int | None = None,
                with_info: bool = False, seed: int | None = None, table: str | None = None) -> AsyncIterator[Any]:
        """Batches without end, as `LearnerClient.batches`: `prefetch` batches requested ahead
        (several batches a request without a seed, from readers). Leave the loop (or `aclose()`
        the iterator) to stop: requests still travelling are dropped; from a server whose draws
        change its state, those waiting for the rate limit are cancelled and the batches already
        drawn are kept (`num_kept`), as the blocking client does.
        Arguments are checked at once when connected, else at the first batch.

        Raises:
            ConfigError, NotEnoughDataError, RateLimitedError, ServerUnavailableError: as `sample`.
        """
        size = _positive(batch_size, "batch_size")
        steps = None if sequence_length is None else _positive(sequence_length, "sequence_length")
        _positive(prefetch, "prefetch")
        if self._state is not None:
            self._state.table(table)
        return self._batches(size, prefetch, steps, with_info, seed, table)

    async def _batches(self, size: int, prefetch: int, steps: int | None, with_info: bool, seed: int | None,
                       table: str | None) -> AsyncIterator[Any]:
        state, driver = await self._ready()
        if state.table(table).consuming and self._draw_lock is not None:
            async with self._draw_lock:  # the draws of cancelled calls end first: their rows come first
                pass
        plan = plan_batches.batches(state, size, prefetch, steps, with_info, seed, table)
        stream = driver.stream(plan)
        try:
            async for batch in stream:
                yield batch
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    async def update_priorities(self, row_ids: Any, priorities: Any, *, wait: bool = True,
                                table: str | None = None) -> int | None:
        """Set the priorities of rows by id, as `LearnerClient.update_priorities`: returns once
        the writer has applied and published them (every later read of this client sees them);
        how many ids were ignored (no longer held).

        `wait=False`: checked here, then sent by a task of its own; returns None at once. Up to
        `max_in_flight` such updates travel at once (the next waits for the oldest). The next read
        of this client, and `flush_priorities()`, wait for them first (so it sees them); their
        ignored ids add up in `ignored_priority_updates`, and one the server refused raises
        there. Each leaves in its own message (the blocking client merges held ones).

        Raises:
            ConfigError: the table keeps no priorities, or a bad priority (nothing is changed).
            IndexError: an id was never committed (nothing of that message is changed).
        """
        state, driver = await self._ready()
        if wait:
            return await driver.run(plan_reads.update_priorities(state, row_ids, priorities, table))
        ids, values = plan_reads.check_update(state, row_ids, priorities, table)
        while len(self._updating) >= self.config.max_in_flight:
            await asyncio.wait(set(self._updating), return_when=asyncio.FIRST_COMPLETED)
        task = asyncio.get_running_loop().create_task(driver.run(plan_reads.send_update(state, ids, values, table)),
                                                      name="h5replay-priorities")
        self._updating.add(task)
        task.add_done_callback(self._updated)
        return None

    def _updated(self, task: asyncio.Task[int]) -> None:
        """An update sent with wait=False ended: its ignored ids counted, a failure kept for the next read."""
        self._updating.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            self._update_errors.append(error)
        else:
            self.ignored_priority_updates += task.result()

    async def flush_priorities(self) -> None:
        """Wait for every priority update sent with wait=False; the first the server refused
        (since the last flush) is raised, once the others ended."""
        while self._updating:
            await asyncio.wait(set(self._updating))
        if self._update_errors:
            error, self._update_errors = self._update_errors[0], []
            raise error

    # ------------------------------------------------------------------ closing

    async def aclose(self) -> None:
        """Wait for the draws of cancelled calls (their rows are then kept), then close both
        sockets. Rows still kept are dropped, with a warning. Safe to call twice."""
        if self._closed:
            return
        if self._drawing:
            await asyncio.wait(set(self._drawing), timeout=self.config.timeout + self.config.rate_limit_timeout)
        try:
            await self.flush_priorities()
        except Exception as exc:  # closing must not raise; the caller gave up on their replies
            log.warning("a priority update sent with wait=False failed: %s", exc)
        self._closed = True
        if self._state is not None and self._state.kept.count():
            log.warning("closing a learner that still keeps %d rows (or windows) drawn for it that no call returned: "
                        "they are gone (call sample() until num_kept is 0 first)", self._state.kept.count())
            self._state.kept.take_all()
        for conn in {id(c): c for c in (self._reads, self._conn) if c is not None}.values():
            await conn.aclose()
        if self._state is not None:
            self._state.close()

    def _drop(self) -> None:
        """Close both sockets now, without waiting (a shard router drops the client of a shard that
        stopped answering); waiters raise ClosedError. Safe twice."""
        self._closed = True
        for conn in {id(c): c for c in (self._reads, self._conn) if c is not None}.values():
            conn.close()
        if self._state is not None:
            self._state.close()

    async def __aenter__(self) -> AsyncLearnerClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncShardedLearnerClient(AsyncLearnerClient):
    """`AsyncLearnerClient(endpoints=[...])`: a learner over several servers ("shards"), on asyncio.

    The routing of `LearnerClient(endpoints=)` (reads split over every live shard in proportion to
    its rows and put back in order, packed ids, a shard that does not answer skipped with a
    warning and probed in the background), each shard's calls made by its own
    `AsyncLearnerClient`, all at once. Calls of one client run one at a time. `connect()` (or
    `async with`) says hello to every shard at once. Priority updates are always waited for.
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
            raise ConfigError("AsyncShardedLearnerClient needs endpoints= (the servers, the same list for every "
                              "client)")
        self.config = config or ClientConfig(endpoint=endpoint, timeout=timeout, name=name or process_name("learner"))
        curve_keys(secret_key, server_key)  # both or neither, checked now
        self._router = AsyncShardedLearner(endpoints, self.config, secret_key, server_key,
                                           client_class=AsyncLearnerClient)
        self.endpoints = self._router.endpoints
        # Per shard: learner.shards.shard(i).replay_id, ...
        self.read_endpoint = self.server_version = self.replay_id = self.instance_id = ""

    async def connect(self) -> AsyncShardedLearnerClient:
        """Say hello to every shard at once (once). Returns self.

        Raises:
            ServerUnavailableError: no shard answered within `timeout`.
            ConfigError: the shards hold different spaces, or two endpoints reach the same file.
            ClosedError: the client was closed.
        """
        await self._router.connect()
        return self

    def _routed(self) -> AsyncShardedLearner:
        if self._router.space is None:
            raise ConfigError("this learner is not connected yet: `await learner.connect()` (or `async with`) first")
        return self._router

    @property
    def space(self) -> Space:
        return self._routed().space  # type: ignore[return-value]

    @property
    def schema(self) -> Schema:
        return Schema(self.space)

    @property
    def limits(self) -> Any:
        return self._routed().limits

    @property
    def capacity(self) -> int | None:
        """Rows all shards hold together when full (None when one grows without limit)."""
        return self._routed().capacity

    @property
    def sampling(self) -> dict[str, Any]:
        """Each shard has its own: `learner.shards.shard(i).sampling`."""
        raise ConfigError("over several servers each shard has its own sampling settings: "
                          "learner.shards.shard(i).sampling")

    @property
    def view(self) -> View | None:
        """None: each shard has its own (see `views`)."""
        return None

    @property
    def views(self) -> tuple[View | None, ...]:
        """Each shard's view, in `endpoints` order."""
        return self._router.views

    @property
    def shards(self) -> AsyncShardedLearner:
        """The routing: `live_shards`, `num_skipped`, `shard(i)` (the client of one shard)."""
        return self._router

    @property
    def num_kept(self) -> int:
        """Rows (and windows) kept for this client by every shard (see `LearnerClient.num_kept`)."""
        return self._router.num_kept

    @property
    def transition_keys(self) -> TransitionKeys | None:
        return self._routed().transition_keys

    @property
    def ignored_priority_updates(self) -> int:  # type: ignore[override]
        """0: over several servers updates are waited for, and return their ignored count."""
        return 0

    async def info(self) -> dict[str, Any]:
        """The shards' figures added up, each shard's under "shards"."""
        return await self._router.run(self._router.info_plan())

    async def size(self) -> int:
        """Rows that may be sampled on every live shard together."""
        return await self._router.run(self._router.length_plan())

    async def wait_for_size(self, size: int, timeout: float | None = None) -> int:
        """Wait until every live shard together holds at least `size` rows (see `LearnerClient.wait_for_size`)."""
        measure: Any = self._router.length_plan  # a routing plan: its Fans run on the router
        return await self._router.poll(plan_reads.wait_for_size(measure, size, timeout))

    async def episodes(self) -> list[Episode]:
        """Every complete episode, shard by shard, with packed ids."""
        return await self._router.run(self._router.episodes_plan())

    async def get(self, indices: Any) -> Any:
        """Raises NotImplementedError: shards have no common order (use `get_rows`)."""
        return self._router.get(indices)

    async def get_segments(self) -> list[tuple[int, int]]:
        """Raises NotImplementedError: shards have no common order (use `episodes`)."""
        return self._router.get_segments()

    async def get_rows(self, row_ids: Any) -> Any:
        """Rows by packed id or (shard, row_id) pairs (see `LearnerClient.get_rows`)."""
        return await self._router.run(self._router.get_rows_plan(row_ids))

    async def sample(self, batch_size: int, seed: int | None = None, *, with_info: bool = False,
                     table: str | None = None) -> Any:
        """From every live shard in proportion to the rows it holds (see `LearnerClient.sample`)."""
        return await self._router.run(self._router.sample_plan(batch_size, seed, with_info=with_info, table=table))

    async def sample_sequences(self, batch_size: int, length: int, seed: int | None = None, *,
                               with_info: bool = False, table: str | None = None, pad: bool = False) -> Any:
        """Windows from every live shard (see `LearnerClient.sample_sequences`)."""
        return await self._router.run(self._router.sample_sequences_plan(batch_size, length, seed, with_info=with_info,
                                                                         table=table, pad=pad))

    async def sample_transitions(self, batch_size: int, *, n_step: int = 1, gamma: float = 0.99,
                                 with_info: bool = False, seed: int | None = None, table: str | None = None) -> Any:
        """Transitions from every live shard (see `LearnerClient.sample_transitions`)."""
        return await self._router.run(self._router.sample_transitions_plan(
            batch_size, n_step=n_step, gamma=gamma, with_info=with_info, seed=seed, table=table))

    def batches(self, batch_size: int, *, prefetch: int = 4, sequence_length: int | None = None,
                with_info: bool = False, seed: int | None = None, table: str | None = None) -> AsyncIterator[Any]:
        """Each batch is one `sample` (or `sample_sequences`) across the shards, which already fans
        out (arguments checked at once; see `LearnerClient.batches`)."""
        size = _positive(batch_size, "batch_size")
        steps = None if sequence_length is None else _positive(sequence_length, "sequence_length")
        _positive(prefetch, "prefetch")
        if self._router.space is not None:
            self._router.check_table(table)
        return self._sharded_batches(size, steps, with_info, seed, table)

    async def _sharded_batches(self, size: int, steps: int | None, with_info: bool, seed: int | None,
                               table: str | None) -> AsyncIterator[Any]:
        for k in itertools.count():
            if steps is None:
                yield await self.sample(size, _seed(seed, k), with_info=with_info, table=table)
            else:
                yield await self.sample_sequences(size, steps, _seed(seed, k), with_info=with_info, table=table)

    async def update_priorities(self, row_ids: Any, priorities: Any, *, wait: bool = True,
                                table: str | None = None) -> int | None:
        """Set priorities by packed id on their shards, always waited for (see `LearnerClient.update_priorities`)."""
        return await self._router.run(self._router.update_priorities_plan(row_ids, priorities, table))

    async def flush_priorities(self) -> None:
        """Nothing is held back over several servers: updates are waited for."""

    async def aclose(self) -> None:
        """Close every shard's client. Safe to call twice."""
        await self._router.aclose()

    def _drop(self) -> None:
        self._router.close()

