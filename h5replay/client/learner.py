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

import collections
import itertools
import logging
import os
import time
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, overload

import numpy as np

from h5replay import protocol as P
from h5replay.client._connection import Connection, curve_keys, say_hello
from h5replay.client._draws import ConsumingDraws
from h5replay.client._kept import Kept, join_parts, kept_error
from h5replay.client._priorities import PriorityUpdates
from h5replay.client._reads import (
    TableDraws,
    View,
    _chunks,
    _integer_array,
    _positive,
    _reachable,
    _request,
    _seed,
    sample_info,
    table_draws,
)
from h5replay.client._sequences import SequenceReads
from h5replay.client._shards import ShardedLearner
from h5replay.client._transitions import TransitionReads
from h5replay.config import DEFAULT_ENDPOINT, ClientConfig, process_name
from h5replay.errors import ConfigError, NotEnoughDataError, ProtocolError
from h5replay.priorities import check_priorities
from h5replay.records import Episode, SampleInfo
from h5replay.spaces import Schema, Space, space_from_json

log = logging.getLogger("h5replay.client")

__all__ = ["LearnerClient", "View"]

_REQUEST_BYTES = 1 << 20  # rows one request of `batches` carries for several batches, at most


class LearnerClient(SequenceReads, TransitionReads):
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
        self.config = config or ClientConfig(endpoint=endpoint, timeout=timeout, name=name or process_name("learner"))
        #: Over several servers: the routing (h5replay.client._shards), which every call goes through.
        self._router: ShardedLearner[LearnerClient] | None = None
        self._view: View | None = None
        self._reads: Connection | None = None
        if endpoints is not None:
            self._router = ShardedLearner(endpoints, self.config, secret_key, server_key, client_class=LearnerClient)
            self.space: Space = self._router.codec_space
            self.limits, self.capacity = self._router.limits, self._router.capacity
            self.endpoints = self._router.endpoints
            # Per shard: learner.shards.shard(i).replay_id, ...
            self.read_endpoint, self.server_version, self.replay_id, self.instance_id = "", "", "", ""
            return
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
        self.limits = hello.limits
        self.space = space_from_json(hello.space)
        self.capacity = hello.capacity
        self.read_endpoint = read_endpoint
        self.server_version = hello.server_version
        self.replay_id = hello.replay_id
        self.instance_id = hello.instance_id
        #: The server's sampling settings (sampler, rate limit, ...) as its hello gave them.
        self.sampling: dict[str, Any] = dict(hello.sampling)
        # Samples that change the buffer (a rate limit, removals) are drawn by the writer, and are
        # never drawn again: what a failed call had drawn is kept for the next (see _kept.py).
        self._draws = ConsumingDraws(self._conn, self.config, self._observe)
        # How each table is drawn from (by the name asked for), as the hello describes it; a
        # prioritized table's exponent bounds each priority, checked here too, so that updates
        # merged into one message are refused only all for one reason.
        self._table_draws: dict[str | None, TableDraws] = {}
        self._kept = Kept()
        # A priority update's reply waits for the publish carrying it: up to the server's interval.
        interval = hello.sampling.get("priority_publish_interval", 0.0)
        valid = isinstance(interval, (int, float)) and not isinstance(interval, bool) and 0 <= interval <= 1
        update_timeout = self.config.timeout + (float(interval) if valid else 1.0)
        self.schema = Schema(self.space)
        row_bytes = self.schema.row_bytes
        room = self.limits.max_message_bytes - P.ROWS_MESSAGE_OVERHEAD
        #: Rows one reply may carry, with their ids and probabilities: a bigger read is split (a
        #: single row bigger than a message is refused).
        self.rows_per_message = max(1, min(self.limits.max_rows_per_message, room // (row_bytes + P.SAMPLE_INFO_BYTES)))
        # A request naming rows carries their ids: it must fit a message too.
        self._ids_per_message = max(1, min(self.rows_per_message, room // P.ID_BYTES))
        # Priority updates sent with wait=False (see _priorities.py).
        self._updates = PriorityUpdates(self._conn, self.config.max_in_flight, update_timeout, self._ids_per_message)

    def _table(self, table: str | None) -> TableDraws:
        """How to draw from `table` (None: the server's only table).

        Raises:
            ConfigError: the server has no such table, or several and none was named.
        """
        found = self._table_draws.get(table)
        if found is None:
            found = self._table_draws[table] = table_draws(self.sampling, table, self._conn, self._reads,
                                                           self.rows_per_message)
        return found

    def _table_figure(self, t: TableDraws, figure: str) -> Any:
        return self.sampling.get(f"table.{t.name}.{figure}", self.sampling.get(figure))

    @property
    def _consuming(self) -> bool:
        """Whether some table's draws change the server's state."""
        return bool(self.sampling.get("writer_samples"))

    # ------------------------------------------------------------------ the view

    @property
    def view(self) -> View | None:
        """The newest published state a reply of this client came from (None before any read, and
        over several servers: see `views`)."""
        return self._view

    @property
    def views(self) -> tuple[View | None, ...]:
        """Each shard's view (one entry for a single server)."""
        return self._router.views if self._router is not None else (self._view,)

    @property
    def shards(self) -> ShardedLearner[LearnerClient] | None:
        """Over several servers, the routing: `live_shards`, `num_skipped`, `shard(i)` (the client of
        one shard); None for a single server."""
        return self._router

    @property
    def num_kept(self) -> int:
        """Rows (and windows) that draws changing the server's state (a queue, a rate limit)
        handed to this client and no call has returned yet: a call that failed part-way keeps
        what it had drawn, and the next `sample` (or `sample_sequences` of that length) returns
        it first. Over several servers, those of every shard."""
        if self._router is not None:
            return self._router.num_kept
        return self._kept.count()

    @property
    def ignored_priority_updates(self) -> int:
        """Ids ignored by the priority updates sent with wait=False, as their replies came back."""
        return self._updates.ignored

    @ignored_priority_updates.setter
    def ignored_priority_updates(self, count: int) -> None:
        self._updates.ignored = count

    def _take_kept(self) -> dict[Any, list[tuple[Any, SampleInfo]]]:
        """Everything kept, taken out and decoded (a shard's client about to be dropped hands it over)."""
        return {kind: [(self._kind_schema(kind).decode(arrays), info) for arrays, info in parts]
                for kind, parts in self._kept.take_all().items()}

    @property
    def _min_seq(self) -> int:
        if self._updates.pending:  # every read sees this client's own priority updates
            self.flush_priorities()
        return max(self._view.seq if self._view is not None else 0, self._updates.seen_seq)

    def _observe(self, reply: P.ReadReply) -> View:
        view = View(reply.seq, reply.generation, reply.begin, reply.end)
        if self._view is None or view.seq >= self._view.seq:
            self._view = view
        return view

    def _observe_stats(self, stats: Mapping[str, Any]) -> None:
        seq = stats.get("seq")
        if isinstance(seq, int) and (self._view is None or seq >= self._view.seq):
            begin = int(stats.get("oldest_row_id", 0) or 0)
            self._view = View(seq, int(stats.get("generation", 0) or 0), begin, begin + int(stats.get("length", 0) or 0))

    # ------------------------------------------------------------------ figures

    def _reader_stats(self) -> dict[str, Any]:
        stats = dict(self._read(lambda rid: P.Info(rid)).stats)
        self._observe_stats(stats)
        return stats

    def info(self) -> dict[str, Any]:
        """The server's figures (clients, rows in and out, commits, ...), with the buffer's own
        (length, num_episodes, seq, ...) as this client's view of the file shows them. Over several
        servers: the shards' figures added up, each shard's under "shards"."""
        if self._router is not None:
            return self._router.info()
        writer = dict(self._conn.request(lambda rid: P.Info(rid)).stats)  # type: ignore[attr-defined]
        if self._reads is self._conn:
            self._observe_stats(writer)
            return writer
        return {**writer, **self._reader_stats()}

    def __len__(self) -> int:
        if self._router is not None:
            return len(self._router)
        return int(self._reader_stats()["length"])

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
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0:
            raise ConfigError(f"size must be an int >= 0, got {size!r}")
        wanted = int(size)
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout >= 0):
            raise ConfigError(f"timeout must be a number of seconds >= 0 or None, got {timeout!r}")
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        pause = 0.01
        while (held := len(self)) < wanted:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise NotEnoughDataError(f"{held} rows may be sampled after {timeout} s of waiting, fewer than the "
                                         f"{wanted} asked for")
            time.sleep(pause if left is None else min(pause, left))
            pause = min(pause * 2, 0.2)
        return held

    # ------------------------------------------------------------------ plumbing

    def _decode(self, arrays: Mapping[str, np.ndarray]) -> Any:
        return self.schema.decode(arrays)

    def _read(self, factory: Callable[[int], P.Request]) -> Any:
        if self._reads is None:
            raise ProtocolError("this learner has no read connection")
        return self._reads.request(factory)

    def _read_many(
        self, factories: Sequence[Callable[[int], P.Request]], conn: Connection | None = None, timeout: float | None = None,
    ) -> list[Any]:
        """Replies to several reads (on the read connection, or `conn`), keeping up to
        `max_in_flight` of them travelling at once."""
        conn = conn if conn is not None else self._reads
        if conn is None:
            raise ProtocolError("this learner has no read connection")
        window = self.config.max_in_flight
        replies: list[Any] = []
        pending: list[int] = []
        try:
            for factory in factories:
                if len(pending) >= window:
                    replies.append(conn.wait(pending.pop(0), timeout))
                pending.append(conn.send(factory))
            while pending:
                replies.append(conn.wait(pending.pop(0), timeout))
        except BaseException:
            for request_id in pending:
                conn.forget(request_id)
            raise
        for reply in replies:
            if isinstance(reply, P.ReadReply):
                self._observe(reply)
        return replies

    def _joined(self, parts: list[Mapping[str, np.ndarray]], names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """The leaves `names` (the rows' own by default) of several replies, one after another."""
        if len(parts) == 1:
            return dict(parts[0])
        return {name: np.concatenate([p[name] for p in parts]) for name in (names or self.schema.names)}

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
        if self._router is not None:
            return self._router.get(indices)
        idx = _integer_array(indices, "indices")
        per = self._ids_per_message
        first = self._read_many([_request(P.Get, self._min_seq, idx[:per])])[0]
        if idx.shape[0] <= per:
            return self._decode(first.arrays)
        # The rest by row id, resolved against the view the first part came from.
        view = View(first.seq, first.generation, first.begin, first.end)
        rest = idx[per:].copy()
        rest[rest < 0] += view.length
        bad = (rest < 0) | (rest >= view.length)
        if bad.any():
            raise IndexError(f"index {int(idx[per:][np.argmax(bad)])} is out of range for {view.length} rows")
        parts = [first.arrays, self._rows_by_id(rest + view.begin, view.seq)]
        return self._decode(self._joined(parts))

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
        if self._router is not None:
            return self._router.get_rows(row_ids)
        ids = _integer_array(row_ids, "row ids")
        if ids.size and int(ids.min()) < 0:
            raise IndexError(f"row id {int(ids.min())} is negative; row ids count from 0")
        return self._decode(self._rows_by_id(ids, self._min_seq))

    def _rows_by_id(self, ids: np.ndarray, min_seq: int) -> dict[str, np.ndarray]:
        parts = _chunks(ids.shape[0], self._ids_per_message) or [(0, 0)]
        min_seq = max(min_seq, self._min_seq)
        replies = self._read_many([_request(P.GetRows, min_seq, ids[lo:hi]) for lo, hi in parts])
        return self._joined([r.arrays for r in replies])

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
        if self._router is not None:
            return self._router.sample(batch_size, seed, with_info=with_info, table=table)
        size = _positive(batch_size, "batch_size")
        t = self._table(table)
        if t.consuming:
            return self._consume(("rows", *t.kind), size, lambda n: self._sample_requests(n, seed, t), with_info)
        return self._sampled(self._read_many(self._sample_requests(size, seed, t)), with_info)

    def _consume(self, kind: Any, size: int, requests: Callable[[int], list[Callable[[int], P.Request]]],
                 with_info: bool, schema: Schema | None = None) -> Any:
        """`size` rows (windows) of a draw that changes the server's state: those kept first,
        then `requests(rest)`; when one of those fails, everything drawn is kept, in order."""
        parts = self._kept.take(kind, size)
        have = sum(len(info) for _, info in parts)
        if have < size:
            drawn, error = self._draws.draw_all(requests(size - have))
            parts += drawn
            if error is not None:
                self._kept.give_back(kind, parts)
                raise kept_error(error, sum(len(info) for _, info in parts))
        schema = schema or self._kind_schema(kind)
        arrays, info = join_parts(parts, schema.names)
        batch = schema.decode(arrays)
        return (batch, info) if with_info else batch

    def _sample_many(self, factories: Sequence[Callable[[int], P.Request]], t: TableDraws) -> list[Any]:
        """Sample requests go to whoever draws them: readers, or the writer when samples change the
        buffer (then each may wait up to `rate_limit_timeout` for the rate limit)."""
        if t.samples is self._reads:
            return self._read_many(factories)
        return self._read_many(factories, t.samples, self.config.timeout + self.config.rate_limit_timeout)

    def _sample_requests(self, size: int, seed: int | None, t: TableDraws) -> list[Callable[[int], P.Request]]:
        """The Sample requests of one batch: one per message's worth of rows."""
        limit = self.config.rate_limit_timeout
        return [_request(P.Sample, hi - lo, _seed(seed, k), self._min_seq, limit, t.asked)
                for k, (lo, hi) in enumerate(_chunks(size, t.rows_per_sample))]

    def _sampled(self, replies: list[Any], with_info: bool) -> Any:
        """The batch the replies of one sample carry (and its SampleInfo when asked)."""
        batch = self._decode(self._joined([r.arrays for r in replies]))
        return (batch, sample_info(replies)) if with_info else batch

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
        size = _positive(batch_size, "batch_size")
        steps = None if sequence_length is None else _positive(sequence_length, "sequence_length")
        ahead = _positive(prefetch, "prefetch")

        def one_batch(k: int) -> Any:
            if steps is None:
                return self.sample(size, _seed(seed, k), with_info=with_info, table=table)
            return self.sample_sequences(size, steps, _seed(seed, k), with_info=with_info, table=table)

        if self._router is not None:
            self._router.check_table(table)
            return (one_batch(k) for k in itertools.count())  # shards fan out
        t = self._table(table)
        if steps is not None and t.rows_per_sample < steps:
            return (one_batch(k) for k in itertools.count())  # huge windows are read by id

        group = 1 if seed is not None else self._batches_per_request(size * (steps or 1), ahead, t)

        def requests(batch_seed: int | None) -> list[Callable[[int], P.Request]]:
            if steps is None:
                return self._sample_requests(size * group, batch_seed, t)
            return self._window_requests(size * group, steps, batch_seed, t) or []

        parts = len(requests(None))
        kind = (("rows",) if steps is None else ("windows", steps)) + t.kind
        pipelined = self._pipelined(lambda k: requests(_seed(seed, k * parts)), -(-ahead // group), with_info, t,
                                    group, kind)
        if not t.consuming:
            return pipelined
        return self._kept_first(kind, one_batch, pipelined)

    def _kept_first(self, kind: Any, one_batch: Callable[[int], Any], then: Iterator[Any]) -> Iterator[Any]:
        """Batches of the rows kept from a failed call first (each topped up by a fresh draw), then `then`."""
        k = 0
        while self._kept.count(kind):
            yield one_batch(k)
            k += 1
        yield from then

    def _batches_per_request(self, rows: int, ahead: int, t: TableDraws) -> int:
        """How many batches of `rows` rows one request of `batches` may carry: 1 when the writer
        draws (a rate limit counts, or rows are removed, as each batch is asked for), else up to
        half of `ahead` (two requests or more stay in flight), within one message and 1 MiB."""
        if t.samples is not self._reads:
            return 1
        fit = min(self.rows_per_message // rows, _REQUEST_BYTES // max(1, rows * int(self.schema.row_bytes)))
        return int(max(1, min(ahead // 2, fit)))

    def _pipelined(
        self, group_requests: Callable[[int], list[Callable[[int], P.Request]]], ahead: int, with_info: bool,
        t: TableDraws, group: int = 1, kind: Any = ("rows",),
    ) -> Iterator[Any]:
        """The batches the replies to `group_requests(k)` carry, `group` batches each, with
        `ahead` groups' requests in flight. From a server whose draws change its state, no reply
        is given up on: when one fails, or the loop is left, the requests still in flight are
        cancelled where they wait for the rate limit, and what was drawn is kept (`num_kept`)."""
        conn = t.samples
        timeout = None if conn is self._reads else self.config.timeout + self.config.rate_limit_timeout
        in_flight: collections.deque[list[int]] = collections.deque()
        try:
            for k in itertools.count():
                while len(in_flight) < ahead:
                    in_flight.append([conn.send(request) for request in group_requests(k + len(in_flight))])
                if t.consuming:
                    parts, error = self._draws.collect(in_flight.popleft(), cancel=False,
                                                 timeout=typing.cast(float, timeout))
                    if error is not None:
                        self._kept.give_back(kind, parts)
                        raise kept_error(error, self._kept.count(kind))
                    arrays, info = join_parts(parts, self.schema.names)
                    batch = self._decode(arrays)
                    yield (batch, info) if with_info else batch
                    continue
                replies = [conn.wait(request_id, timeout) for request_id in in_flight.popleft()]
                for reply in replies:
                    if isinstance(reply, P.ReadReply):
                        self._observe(reply)
                yield from self._split(replies, group, with_info)
        finally:
            if t.consuming and in_flight and not conn.closed:
                parts, _ = self._draws.collect([rid for ids in in_flight for rid in ids], cancel=True,
                                         timeout=typing.cast(float, timeout))
                self._kept.put(kind, parts)
            else:
                for request_ids in in_flight:
                    for request_id in request_ids:
                        conn.forget(request_id)

    def _split(self, replies: list[Any], group: int, with_info: bool) -> Iterator[Any]:
        """The `group` batches of equal size that the replies of one request carry, in order."""
        arrays = self._joined([r.arrays for r in replies])
        info = sample_info(replies) if with_info else None
        size = next(iter(arrays.values())).shape[0] // group
        for lo in range(0, size * group, size):
            batch = self._decode({name: a[lo : lo + size] for name, a in arrays.items()})
            yield (batch, info.slice(lo, lo + size)) if info is not None else batch

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
        if self._router is not None:
            return self._router.update_priorities(row_ids, priorities, table=table)
        ids = _integer_array(row_ids, "row ids")
        t = self._table(table)
        if t.keeps_priorities is False:
            raise ConfigError(f"table {t.name!r} samples by {self._table_figure(t, 'sampler')}, not by priority: only "
                              "a Prioritized sampler keeps priorities")
        values = check_priorities(priorities, ids.shape[0], sampler=t.sampler)
        if ids.size and int(ids.min()) < 0:
            raise IndexError(f"row id {int(ids.min())} is negative; row ids count from 0")
        updates = self._updates
        if not wait:
            with updates.lock:
                updates.send(ids, values, self._view.end if self._view is not None else 0, t.asked)
            return None
        replies = self._read_many(updates.requests(ids, values, t.asked), self._conn, updates.timeout)
        updates.seen_seq = max(updates.seen_seq, *(int(r.seq) for r in replies))
        return sum(int(r.ignored) for r in replies)

    def flush_priorities(self) -> None:
        """Send the priority updates made with wait=False that are still held here, and wait for
        the replies of all of them. The server's refusal of one (ConfigError, IndexError) is
        raised after the others were read; when the server does not answer
        (ServerUnavailableError) the rest are given up."""
        self._updates.flush()

    def episodes(self) -> list[Episode]:
        """Every complete episode held, oldest first: Episode(episode_id, first_row_id, length).
        Over several servers, shard by shard, with packed ids (`h5replay.records.pack_ids`)."""
        if self._router is not None:
            return self._router.episodes()
        table, _ = self._episode_table()
        return [Episode(*row) for row in table.tolist()]

    def _episode_table(self) -> tuple[np.ndarray, View]:
        """(every complete episode as (episode_id, first_row_id, length) rows, the view of the
        last page): read in pages of what fits a message, each page from the episode after the
        last one the previous page gave. Episodes the ring dropped before the last page came
        are left out, so the list is the episodes that last view holds."""
        per = max(1, min(self.limits.max_rows_per_message,
                         (self.limits.max_message_bytes - P.ROWS_MESSAGE_OVERHEAD) // (3 * P.ID_BYTES)))
        pages: list[np.ndarray] = []
        first = 0
        while True:
            reply = self._read_many([_request(P.Episodes, self._min_seq, first, per)])[0]
            pages.append(reply.episodes)
            if len(reply.episodes) < per:
                break
            first = int(reply.episodes[-1, 0]) + 1
        view = View(reply.seq, reply.generation, reply.begin, reply.end)
        table = np.concatenate(pages) if len(pages) > 1 else pages[0]
        if len(pages) > 1:
            table = table[table[:, 1] >= view.begin]
        return table, view

    def get_segments(self) -> list[tuple[int, int]]:
        """(logical start, length) of every complete episode held, oldest first (one server only)."""
        if self._router is not None:
            return self._router.get_segments()
        table, view = self._episode_table()
        return [(first - view.begin, n) for _, first, n in table.tolist()]

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Close both sockets (after reading the replies of priority updates sent with
        wait=False; a refusal among them is logged). Rows still kept (`num_kept`) are dropped,
        with a warning. Safe to call twice."""
        if self._router is not None:
            self._router.close()
            return
        if self._kept.count():
            log.warning("closing a learner that still keeps %d rows (or windows) drawn for it that no call returned: "
                        "they are gone (call sample() until num_kept is 0 first)", self._kept.count())
            self._kept.take_all()
        if self._updates.pending and not self._conn.closed:
            try:
                self.flush_priorities()
            except Exception as exc:  # closing must not raise; the caller gave up on their replies
                log.warning("a priority update sent with wait=False failed: %s", exc)
        if self._reads is not None and self._reads is not self._conn:
            self._reads.close()
        self._conn.close()

    def __enter__(self) -> LearnerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
