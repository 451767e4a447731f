"""LearnerClient: read rows and sample batches from an h5replay server.

The hello goes to the writer's endpoint, which names the read endpoint served by reader
processes; every read (and `len`, and the buffer's figures in `info`) goes there, so learners
never slow down ingest and every answer comes from the same kind of view: a published state of
the file. The client remembers the newest state it has seen (its `seq`) and sends it with every
read; no reader answers from an older one, so a learner's view never goes back in time. An
episode whose commit an actor saw acknowledged is visible to every read sent after that moment.

Logical index 0 is the oldest row held when the request is served: the ring moves as actors
commit. Row ids (`get_rows`, `SampleInfo.row_ids`) never move. A request bigger than the server's
message limits is split into several messages, sent together, and put back together in order.

Returned arrays are read-only views of the received message when one message carried them (no
copy); copy them to modify.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any, Literal, TypeVar, overload

from h5replay.client._connection import Connection, curve_keys, say_hello
from h5replay.client._core import batches as plan_batches
from h5replay.client._core import draws as plan_draws
from h5replay.client._core import reads as plan_reads
from h5replay.client._core.ops import Plan, finished
from h5replay.client._core.state import LearnerState
from h5replay.client._drive import BlockingDriver
from h5replay.client._priorities import PriorityUpdates
from h5replay.client._reads import TableDraws, View, _positive, _reachable, _seed
from h5replay.client._shards import ShardedLearner
from h5replay.config import DEFAULT_ENDPOINT, ClientConfig, process_name
from h5replay.errors import ConfigError
from h5replay.records import Episode, SampleInfo
from h5replay.spaces import Schema
from h5replay.transitions import TransitionKeys

log = logging.getLogger("h5replay.client")

__all__ = ["LearnerClient", "ShardedLearnerClient", "View"]

T = TypeVar("T")


class LearnerClient:
    """Reads from a server. Calls are serialised by a lock; one per thread is fastest.

    Args:
        endpoint: the server's (writer's) endpoint, e.g. "tcp://127.0.0.1:5555".
        timeout: seconds to wait for any reply before raising ServerUnavailableError.
        config: full client settings (overrides endpoint and timeout).
        secret_key, server_key: CURVE certificate files (`h5replay keys generate`).
        endpoints: several servers ("shards", the same list in the same order for every client),
            instead of `endpoint`: reads go to every live shard and are put together; a shard that
            does not answer is skipped with a warning (see h5replay.client._shards).

    Raises:
        ServerUnavailableError: the server (every shard) did not answer the hello within `timeout`.
        ConfigError: the shards hold different spaces, or two endpoints reach the same file.
    """

    # Every read is a plan of the client core (h5replay.client._core: requests built, replies
    # folded), which this client's driver (h5replay.client._drive) runs over its two sockets;
    # h5replay.client.aio.AsyncLearnerClient runs the same plans on asyncio.

    def __new__(cls, endpoint: str = DEFAULT_ENDPOINT, timeout: float = 10.0, *,
                endpoints: Sequence[str] | None = None, **kwargs: Any) -> LearnerClient:
        # LearnerClient(endpoints=...) is the front of several servers: ShardedLearnerClient.
        return super().__new__(ShardedLearnerClient if endpoints is not None and cls is LearnerClient else cls)

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
            raise ConfigError(f"{type(self).__name__} is the client of one server: give endpoints= to LearnerClient "
                              "itself (its front for several servers)")
        self.config = config or ClientConfig(endpoint=endpoint, timeout=timeout, name=name or process_name("learner"))
        self._reads: Connection | None = None
        curve = curve_keys(secret_key, server_key)
        self._conn, hello = say_hello(self.config, "learner", curve)
        try:
            read_endpoint = _reachable(hello.read_endpoint, self.config.endpoint)
            if read_endpoint == self.config.endpoint:
                self._reads = self._conn
            else:
                self._reads = Connection(read_endpoint, self.config, curve=curve)
                self._reads.limits = hello.limits
        except BaseException:
            self._conn.close()  # nothing else is open yet (close() would look for what is not made)
            raise
        #: What this client knows of its server (limits, tables, its view, kept rows): the core's.
        self._state = state = LearnerState(self.config, hello, separate_reads=self._reads is not self._conn)
        self.limits, self.space, self.capacity, self.schema = state.limits, state.space, state.capacity, state.schema
        self.read_endpoint = read_endpoint
        self.server_version = hello.server_version
        self.replay_id = hello.replay_id
        self.instance_id = hello.instance_id
        #: The server's sampling settings (sampler, rate limit, ...) as its hello gave them.
        self.sampling: dict[str, Any] = state.sampling
        #: Rows one reply may carry, with their ids and probabilities: a bigger read is split.
        self.rows_per_message = state.rows_per_message
        # Priority updates sent with wait=False (see _priorities.py); every read flushes them first.
        self._updates = PriorityUpdates(self._conn, self.config.max_in_flight, state.update_timeout,
                                        state.ids_per_message)
        state.updates_pending = lambda: self._updates.pending
        state.updates_seq = lambda: self._updates.seen_seq
        self._driver = BlockingDriver(self._conn, self._reads, self.flush_priorities)

    def _run(self, plan: Plan[T]) -> T:
        return self._driver.run(plan)

    def _table(self, table: str | None) -> TableDraws:
        """How to draw from `table` (None: the server's only table).

        Raises:
            ConfigError: the server has no such table, or several and none was named.
        """
        return self._state.table(table)

    def _kind_schema(self, kind: Any) -> Schema:
        return self._state.kind_schema(kind)

    # ------------------------------------------------------------------ the view

    @property
    def _view(self) -> View | None:
        return self._state.view

    @_view.setter
    def _view(self, view: View | None) -> None:  # the shard router hands a restarted shard its last view
        self._state.view = view

    @property
    def view(self) -> View | None:
        """The newest published state a reply of this client came from (None before any read, and
        over several servers: see `views`)."""
        return self._view

    @property
    def views(self) -> tuple[View | None, ...]:
        """Each shard's view (one entry for a single server)."""
        return (self._view,)

    @property
    def shards(self) -> ShardedLearner[LearnerClient] | None:
        """Over several servers, the routing: `live_shards`, `num_skipped`, `shard(i)` (the client of
        one shard); None for a single server."""
        return None

    @property
    def num_kept(self) -> int:
        """Rows (and windows) that draws changing the server's state (a queue, a rate limit)
        handed to this client and no call has returned yet: a call that failed part-way keeps
        what it had drawn, and the next `sample` (or `sample_sequences` of that length) returns
        it first. Over several servers, those of every shard."""
        return self._state.kept.count()

    @property
    def ignored_priority_updates(self) -> int:
        """Ids ignored by the priority updates sent with wait=False, as their replies came back."""
        return self._updates.ignored

    @ignored_priority_updates.setter
    def ignored_priority_updates(self, count: int) -> None:
        self._updates.ignored = count

    def _num_kept(self, kind: Any) -> int:
        """Rows (windows) of draws of `kind` kept for this client (the shard router counts them as
        what this shard can give)."""
        return self._state.kept.count(kind) if self._state is not None else 0

    def _take_kept(self) -> dict[Any, list[tuple[Any, SampleInfo]]]:
        """Everything kept, taken out and decoded (a shard's client about to be dropped hands it over)."""
        return {kind: [(self._kind_schema(kind).decode(arrays), info) for arrays, info in parts]
                for kind, parts in self._state.kept.take_all().items()}

    # ------------------------------------------------------------------ figures

    def info(self) -> dict[str, Any]:
        """The server's figures (clients, rows in and out, commits, ...), with the buffer's own
        (length, num_episodes, seq, ...) as this client's view of the file shows them. Over several
        servers: the shards' figures added up, each shard's under "shards"."""
        return self._run(plan_reads.info(self._state))

    def __len__(self) -> int:
        return self._run(plan_reads.length(self._state))

    def wait_for_size(self, size: int, timeout: float | None = None) -> int:
        """Block until at least `size` rows may be sampled (over every shard with `endpoints=`),
        e.g. a learner's warm-up before its first batch; returns the count seen. Polls
        `len(self)`, every 10 ms at first and every 0.2 s at most. `timeout`: seconds, None
        for no end.

        Raises:
            ConfigError: `size` is not an int >= 0, or `timeout` not a number >= 0.
            NotEnoughDataError: fewer than `size` rows after `timeout` (the message says how many).
            ServerUnavailableError: the server stopped answering.
        """
        return self._run(plan_reads.wait_for_size(lambda: plan_reads.length(self._state), size, timeout))

    # ------------------------------------------------------------------ reads

    def get(self, indices: Any) -> Any:
        """Rows at logical `indices` (ints, negatives from the end, any order, duplicates kept), as
        the buffer is when the request is served; returned flat (n, ...).

        Raises:
            IndexError: an index is out of range.
            TypeError: the indices are not integers (a boolean mask is refused: pass its
                np.flatnonzero; the buffer moves between the mask and the read).
            EvictedError: a request split over several messages met rows the ring dropped meanwhile.
            NotImplementedError: over several servers (shards have no common order: use get_rows).
        """
        return self.schema.decode(self._run(plan_reads.get(self._state, indices)))

    def get_rows(self, row_ids: Any) -> Any:
        """Rows by global row id (any order, duplicates kept); returned flat (n, ...). Over several
        servers, ids qualified by shard: packed ids (`h5replay.records.pack_ids`,
        `SampleInfo.packed_row_ids`, the ids of `episodes()`) or an (n, 2) array of (shard, row_id).

        Raises:
            EvictedError: an id is no longer held (the message names the first such id).
            IndexError: an id was never committed, or is negative.
            TypeError: the ids are not integers.
            ServerUnavailableError: over several servers, a shard named does not answer.
        """
        return self.schema.decode(self._run(plan_reads.get_rows(self._state, row_ids)))

    def sample(self, batch_size: int, seed: int | None = None, *, with_info: bool = False,
               table: str | None = None) -> Any:
        """`batch_size` rows drawn by the server's sampler: uniformly or by priority, with
        replacement; fifo / lifo or when rows are removed, without. With `with_info=True` returns
        (batch, SampleInfo): row ids, episode ids, draw probabilities (for importance weights:
        `SampleInfo.importance_weights(beta)`). A batch bigger than one message is drawn in parts
        (seed, seed + 1, ...). Over several servers, from every live shard in proportion to the
        rows it holds (one request per shard, all at once); `SampleInfo.shard_ids` says where
        each row came from. `table`: the table to draw from (None: the server's only one).

        From a server whose draws change its state (a queue, a rate limit), no row a draw handed
        out is dropped: rows this client kept from a call that failed part-way come first
        (`num_kept`), and when a part of this call fails, the parts drawn are kept for the next
        call and the error is raised (saying how many were kept).

        Raises:
            NotEnoughDataError: nothing to sample yet (without a rate limit; with one, the sample waits).
            RateLimitedError: the server's rate limit held the sample back for `rate_limit_timeout`.
            ConfigError: the server has no such table, or several and none was named.
        """
        return self._run(plan_draws.sample(self._state, batch_size, seed, with_info, table)).result()

    def sample_sequences(self, batch_size: int, length: int, seed: int | None = None, *, with_info: bool = False,
                         table: str | None = None, pad: bool = False) -> Any:
        """`batch_size` windows of `length` consecutive steps, each inside one complete episode;
        leaves come back shaped (batch_size, length, ...). With `with_info=True` returns
        (batch, SampleInfo) of each window's first row. `pad=True`: windows may start in an
        episode's last `length - 1` steps, zero-padded past its end, with `batch["mask"]` of the
        valid steps (see `ReplayBuffer.sample_sequences`). `table` and over several servers, as
        `sample`."""
        return self._run(plan_draws.sample_sequences(self._state, batch_size, length, seed, with_info, table, pad)).result()

    @property
    def transition_keys(self) -> TransitionKeys | None:
        """The server's observation keys and reward / end-flag leaves (None: it keeps no finals)."""
        return self._state.transition_keys

    def sample_transitions(self, batch_size: int, *, n_step: int = 1, gamma: float = 0.99, with_info: bool = False,
                           seed: int | None = None, table: str | None = None) -> Any:
        """`batch_size` n-step transitions drawn by the server (see
        `ReplayBuffer.sample_transitions`): the step's leaves with `reward` summed over the next
        `k` steps, `discount` = gamma ** k, `next` (the observation n steps on, or the episode's
        final) and the end flags of the last step summed. With `with_info=True`, (batch,
        SampleInfo) with `has_final`. Drawn in parts, kept on a failure, over shards: as `sample`.

        Raises:
            ConfigError: the server keeps no final observations (`serve --observation-keys`), a
                bad n_step or gamma, or no such table.
            NotEnoughDataError, RateLimitedError: as `sample`.
        """
        return self._run(plan_draws.sample_transitions(self._state, batch_size, n_step, gamma, with_info, seed,
                                                   table)).result()

    def batches(
        self, batch_size: int, *, prefetch: int = 4, sequence_length: int | None = None, with_info: bool = False,
        seed: int | None = None, table: str | None = None,
    ) -> Iterator[Any]:
        """Batches without end: `sample(batch_size)`, or `sample_sequences(batch_size,
        sequence_length)`, with `prefetch` batches requested ahead, so the server draws the next
        ones while the learner works on this one (no threads needed). With a `seed`, batch k is
        drawn with seeds from `seed + k * parts` (parts: messages per batch). Without a seed, from
        a server whose readers draw (no rate limit, no rows removed as sampled), one request
        carries several batches (up to `prefetch // 2`, about 1 MiB at most; always two requests
        or more in flight): the draws are the same independent ones, and each batch pays a part
        of a round trip. Leave the loop to stop; requests still travelling are dropped, except
        from a server whose draws change its state (a queue, a rate limit): there the batches
        already drawn are kept (`num_kept`, returned first by the next sample or loop) and the
        requests still waiting for the rate limit are cancelled, so no row is drawn for nobody.
        Over several servers, each batch is one `sample` across the shards (which already fans
        out). `table`: as `sample`.

        Raises:
            ConfigError: `batch_size`, `sequence_length` or `prefetch` is not a positive int, or
                `table` names no table of the server (at once, not at the first batch).
            NotEnoughDataError, RateLimitedError, ServerUnavailableError: as `sample`; the
                iterator ends with the error.
        """
        plan = plan_batches.batches(self._state, batch_size, prefetch, sequence_length, with_info, seed, table)
        return self._driver.stream(plan)

    @overload
    def update_priorities(self, row_ids: Any, priorities: Any, *, wait: Literal[True] = True,
                          table: str | None = None) -> int: ...
    @overload
    def update_priorities(self, row_ids: Any, priorities: Any, *, wait: Literal[False],
                          table: str | None = None) -> None: ...
    @overload
    def update_priorities(self, row_ids: Any, priorities: Any, *, wait: bool, table: str | None = None) -> int | None: ...

    def update_priorities(self, row_ids: Any, priorities: Any, *, wait: bool = True,
                          table: str | None = None) -> int | None:
        """Set the priorities of rows by id (a prioritized server), e.g. to |TD error| after a
        learning step. Ids no longer held are ignored (and counted by the server). Blocks until
        the writer has applied them and published them (durable, shown to every reader) at the
        end of its pass, or up to the server's `priority_publish_interval` later; at most
        `timeout` plus that interval. Every later read of this client asks for that publish, so it
        sees them; a SIGKILL of the server loses no update it acknowledged.

        `wait=False` (as Acme's learners update Reverb's priorities from a background executor):
        checked here and returns None at once. Up to `max_in_flight` messages of updates travel
        at once; while they do, further updates are held here and leave merged into one message
        (in call order: a later priority for a row still wins) as soon as a reply makes room, at
        the latest when a message's worth is held, at this client's next read, at
        `flush_priorities()` or at `close()`. So a learner that updates faster than one writer
        pass sends fewer, bigger messages, and the writer applies and publishes them at once.
        Their replies are read as they come, and by `flush_priorities()`, which the next read of
        this client calls first (so it sees its own updates); their ignored ids add up in
        `ignored_priority_updates`, and an update the server refused raises there (or in a later
        call). Only updates whose ids this client has seen in a reply are merged: a merged
        message can then be refused only for what would refuse each of its parts (an update
        naming an id never committed travels alone). Over several servers, updates are always
        waited for. `table`: the prioritized table whose priorities these are (None: the
        server's only table).

        Returns:
            How many ids were ignored (None with wait=False).

        Raises:
            ConfigError: the table keeps no priorities (or is not the server's), or a priority is
                negative, NaN or infinite, or the counts differ (nothing is changed).
            IndexError: an id was never committed (nothing of that message is changed).
        """
        if wait:
            return self._run(plan_reads.update_priorities(self._state, row_ids, priorities, table))
        ids, values = plan_reads.check_update(self._state, row_ids, priorities, table)
        view = self._state.view
        with self._updates.lock:
            self._updates.send(ids, values, view.end if view is not None else 0, self._state.table(table).asked)
        return None

    def flush_priorities(self) -> None:
        """Send the priority updates made with wait=False that are still held here, and wait for
        the replies of all of them. The server's refusal of one (ConfigError, IndexError) is
        raised after the others were read; when the server does not answer
        (ServerUnavailableError) the rest are given up."""
        self._updates.flush()

    def episodes(self) -> list[Episode]:
        """Every complete episode held, oldest first: Episode(episode_id, first_row_id, length).
        Over several servers, shard by shard, with packed ids (`h5replay.records.pack_ids`)."""
        table, _ = self._run(plan_reads.episode_table(self._state))
        return [Episode(*row) for row in table.tolist()]

    def get_segments(self) -> list[tuple[int, int]]:
        """(logical start, length) of every complete episode held, oldest first (one server only)."""
        table, view = self._run(plan_reads.episode_table(self._state))
        return [(first - view.begin, n) for _, first, n in table.tolist()]

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Close both sockets (after reading the replies of priority updates sent with
        wait=False; a refusal among them is logged). Rows still kept (`num_kept`) are dropped,
        with a warning. Safe to call twice."""
        kept = self._state.kept
        if kept.count():
            log.warning("closing a learner that still keeps %d rows (or windows) drawn for it that no call returned: "
                        "they are gone (call sample() until num_kept is 0 first)", kept.count())
            kept.take_all()
        if self._updates.pending and not self._conn.closed:
            try:
                self.flush_priorities()
            except Exception as exc:  # closing must not raise; the caller gave up on their replies
                log.warning("a priority update sent with wait=False failed: %s", exc)
        if self._reads is not None and self._reads is not self._conn:
            self._reads.close()
        self._conn.close()
        self._state.close()

    def __enter__(self) -> LearnerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ShardedLearnerClient(LearnerClient):
    """`LearnerClient(endpoints=[...])`: a learner over several servers ("shards").

    Reads go to every live shard and are put together; a shard that does not answer is skipped
    with a warning; every call goes through the shard router (h5replay.client._shards), whose
    shards' clients are one-server LearnerClients. Priority updates are always waited for.
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
            raise ConfigError("ShardedLearnerClient needs endpoints= (the servers, the same list for every client)")
        self.config = config or ClientConfig(endpoint=endpoint, timeout=timeout, name=name or process_name("learner"))
        self._router = router = ShardedLearner(endpoints, self.config, secret_key, server_key,
                                               client_class=LearnerClient)
        self.space, self.limits, self.capacity = router._rows_space(), router.limits, router.capacity
        self.endpoints = router.endpoints
        # Per shard: learner.shards.shard(i).replay_id, ...
        self.read_endpoint, self.server_version, self.replay_id, self.instance_id = "", "", "", ""

    @property
    def view(self) -> View | None:
        """None: each shard has its own (see `views`)."""
        return None

    @property
    def views(self) -> tuple[View | None, ...]:
        """Each shard's view, in `endpoints` order."""
        return self._router.views

    @property
    def shards(self) -> ShardedLearner[LearnerClient]:
        """The routing: `live_shards`, `num_skipped`, `shard(i)` (the client of one shard)."""
        return self._router

    @property
    def num_kept(self) -> int:
        """Rows (and windows) kept for this client by every shard (see `LearnerClient.num_kept`)."""
        return self._router.num_kept

    @property
    def ignored_priority_updates(self) -> int:
        """0: over several servers updates are waited for, and return their ignored count."""
        return 0

    @ignored_priority_updates.setter
    def ignored_priority_updates(self, count: int) -> None:
        pass

    def info(self) -> dict[str, Any]:
        """The shards' figures added up, each shard's under "shards"."""
        return self._router.info()

    def __len__(self) -> int:
        return len(self._router)

    def wait_for_size(self, size: int, timeout: float | None = None) -> int:
        """Block until every live shard together holds at least `size` rows (see `LearnerClient.wait_for_size`)."""
        router = self._router
        return BlockingDriver.alone(plan_reads.wait_for_size(lambda: finished(len(router)), size, timeout))

    def get(self, indices: Any) -> Any:
        """Raises NotImplementedError: shards have no common order (use `get_rows`)."""
        return self._router.get(indices)

    def get_rows(self, row_ids: Any) -> Any:
        """Rows by packed id or (shard, row_id) pairs (see `LearnerClient.get_rows`)."""
        return self._router.get_rows(row_ids)

    def sample(self, batch_size: int, seed: int | None = None, *, with_info: bool = False,
               table: str | None = None) -> Any:
        """From every live shard in proportion to the rows it holds (see `LearnerClient.sample`)."""
        return self._router.sample(batch_size, seed, with_info=with_info, table=table)

    def sample_sequences(self, batch_size: int, length: int, seed: int | None = None, *, with_info: bool = False,
                         table: str | None = None, pad: bool = False) -> Any:
        """Windows from every live shard (see `LearnerClient.sample_sequences`)."""
        return self._router.sample_sequences(batch_size, length, seed, with_info=with_info, table=table, pad=pad)

    @property
    def transition_keys(self) -> TransitionKeys | None:
        return self._router.transition_keys

    def sample_transitions(self, batch_size: int, *, n_step: int = 1, gamma: float = 0.99, with_info: bool = False,
                           seed: int | None = None, table: str | None = None) -> Any:
        """Transitions from every live shard (see `LearnerClient.sample_transitions`)."""
        return self._router.sample_transitions(batch_size, n_step=n_step, gamma=gamma, with_info=with_info,
                                               seed=seed, table=table)

    def batches(
        self, batch_size: int, *, prefetch: int = 4, sequence_length: int | None = None, with_info: bool = False,
        seed: int | None = None, table: str | None = None,
    ) -> Iterator[Any]:
        """Each batch is one `sample` (or `sample_sequences`) across the shards, which already fans
        out (arguments checked at once; see `LearnerClient.batches`)."""
        size = _positive(batch_size, "batch_size")
        steps = None if sequence_length is None else _positive(sequence_length, "sequence_length")
        _positive(prefetch, "prefetch")
        router = self._router
        router.check_table(table)

        def one_batch(k: int) -> Any:
            if steps is None:
                return router.sample(size, _seed(seed, k), with_info=with_info, table=table)
            return router.sample_sequences(size, steps, _seed(seed, k), with_info=with_info, table=table)

        return (one_batch(k) for k in itertools.count())

    def update_priorities(self, row_ids: Any, priorities: Any, *, wait: bool = True,  # type: ignore[override]
                          table: str | None = None) -> int | None:
        """Set priorities by packed id on their shards, always waited for (see `LearnerClient.update_priorities`)."""
        return self._router.update_priorities(row_ids, priorities, table=table)

    def flush_priorities(self) -> None:
        """Nothing is held back over several servers: updates are waited for."""

    def episodes(self) -> list[Episode]:
        """Every complete episode, shard by shard, with packed ids."""
        return self._router.episodes()

    def get_segments(self) -> list[tuple[int, int]]:
        return self._router.get_segments()

    def close(self) -> None:
        """Close every shard's client. Safe to call twice."""
        self._router.close()
