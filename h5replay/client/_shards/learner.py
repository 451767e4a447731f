"""ShardedLearner: reads from every live shard, samples them in proportion to their rows.

See the package's docstring (h5replay.client._shards) for the behaviour. Every verb is a routing
plan of `LearnerRouting` (it yields `Fan`: one call per shard, all at once); `ShardedLearner`
runs them with one thread per shard, h5replay.client.aio's asyncio router with one task per shard.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from h5replay.client._kept import Kept, Part, join_parts, kept_error
from h5replay.client._reads import View, _positive
from h5replay.client._shards._merge import (
    add_up_info,
    merge_draws,
    packed_episodes,
    qualified,
    scatter,
    shares,
    shortfall,
    without_mask,
)
from h5replay.client._shards._router import Fan, RoutePlan, _outcome, _Router, _Shard, log
from h5replay.config import ClientConfig
from h5replay.errors import ClosedError, ConfigError, EvictedError, NotEnoughDataError, ServerUnavailableError
from h5replay.priorities import check_priorities
from h5replay.records import Episode, SampleInfo
from h5replay.spaces import Space, flatten_value, unflatten_value
from h5replay.transitions import TransitionKeys, check_n_step
from h5replay.windows import check_pad_space, masked

__all__ = ["LearnerRouting", "ShardedLearner", "ShardLearner"]

T = TypeVar("T")


class ShardLearner(Protocol):
    """What the router needs of one shard's single-server client (a LearnerClient or an
    AsyncLearnerClient), by name; the rest it reaches through the shards' clients, untyped."""

    @property
    def view(self) -> View | None: ...


_L = TypeVar("_L", bound=ShardLearner)

#: A shard's draw call: (its client, rows to draw, seed) -> (batch, info), or an awaitable of it.
DrawCall = Callable[[Any, int, "int | None"], Any]


def _info(client: Any) -> Any:
    return client.info()


def _episodes(client: Any) -> Any:
    return client.episodes()


class LearnerRouting(_Router[_L]):
    """The routing of a learner over several servers, as plans (`RoutePlan`) a driver runs: the
    blocking `ShardedLearner` and the asyncio `AsyncShardedLearner`. Only `_size` (a shard's row
    count: `len(client)` or `client.size()`) and the running of plans differ between them.

    Args:
        endpoints: every shard's endpoint, in the same order for every client.
        config: the client's settings (its `endpoint` is ignored).
        secret_key, server_key: CURVE certificate files, the same for every shard.
        client_class: the single-server client of one shard.
    """

    role = "learner"

    def __init__(
        self, endpoints: Sequence[str], config: ClientConfig, secret_key: Any = None, server_key: Any = None, *,
        client_class: Callable[..., _L],
    ) -> None:
        super().__init__(endpoints, config, secret_key, server_key, client_class=client_class)
        self._lengths = np.full(len(self.shards), -1, dtype=np.int64)  # rows held as last seen; -1: unknown
        self._views: dict[int, View] = {}  # kept while a shard is down: its view never goes back
        #: Calls that skipped each shard because it was down.
        self.num_skipped = [0] * len(self.shards)
        self._rng = np.random.default_rng()  # splits batches when the caller gives no seed
        # Rows draws that change a shard's state handed out that no call returned yet (flat leaves,
        # qualified info), as a single server's learner keeps them (see client/_kept.py).
        self._kept = Kept()
        self._table_kinds: dict[str | None, tuple[str, ...]] = {}  # see _table_kind
        self.limits: Any = None
        self.codec_space: Space | None = None
        #: The shards' observation keys and reward / end-flag leaves (None: they keep no finals).
        self.transition_keys: TransitionKeys | None = None

    def _connected(self) -> None:
        """After the first hellos: what every shard's client shares."""
        first = next(s.client for s in self.shards if s.client is not None)
        self.limits = first.limits
        self.codec_space = first.space
        self.transition_keys = first.transition_keys

    def _size(self, client: Any) -> Any:
        """A shard's rows as a reader sees them (or an awaitable of them)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ shards coming and going

    def _retire(self, shard: _Shard) -> None:
        view = shard.client.view
        if view is not None:
            self._views[shard.index] = view
        self._lengths[shard.index] = -1
        for kind, parts in shard.client._take_kept().items():  # rows it drew must outlive its client
            self._kept.put(kind, [self._qualified_part(shard.index, batch, info, 1.0, self._kind_space(kind))
                                  for batch, info in parts])

    def _adopted(self, shard: _Shard) -> None:
        view = self._views.pop(shard.index, None)
        if view is not None and shard.client.view is None:
            # The restarted server publishes states newer than any this client saw: min_seq stays valid.
            shard.client._view = view

    @property
    def num_kept(self) -> int:
        """Rows (windows) kept from calls that failed part-way, here and in every shard's client."""
        return self._kept.count() + sum(int(s.client.num_kept) for s in self.shards if s.client is not None)

    def _qualified_part(self, index: int, batch: Any, info: SampleInfo, weight: float, space: Space) -> Part:
        """A shard's draw (of `space`) as a part of this learner's: flat leaves, ids qualified by
        `index`, the probabilities of the whole draw (the shard's own times its share `weight`)."""
        shards = np.full(len(info), index, np.int64)
        return flatten_value(space, batch), dataclasses.replace(info, probabilities=info.probabilities * weight,
                                                                shard_ids=shards)

    def _rows_space(self) -> Space:
        if self.space is None:
            raise ClosedError("this learner never connected")
        return self.space

    def _kind_space(self, kind: tuple[Any, ...]) -> Space:
        """The space of what a draw of `kind` returns: a transition, or the rows' own."""
        if kind[0] == "transitions" and self.transition_keys is not None:
            return self.transition_keys.transition_space(self._rows_space())
        return self._rows_space()

    def _table_kind(self, table: str | None) -> tuple[str, ...]:
        """The part of a draw's kind that names `table`, as the shards' clients name it (so what a
        retired shard's client kept is found again; the last one seen when no shard is up)."""
        kind = next((s.client._table(table).kind for s in self.shards if s.client is not None), None)
        if kind is not None:
            self._table_kinds[table] = kind
        return self._table_kinds.get(table, (table,) if table else ())

    @property
    def capacity(self) -> int | None:
        """Rows all shards hold together when full (None when one grows without limit); of the
        shards that answered so far."""
        capacities = [s.client.capacity for s in self.shards if s.client is not None]
        return None if any(c is None for c in capacities) else int(sum(capacities))

    @property
    def views(self) -> tuple[View | None, ...]:
        """The newest published state each shard's replies came from (None before any read)."""
        return tuple(s.client.view if s.client is not None else self._views.get(s.index) for s in self.shards)

    @property
    def live_shards(self) -> list[int]:
        """The shards in use now (a down shard comes back once its background probe answers)."""
        return [s.index for s in self.shards if s.client is not None]

    def shard(self, index: int) -> _L:
        """The single-server client of shard `index` (its own logical indices, ids and view).

        Raises:
            ServerUnavailableError: that shard is down.
        """
        self._check()
        client = self.shards[index].client
        if client is None:
            raise ServerUnavailableError(f"shard {index} ({self.endpoints[index]}) is unavailable")
        return client  # type: ignore[no-any-return]

    def check_table(self, table: str | None) -> None:
        """Raises ConfigError when a live shard has no such table (or several and none is named):
        all shards must declare the same tables."""
        for shard in self.shards:
            if shard.client is not None:
                shard.client._table(table)

    # ------------------------------------------------------------------ fan-out

    def _live(self) -> list[int]:
        self._check()
        self._poll_probes()
        live = []
        for shard in self.shards:
            if shard.client is None:
                self.num_skipped[shard.index] += 1
            else:
                live.append(shard.index)
        if not live:
            raise ServerUnavailableError(
                f"all {len(self.shards)} shards are unavailable (each is tried again every "
                f"{self.config.shard_retry_interval} s): {', '.join(self.endpoints)}"
            )
        return live

    def _outcomes(self, calls: Mapping[int, Callable[[Any], Any]]) -> RoutePlan[dict[int, Any]]:
        """{shard: result or the exception it raised} of one call per shard, all sent at once; a
        shard that does not answer is marked down."""
        if not calls:
            return {}
        return (yield Fan(calls))

    def _fan(self, calls: Mapping[int, Callable[[Any], Any]]) -> RoutePlan[dict[int, Any]]:
        """{shard: result} of one call per shard, all sent at once. A shard that does not answer is
        left out; any other error is raised (after every call has returned)."""
        outcomes = yield from self._outcomes(calls)
        for outcome in outcomes.values():
            if isinstance(outcome, BaseException) and not isinstance(outcome, ServerUnavailableError):
                raise outcome
        return {index: o for index, o in outcomes.items() if not isinstance(o, BaseException)}

    def _gather(self, call: Callable[[Any], Any]) -> RoutePlan[dict[int, Any]]:
        """`call` on every live shard; raises ServerUnavailableError when none answered."""
        results = yield from self._fan({i: call for i in self._live()})
        if not results:
            raise ServerUnavailableError(f"no shard of {len(self.shards)} answered within {self.config.timeout} s")
        return results

    def _drawable(self, indices: Sequence[int], table: str | None = None) -> RoutePlan[dict[int, int]]:
        """Rows each shard's `table` may still hand out: its length, less what its
        `max_times_sampled` removed (the writer counts those: its figures give them). Without a
        table on a shard of several: its length. Shards that did not answer are left out."""
        counted: dict[int, str] = {}  # shards whose figures must say it: the figure's name
        for index in indices:
            try:
                draws = self.shards[index].client._table(table)
            except ConfigError:
                continue
            if draws.removes:
                counted[index] = draws.name
        results = yield from self._fan({i: _info if i in counted else self._size for i in indices})
        out = {}
        for index, result in results.items():
            if index in counted:
                out[index] = int(result.get(f"table.{counted[index]}.sampleable", result.get("sampleable", 0)) or 0)
            else:
                out[index] = int(result)
        return out

    # ------------------------------------------------------------------ figures

    def length_plan(self) -> RoutePlan[int]:
        """Rows that may be sampled on every live shard: rows held, less those a shard's
        `max_times_sampled` removed (shards have no common logical index to keep them for)."""
        results = yield from self._drawable(self._live())
        if not results:
            raise ServerUnavailableError(f"no shard of {len(self.shards)} answered within {self.config.timeout} s")
        for index, length in results.items():
            self._lengths[index] = length
        return int(sum(results.values()))

    def info_plan(self) -> RoutePlan[dict[str, Any]]:
        """The shards' figures added up (see `_merge.add_up_info`)."""
        results = yield from self._gather(_info)
        for index, stats in results.items():
            self._lengths[index] = int(stats.get("length", 0))
        return add_up_info(results, len(self.shards), self.num_skipped)

    def episodes_plan(self) -> RoutePlan[list[Episode]]:
        """Every complete episode held on every live shard (shard by shard, oldest first), with
        packed ids: Episode(pack_ids(shard, episode_id), pack_ids(shard, first_row_id), length)."""
        return packed_episodes((yield from self._gather(_episodes)))

    # ------------------------------------------------------------------ reads

    def get_rows_plan(self, row_ids: Any) -> RoutePlan[Any]:
        """Rows by qualified id, any order, duplicates kept; returned flat (n, ...).

        Args:
            row_ids: packed ids (`pack_ids(shard, row_id)`, `SampleInfo.packed_row_ids`, the ids of
                `episodes()`), or an (n, 2) array of (shard, row_id) pairs.

        Raises:
            ServerUnavailableError: a shard named does not answer.
            EvictedError: an id is no longer held (the message names the shard and the id).
            IndexError: an id was never committed, or names a shard this learner does not have.
            TypeError: the ids are not integers.
        """
        masks, local = self._by_shard(row_ids)
        outcomes = yield from self._outcomes({index: _reader(local[mask]) for index, mask in masks.items()})
        for index, outcome in outcomes.items():
            if isinstance(outcome, EvictedError):
                raise EvictedError(f"shard {index}: {outcome}") from outcome
            if isinstance(outcome, BaseException) and not isinstance(outcome, ServerUnavailableError):
                raise outcome
        missing = sorted(i for i, o in outcomes.items() if isinstance(o, BaseException))
        if missing:
            raise ServerUnavailableError(f"shard(s) {missing} did not answer within {self.config.timeout} s")
        space = self._rows_space()
        parts = {index: flatten_value(space, batch) for index, batch in outcomes.items()}
        return unflatten_value(space, scatter(parts, masks, local.shape[0]))

    def update_priorities_plan(self, row_ids: Any, priorities: Any, table: str | None = None) -> RoutePlan[int]:
        """Set priorities by qualified id (as `get_rows` takes them) in `table` (None: the
        shards' only table), one call per shard, all at once. Returns how many ids the shards
        ignored (no longer held).

        Raises:
            ServerUnavailableError: a shard named does not answer (the others may have taken theirs).
            ConfigError: a priority is negative, NaN or infinite, or the counts differ.
        """
        masks, local = self._by_shard(row_ids)
        values = check_priorities(priorities, local.shape[0])
        calls = {index: _prioritizer(local[mask], values[mask], table) for index, mask in masks.items()}
        results = yield from self._fan(calls)
        missing = sorted(set(calls) - set(results))
        if missing:
            raise ServerUnavailableError(f"shard(s) {missing} did not answer within {self.config.timeout} s; "
                                         "the other shards took their priorities")
        return int(sum(results.values()))

    def _by_shard(self, row_ids: Any) -> tuple[dict[int, np.ndarray], np.ndarray]:
        """({shard: mask of its ids}, local ids) of qualified ids, every shard named being live.
        What a call naming rows sends to each shard (get_rows, update_priorities: one call per
        shard, all at once).

        Raises:
            ServerUnavailableError: a shard named is down.
        """
        shards, local = qualified(row_ids, len(self.shards))
        self._live()
        wanted = np.unique(shards).tolist() if shards.size else [0]
        for index in wanted:
            if self.shards[index].client is None:
                raise ServerUnavailableError(f"shard {index} ({self.endpoints[index]}) is unavailable; its rows "
                                             "cannot be read until it answers again")
        return {index: shards == index for index in wanted}, local

    def get(self, indices: Any) -> Any:
        raise NotImplementedError(
            "get() reads logical positions of one buffer, and shards have no common order of rows: read by "
            "qualified id with get_rows() (packed ids or (shard, row_id) pairs, e.g. from episodes() or "
            "SampleInfo.packed_row_ids), or use learner.shard(i).get(...) on one shard"
        )

    def get_segments(self) -> list[tuple[int, int]]:
        raise NotImplementedError(
            "get_segments() gives logical positions of one buffer, and shards have no common order of rows: "
            "use episodes() (packed ids), or learner.shard(i).get_segments() on one shard"
        )

    # ------------------------------------------------------------------ draws

    def sample_plan(self, batch_size: int, seed: int | None = None, *, with_info: bool = False,
                    table: str | None = None) -> RoutePlan[Any]:
        """`batch_size` rows drawn uniformly with replacement from all rows of all live shards:
        each batch position picks a shard with probability (its rows) / (all rows), as last seen,
        and every shard draws its share in one request, all at once, from `table` (None: the
        shards' only one). `SampleInfo.probabilities` is the chance of each row in that draw;
        `shard_ids` says where each came from."""
        size = _positive(batch_size, "batch_size")
        return (yield from self._draw(size, seed, with_info,
                                      lambda c, n, s: c.sample(n, s, with_info=True, table=table),
                                      "rows", ("rows",), table))

    def sample_sequences_plan(self, batch_size: int, length: int, seed: int | None = None, *,
                              with_info: bool = False, table: str | None = None, pad: bool = False) -> RoutePlan[Any]:
        """`batch_size` windows of `length` steps, each within one episode of one shard; shards are
        picked in proportion to their rows, as for `sample`. A shard holding no episode that long is
        left out of the draw. `pad`: as a single server's."""
        size, steps = _positive(batch_size, "batch_size"), _positive(length, "length")
        if not pad:
            return (yield from self._draw(size, seed, with_info,
                                          lambda c, n, s: c.sample_sequences(n, steps, s, with_info=True, table=table),
                                          f"windows of {steps} steps", ("windows", steps), table))
        if self.space is not None:
            check_pad_space(self.space)
        batch, info = yield from self._draw(
            size, seed, True, lambda c, n, s: c.sample_sequences(n, steps, s, with_info=True, table=table, pad=True),
            f"windows of {steps} steps", ("padded windows", steps), table, post=without_mask)
        batch = masked(batch, info.valid_steps, steps)
        return (batch, info) if with_info else batch

    def sample_transitions_plan(self, batch_size: int, *, n_step: int = 1, gamma: float = 0.99,
                                with_info: bool = False, seed: int | None = None,
                                table: str | None = None) -> RoutePlan[Any]:
        """`batch_size` n-step transitions, each within one episode of one shard; shards are
        picked in proportion to their rows, as for `sample`."""
        size = _positive(batch_size, "batch_size")
        n, discount_rate = check_n_step(n_step, gamma)
        keys = self.transition_keys
        if keys is None or self.space is None:
            raise ConfigError("these servers keep no final observations: serve files created with "
                              "--observation-keys (observation_keys=) to draw transitions")
        return (yield from self._draw(
            size, seed, with_info,
            lambda c, m, s: c.sample_transitions(m, n_step=n, gamma=discount_rate, with_info=True, seed=s, table=table),
            "transitions", ("transitions", n, discount_rate), table, keys.transition_space(self.space)))

    def _draw(self, size: int, seed: int | None, with_info: bool, call: DrawCall, what: str, kind: Any,
              table: str | None = None, space: Space | None = None,
              post: Callable[[Any], Any] | None = None) -> RoutePlan[Any]:
        """`size` of `what` drawn by `call` from the live shards in proportion to their rows
        (`post`: applied to each shard's draw before the merge)."""
        rng = self._rng if seed is None else np.random.default_rng(seed)
        empty: set[int] = set()  # shards that had nothing to draw in this call
        self.check_table(table)
        kind = (*kind, *self._table_kind(table))
        space = space or self._kind_space(kind)
        consuming = any(s.client is not None and s.client._table(table).consuming for s in self.shards)
        if self._kept.count(kind) or consuming:
            return (yield from self._draw_consuming(size, rng, seed, with_info, call, what, kind, table, space, post))
        for _ in range(2 * len(self.shards) + 2):  # each retry leaves a shard out, or learns its length
            live = [i for i in self._live() if i not in empty]
            unknown = [i for i in live if self._lengths[i] < 0]
            if unknown:
                for index, n in (yield from self._fan({i: self._size for i in unknown})).items():
                    self._lengths[index] = n
                continue
            lengths = self._lengths[live].astype(np.float64)
            if not live or lengths.sum() == 0:
                yield from self.length_plan()  # the lengths may be stale: look once more
                live = [i for i in live if self.shards[i].client is not None and self._lengths[i] > 0]
                if not live:
                    raise NotEnoughDataError(f"cannot sample {what}: no live shard has any "
                                             f"({len(self.shards)} shards, {len(empty)} without enough)")
                lengths = self._lengths[live].astype(np.float64)
            weights = lengths / lengths.sum()
            assign = rng.choice(len(live), size=size, p=weights)
            counts = np.bincount(assign, minlength=len(live))
            calls: dict[int, Callable[[Any], Any]] = {}
            for k, index in enumerate(live):
                part_seed = None if seed is None else int(rng.integers(2**62))
                calls[index] = _share(call, int(counts[k]), part_seed) if counts[k] else self._size
            drawing = {index for k, index in enumerate(live) if counts[k]}
            outcomes = yield from self._outcomes(calls)
            drawn: dict[int, Any] = {}
            for index, outcome in outcomes.items():
                if isinstance(outcome, NotEnoughDataError) and index in drawing:
                    empty.add(index)  # it was cleared, or holds no window that long
                    self._lengths[index] = -1
                elif isinstance(outcome, BaseException):
                    if not isinstance(outcome, ServerUnavailableError):
                        raise outcome
                elif index not in drawing:
                    self._lengths[index] = outcome
                else:
                    drawn[index] = outcome if post is None else post(outcome)
                    view = self.shards[index].client.view if self.shards[index].client is not None else None
                    if view is not None:
                        self._lengths[index] = view.length
            if drawing - set(drawn):
                continue  # a shard went down or had nothing: draw again among the others
            return merge_draws(space, live, assign, weights, drawn, with_info)
        raise NotEnoughDataError(f"cannot sample {what}: the shards kept going down or emptying during the call")

    def _draw_consuming(self, size: int, rng: np.random.Generator, seed: int | None, with_info: bool,
                        call: DrawCall, what: str, kind: Any, table: str | None, space: Space,
                        post: Callable[[Any], Any] | None) -> RoutePlan[Any]:
        """A draw over shards whose draws change their state (queues, rate limits): what one
        shard could not give is asked of the others, and nothing drawn is ever dropped. When the
        batch cannot be filled, the rows drawn are kept for the next call (first in it) and the
        reason is raised: NotEnoughDataError (no shard has more), RateLimitedError (their
        limits held the rest back), ServerUnavailableError (no shard answered)."""
        parts = self._kept.take(kind, size)
        have = sum(len(info) for _, info in parts)
        failed: dict[int, BaseException] = {}  # shards that could not give their share in this call
        try:
            live = self._live()
            for index in live:  # rows kept from a cancelled call came with an older view: measure again
                if self.shards[index].client._num_kept(kind):
                    self._lengths[index] = -1
            for _ in range(2 * len(self.shards) + 2):  # each round fills the batch or leaves a shard out
                live = [i for i in live if i not in failed and self.shards[i].client is not None]
                if have >= size or not live:
                    break
                unknown = [i for i in live if self._lengths[i] < 0]
                if unknown:
                    for index, n in (yield from self._drawable(unknown, table)).items():
                        self._lengths[index] = n
                    continue
                # What a shard can give: the rows it may still hand out, and those its client keeps
                # from a call that failed part-way or was cancelled (returned first there).
                held = {i: int(self._lengths[i]) + self.shards[i].client._num_kept(kind) for i in live}
                with_rows = [i for i in live if held[i] > 0] or live  # none seen: ask them all
                lengths = np.array([held[i] for i in with_rows], np.float64)
                weights = lengths / lengths.sum() if lengths.sum() > 0 else np.full(len(with_rows), 1.0 / len(with_rows))
                counts = shares(size - have, lengths.astype(np.int64), weights, rng)
                calls = {index: _share(call, int(counts[k]), None if seed is None else int(rng.integers(2**62)))
                         for k, index in enumerate(with_rows) if counts[k]}
                kept_before = {i: self.shards[i].client._num_kept(kind) for i in calls}
                for index, outcome in (yield from self._outcomes(calls)).items():
                    if isinstance(outcome, BaseException):
                        failed[index] = outcome
                        self._lengths[index] = -1
                        continue
                    batch, info = outcome if post is None else post(outcome)
                    parts.append(self._qualified_part(index, batch, info, float(weights[with_rows.index(index)]), space))
                    have += len(info)
                    client = self.shards[index].client
                    view = client.view if client is not None else None
                    if view is not None:  # rows left to draw there, as far as this draw tells
                        fresh = len(info) - (kept_before[index] - client._num_kept(kind))  # not from the kept
                        removes = client._table(table).removes
                        self._lengths[index] = max(0, view.length - (fresh if removes else 0))
        except BaseException:
            self._kept.give_back(kind, parts)
            raise
        if have < size:
            self._kept.give_back(kind, parts)
            raise kept_error(shortfall(failed, what, len(self.shards)), have)
        arrays, info = join_parts(parts, list(parts[0][0]))
        batch = unflatten_value(space, arrays)
        return (batch, info) if with_info else batch

    def close(self) -> None:
        """Close every shard's client (rows still kept, `num_kept`, are dropped with a warning).
        Safe to call twice."""
        with self._lock:
            if self._kept.count():
                log.warning("closing a learner that still keeps %d rows (or windows) drawn for it that no call "
                            "returned: they are gone (call sample() until num_kept is 0 first)", self._kept.count())
                self._kept.take_all()
            super().close()


class ShardedLearner(LearnerRouting[_L]):
    """The routing of `LearnerClient(endpoints=[...])`: reads from every live shard, one thread per
    shard, calls serialised by a lock.

    Raises:
        ConfigError: the shards hold different spaces, or two endpoints reach the same file.
        ServerUnavailableError: no shard answered within the timeout.
    """

    def __init__(
        self, endpoints: Sequence[str], config: ClientConfig, secret_key: Any = None, server_key: Any = None, *,
        client_class: Callable[..., _L],
    ) -> None:
        super().__init__(endpoints, config, secret_key, server_key, client_class=client_class)
        self._pool = cf.ThreadPoolExecutor(max_workers=len(self.shards), thread_name_prefix="h5replay-shard")
        try:
            self._connect_initial()
        except BaseException:
            self.close()
            raise
        self._connected()

    def _size(self, client: Any) -> int:
        return len(client)

    def _run(self, plan: RoutePlan[T]) -> T:
        """The plan's result, each Fan's calls run at once (the last in this thread)."""
        with self._lock:
            outcomes: dict[int, Any] | None = None
            while True:
                try:
                    op = plan.send(outcomes)  # type: ignore[arg-type]
                except StopIteration as stop:
                    return stop.value  # type: ignore[no-any-return]
                outcomes = self._noted(self._fan_out(op.calls))

    def _fan_out(self, calls: Mapping[int, Callable[[Any], Any]]) -> dict[int, Any]:
        *others, (last, last_call) = calls.items()
        futures: dict[int, Any] = {i: self._pool.submit(call, self.shards[i].client) for i, call in others}
        futures[last] = _run_inline(last_call, self.shards[last].client)
        return {index: _outcome(future) for index, future in futures.items()}

    def __len__(self) -> int:
        return self._run(self.length_plan())

    def info(self) -> dict[str, Any]:
        return self._run(self.info_plan())

    def episodes(self) -> list[Episode]:
        return self._run(self.episodes_plan())

    def get_rows(self, row_ids: Any) -> Any:
        return self._run(self.get_rows_plan(row_ids))

    def update_priorities(self, row_ids: Any, priorities: Any, *, table: str | None = None) -> int:
        return self._run(self.update_priorities_plan(row_ids, priorities, table))

    def sample(self, batch_size: int, seed: int | None = None, *, with_info: bool = False,
               table: str | None = None) -> Any:
        return self._run(self.sample_plan(batch_size, seed, with_info=with_info, table=table))

    def sample_sequences(self, batch_size: int, length: int, seed: int | None = None, *, with_info: bool = False,
                         table: str | None = None, pad: bool = False) -> Any:
        return self._run(self.sample_sequences_plan(batch_size, length, seed, with_info=with_info, table=table,
                                                    pad=pad))

    def sample_transitions(self, batch_size: int, *, n_step: int = 1, gamma: float = 0.99, with_info: bool = False,
                           seed: int | None = None, table: str | None = None) -> Any:
        return self._run(self.sample_transitions_plan(batch_size, n_step=n_step, gamma=gamma, with_info=with_info,
                                                      seed=seed, table=table))

    def close(self) -> None:
        """Close every shard's client (rows still kept, `num_kept`, are dropped with a warning).
        Safe to call twice."""
        super().close()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _run_inline(call: Callable[[Any], Any], client: Any) -> cf.Future[Any]:
    future: cf.Future[Any] = cf.Future()
    try:
        future.set_result(call(client))
    except BaseException as exc:  # noqa: B036 (handed back through the future, as a pool would)
        future.set_exception(exc)
    return future


def _share(call: DrawCall, count: int, seed: int | None) -> Callable[[Any], Any]:
    return lambda client: call(client, count, seed)


def _prioritizer(ids: np.ndarray, values: np.ndarray, table: str | None) -> Callable[[Any], Any]:
    return lambda client: client.update_priorities(ids, values, table=table)


def _reader(ids: np.ndarray) -> Callable[[Any], Any]:
    return lambda client: client.get_rows(ids)
