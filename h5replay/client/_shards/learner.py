"""ShardedLearner: reads from every live shard, samples them in proportion to their rows.

See the package's docstring (h5replay.client._shards) for the behaviour.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from h5replay.client._kept import Kept, Part, join_parts, kept_error
from h5replay.client._reads import View
from h5replay.client._shards._router import _outcome, _Router, _Shard, log
from h5replay.config import ClientConfig
from h5replay.errors import (
    ClosedError,
    ConfigError,
    EvictedError,
    NotEnoughDataError,
    RateLimitedError,
    ServerUnavailableError,
)
from h5replay.priorities import check_priorities
from h5replay.records import Episode, SampleInfo, pack_ids, unpack_ids
from h5replay.spaces import Space, flatten_value, unflatten_value
from h5replay.transitions import TransitionKeys, check_n_step
from h5replay.windows import check_pad_space, masked, unmasked

__all__ = ["ShardedLearner", "ShardLearner"]


class ShardLearner(Protocol):
    """What the router needs of one shard's single-server client (a LearnerClient), by name; the
    rest it reaches through the shards' clients, untyped."""

    def __len__(self) -> int: ...

    def info(self) -> dict[str, Any]: ...

    def episodes(self) -> list[Episode]: ...


_L = TypeVar("_L", bound=ShardLearner)

# Figures of `info()` that do not add up across shards (they stay per shard, under "shards").
_NOT_ADDITIVE = frozenset({
    "seq", "generation", "oldest_row_id", "uptime", "replay_id", "instance_id", "server_version",
    "protocol_version", "capacity",
})



def _qualified(row_ids: Any, num_shards: int) -> tuple[np.ndarray, np.ndarray]:
    """(shard, local id) arrays from packed ids (1-D) or (shard, id) pairs (shape (n, 2)).

    Raises:
        TypeError: not integers.
        IndexError: a negative id or pair, or a shard this learner does not have.
    """
    arr = row_ids if isinstance(row_ids, np.ndarray) else np.asarray(row_ids)
    if arr.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"row ids must be integers (packed ids, or (shard, row_id) pairs), got an array of {arr.dtype}")
    if arr.ndim == 2 and arr.shape[1] == 2:
        if int(arr.min()) < 0:
            raise IndexError(f"(shard, row_id) pairs cannot be negative, got {int(arr.min())}")
        shards, local = arr[:, 0].astype(np.int64), arr[:, 1].astype(np.int64)
    elif arr.ndim == 1:
        if arr.dtype.kind == "i" and int(arr.min()) < 0:
            raise IndexError(f"packed row id {int(arr.min())} is negative")
        shards, ids = unpack_ids(arr)
        local = ids.astype(np.int64)
    else:
        raise TypeError(f"row ids must be packed ids (shape (n,)) or (shard, row_id) pairs (shape (n, 2)), "
                        f"got shape {arr.shape}")
    if int(shards.max()) >= num_shards:
        raise IndexError(f"shard {int(shards.max())} does not exist: this learner has {num_shards} shard(s)")
    return shards, local


def _positive(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return int(value)


class _Empty(Exception):
    """A shard had nothing to sample (it was cleared, or holds no window that long)."""


class ShardedLearner(_Router[_L]):
    """The routing of `LearnerClient(endpoints=[...])`: reads from every live shard.

    Args:
        endpoints: every shard's endpoint, in the same order for every client.
        config: the client's settings (its `endpoint` is ignored).
        secret_key, server_key: CURVE certificate files, the same for every shard.
        client_class: the single-server client of one shard (LearnerClient).

    Raises:
        ConfigError: the shards hold different spaces, or two endpoints reach the same file.
        ServerUnavailableError: no shard answered within the timeout.
    """

    role = "learner"

    def __init__(
        self, endpoints: Sequence[str], config: ClientConfig, secret_key: Any = None, server_key: Any = None, *,
        client_class: Callable[..., _L],
    ) -> None:
        super().__init__(endpoints, config, secret_key, server_key, client_class=client_class)
        self._pool = cf.ThreadPoolExecutor(max_workers=len(self.shards), thread_name_prefix="h5replay-shard")
        self._lengths = np.full(len(self.shards), -1, dtype=np.int64)  # rows held as last seen; -1: unknown
        self._views: dict[int, View] = {}  # kept while a shard is down: its view never goes back
        #: Calls that skipped each shard because it was down.
        self.num_skipped = [0] * len(self.shards)
        self._rng = np.random.default_rng()  # splits batches when the caller gives no seed
        # Rows draws that change a shard's state handed out that no call returned yet (flat leaves,
        # qualified info), as a single server's learner keeps them (see client/_kept.py).
        self._kept = Kept()
        self._table_kinds: dict[str | None, tuple[str, ...]] = {}  # see _table_kind
        try:
            self._connect_initial()
        except BaseException:
            self.close()
            raise
        first = next(s.client for s in self.shards if s.client is not None)
        self.limits = first.limits
        self.codec_space: Space = first.space
        #: The shards' observation keys and reward / end-flag leaves (None: they keep no finals).
        self.transition_keys: TransitionKeys | None = first.transition_keys

    def _retire(self, shard: _Shard) -> None:
        view = shard.client.view
        if view is not None:
            self._views[shard.index] = view
        self._lengths[shard.index] = -1
        for kind, parts in shard.client._take_kept().items():  # rows it drew must outlive its client
            self._kept.put(kind, [self._qualified_part(shard.index, batch, info, 1.0, self._kind_space(kind))
                                  for batch, info in parts])

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

    def _kind_space(self, kind: tuple[Any, ...]) -> Space:
        """The space of what a draw of `kind` returns: a transition, or the rows' own."""
        if self.space is None:
            raise ClosedError("this learner never connected")
        if kind[0] == "transitions" and self.transition_keys is not None:
            return self.transition_keys.transition_space(self.space)
        return self.space

    def _table_kind(self, table: str | None) -> tuple[str, ...]:
        """The part of a draw's kind that names `table`, as the shards' clients name it (so what a
        retired shard's client kept is found again; the last one seen when no shard is up)."""
        kind = next((s.client._table(table).kind for s in self.shards if s.client is not None), None)
        if kind is not None:
            self._table_kinds[table] = kind
        return self._table_kinds.get(table, (table,) if table else ())

    def _adopted(self, shard: _Shard) -> None:
        view = self._views.pop(shard.index, None)
        if view is not None and shard.client.view is None:
            # The restarted server publishes states newer than any this client saw: min_seq stays valid.
            shard.client._view = view

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

    def _fan_out(self, calls: Mapping[int, Callable[[_L], Any]]) -> dict[int, Any]:
        """{shard: result} of one call per shard, all sent at once. A shard that does not answer is
        marked down and left out; any other error is raised (after every call has returned)."""
        outcomes = self._fan_out_outcomes(calls)
        for outcome in outcomes.values():
            if isinstance(outcome, BaseException) and not isinstance(outcome, ServerUnavailableError):
                raise outcome
        return {index: o for index, o in outcomes.items() if not isinstance(o, BaseException)}

    def _gather(self, call: Callable[[_L], Any]) -> dict[int, Any]:
        """`call` on every live shard; raises ServerUnavailableError when none answered."""
        with self._lock:
            results = self._fan_out({i: call for i in self._live()})
            if not results:
                raise ServerUnavailableError(f"no shard of {len(self.shards)} answered within {self.config.timeout} s")
            return results

    # ------------------------------------------------------------------ figures

    def __len__(self) -> int:
        """Rows that may be sampled on every live shard: rows held, less those a shard's
        `max_times_sampled` removed (shards have no common logical index to keep them for)."""
        results = self._gather(_drawable)
        for index, length in results.items():
            self._lengths[index] = length
        return int(sum(results.values()))

    def info(self) -> dict[str, Any]:
        """The shards' figures added up (rows, episodes, rows in and out, commits, ...), with
        "shards": each shard's own figures (None for a shard that did not answer), "num_shards",
        "live_shards" and "skipped" (calls that skipped each shard)."""
        results = self._gather(lambda c: c.info())
        per_shard = [results.get(s.index) for s in self.shards]
        answered = [r for r in per_shard if r is not None]
        total: dict[str, Any] = {}
        for key in answered[0]:
            values = [r.get(key) for r in answered]
            if key not in _NOT_ADDITIVE and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                total[key] = sum(values)
        capacities = [r.get("capacity") for r in answered]
        total["capacity"] = None if None in capacities else sum(capacities)
        for index, stats in results.items():
            self._lengths[index] = int(stats.get("length", 0))
        total.update(num_shards=len(self.shards), live_shards=sorted(results), skipped=list(self.num_skipped),
                     shards=per_shard)
        return total

    def episodes(self) -> list[Episode]:
        """Every complete episode held on every live shard (shard by shard, oldest first), with
        packed ids: Episode(pack_ids(shard, episode_id), pack_ids(shard, first_row_id), length)."""
        results = self._gather(lambda c: c.episodes())
        out: list[Episode] = []
        for index in sorted(results):
            eps = results[index]
            if not eps:
                continue
            table = np.asarray(eps, dtype=np.uint64).reshape(-1, 3)
            ids, firsts = pack_ids(index, table[:, 0]), pack_ids(index, table[:, 1])
            out.extend(Episode(int(e), int(f), int(n)) for e, f, n in zip(ids, firsts, table[:, 2]))
        return out

    # ------------------------------------------------------------------ reads

    def _flat(self, batch: Any) -> dict[str, Any]:
        if self.space is None:
            raise ClosedError("this learner never connected")
        return flatten_value(self.space, batch)

    def _unflat(self, leaves: Mapping[str, Any]) -> Any:
        if self.space is None:
            raise ClosedError("this learner never connected")
        return unflatten_value(self.space, leaves)

    def get_rows(self, row_ids: Any) -> Any:
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
        with self._lock:
            masks, local = self._by_shard(row_ids)
            calls = {index: _reader(index, local[mask]) for index, mask in masks.items()}
            results = self._fan_out(calls)
            missing = sorted(set(calls) - set(results))
            if missing:
                raise ServerUnavailableError(f"shard(s) {missing} did not answer within {self.config.timeout} s")
        parts = {index: self._flat(batch) for index, batch in results.items()}
        return self._unflat(_scatter(parts, masks, local.shape[0]))

    def update_priorities(self, row_ids: Any, priorities: Any, *, table: str | None = None) -> int:
        """Set priorities by qualified id (as `get_rows` takes them) in `table` (None: the
        shards' only table), one call per shard, all at once. Returns how many ids the shards
        ignored (no longer held).

        Raises:
            ServerUnavailableError: a shard named does not answer (the others may have taken theirs).
            ConfigError: a priority is negative, NaN or infinite, or the counts differ.
        """
        with self._lock:
            masks, local = self._by_shard(row_ids)
            values = check_priorities(priorities, local.shape[0])
            calls = {index: _prioritizer(local[mask], values[mask], table) for index, mask in masks.items()}
            results = self._fan_out(calls)
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
        shards, local = _qualified(row_ids, len(self.shards))
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

    def sample(self, batch_size: int, seed: int | None = None, *, with_info: bool = False,
               table: str | None = None) -> Any:
        """`batch_size` rows drawn uniformly with replacement from all rows of all live shards:
        each batch position picks a shard with probability (its rows) / (all rows), as last seen,
        and every shard draws its share in one request, all at once, from `table` (None: the
        shards' only one). `SampleInfo.probabilities` is the chance of each row in that draw;
        `shard_ids` says where each came from."""
        size = _positive(batch_size, "batch_size")
        return self._draw(size, seed, with_info, lambda c, n, s: c.sample(n, s, with_info=True, table=table), "rows",
                          ("rows",), table)

    def sample_sequences(self, batch_size: int, length: int, seed: int | None = None, *, with_info: bool = False,
                         table: str | None = None, pad: bool = False) -> Any:
        """`batch_size` windows of `length` steps, each within one episode of one shard; shards are
        picked in proportion to their rows, as for `sample`. A shard holding no episode that long is
        left out of the draw. `pad`: as a single server's."""
        size, steps = _positive(batch_size, "batch_size"), _positive(length, "length")
        if not pad:
            return self._draw(size, seed, with_info,
                              lambda c, n, s: c.sample_sequences(n, steps, s, with_info=True, table=table),
                              f"windows of {steps} steps", ("windows", steps), table)
        if self.space is not None:
            check_pad_space(self.space)
        batch, info = self._draw(size, seed, True,
                                 lambda c, n, s: _without_mask(c.sample_sequences(n, steps, s, with_info=True,
                                                                                  table=table, pad=True)),
                                 f"windows of {steps} steps", ("padded windows", steps), table)
        batch = masked(batch, info.valid_steps, steps)
        return (batch, info) if with_info else batch

    def sample_transitions(self, batch_size: int, *, n_step: int = 1, gamma: float = 0.99, with_info: bool = False,
                           seed: int | None = None, table: str | None = None) -> Any:
        """`batch_size` n-step transitions, each within one episode of one shard; shards are
        picked in proportion to their rows, as for `sample`."""
        size = _positive(batch_size, "batch_size")
        n, discount_rate = check_n_step(n_step, gamma)
        keys = self.transition_keys
        if keys is None or self.space is None:
            raise ConfigError("these servers keep no final observations: serve files created with "
                              "--observation-keys (observation_keys=) to draw transitions")
        return self._draw(size, seed, with_info,
                          lambda c, m, s: c.sample_transitions(m, n_step=n, gamma=discount_rate, with_info=True, seed=s,
                                                               table=table),
                          "transitions", ("transitions", n, discount_rate), table,
                          keys.transition_space(self.space))

    def _draw(self, size: int, seed: int | None, with_info: bool, call: Callable[[Any, int, int | None], Any],
              what: str, kind: Any, table: str | None = None, space: Space | None = None) -> Any:
        rng = self._rng if seed is None else np.random.default_rng(seed)
        empty: set[int] = set()  # shards that had nothing to draw in this call
        with self._lock:
            self.check_table(table)
            kind = (*kind, *self._table_kind(table))
            consuming = any(s.client is not None and s.client._table(table).consuming for s in self.shards)
            if self._kept.count(kind) or consuming:
                return self._draw_consuming(size, rng, seed, with_info, call, what, kind, table,
                                            space or self._kind_space(kind))
            for _ in range(2 * len(self.shards) + 2):  # each retry leaves a shard out, or learns its length
                live = [i for i in self._live() if i not in empty]
                unknown = [i for i in live if self._lengths[i] < 0]
                if unknown:
                    for index, n in self._fan_out({i: len for i in unknown}).items():
                        self._lengths[index] = n
                    continue
                lengths = self._lengths[live].astype(np.float64)
                if not live or lengths.sum() == 0:
                    self.__len__()  # the lengths may be stale: look once more
                    live = [i for i in live if self.shards[i].client is not None and self._lengths[i] > 0]
                    if not live:
                        raise NotEnoughDataError(f"cannot sample {what}: no live shard has any "
                                                 f"({len(self.shards)} shards, {len(empty)} without enough)")
                    lengths = self._lengths[live].astype(np.float64)
                weights = lengths / lengths.sum()
                assign = rng.choice(len(live), size=size, p=weights)
                counts = np.bincount(assign, minlength=len(live))
                calls: dict[int, Callable[[_L], Any]] = {}
                for k, index in enumerate(live):
                    part_seed = None if seed is None else int(rng.integers(2**62))
                    calls[index] = _drawer(call, int(counts[k]), part_seed) if counts[k] else len
                results = self._fan_out(calls)
                for index, result in results.items():
                    if isinstance(result, int):
                        self._lengths[index] = result
                    elif result is _EMPTY:
                        empty.add(index)
                        self._lengths[index] = -1
                    else:
                        view = self.shards[index].client.view if self.shards[index].client is not None else None
                        if view is not None:
                            self._lengths[index] = view.length
                if any(counts[k] and (i not in results or results[i] is _EMPTY) for k, i in enumerate(live)):
                    continue  # a shard went down or had nothing: draw again among the others
                return self._merge(live, assign, weights, results, with_info, space)
        raise NotEnoughDataError(f"cannot sample {what}: the shards kept going down or emptying during the call")

    def _draw_consuming(self, size: int, rng: np.random.Generator, seed: int | None, with_info: bool,
                        call: Callable[[Any, int, int | None], Any], what: str, kind: Any,
                        table: str | None, space: Space) -> Any:
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
            for _ in range(2 * len(self.shards) + 2):  # each round fills the batch or leaves a shard out
                live = [i for i in live if i not in failed and self.shards[i].client is not None]
                if have >= size or not live:
                    break
                unknown = [i for i in live if self._lengths[i] < 0]
                if unknown:
                    for index, n in self._fan_out({i: functools.partial(_drawable, table=table) for i in unknown}).items():
                        self._lengths[index] = n
                    continue
                with_rows = [i for i in live if self._lengths[i] > 0] or live  # none seen: ask them all
                lengths = self._lengths[with_rows].astype(np.float64)
                weights = lengths / lengths.sum() if lengths.sum() > 0 else np.full(len(with_rows), 1.0 / len(with_rows))
                counts = _shares(size - have, self._lengths[with_rows], weights, rng)
                calls = {index: _share(call, int(counts[k]), None if seed is None else int(rng.integers(2**62)))
                         for k, index in enumerate(with_rows) if counts[k]}
                for index, outcome in self._fan_out_outcomes(calls).items():
                    if isinstance(outcome, BaseException):
                        failed[index] = outcome
                        self._lengths[index] = -1
                        continue
                    batch, info = outcome
                    parts.append(self._qualified_part(index, batch, info, float(weights[with_rows.index(index)]), space))
                    have += len(info)
                    client = self.shards[index].client
                    view = client.view if client is not None else None
                    if view is not None:  # rows left to draw there, as far as this draw tells
                        removes = client._table(table).removes
                        self._lengths[index] = max(0, view.length - (len(info) if removes else 0))
        except BaseException:
            self._kept.give_back(kind, parts)
            raise
        if have < size:
            self._kept.give_back(kind, parts)
            raise kept_error(_shortfall(failed, what, len(self.shards)), have)
        arrays, info = join_parts(parts, list(parts[0][0]))
        batch = unflatten_value(space, arrays)
        return (batch, info) if with_info else batch

    def _fan_out_outcomes(self, calls: Mapping[int, Callable[[_L], Any]]) -> dict[int, Any]:
        """{shard: result or the exception it raised} of one call per shard, all sent at once; a
        shard that does not answer is marked down."""
        if not calls:
            return {}
        *others, (last, last_call) = calls.items()
        futures: dict[int, Any] = {i: self._pool.submit(call, self.shards[i].client) for i, call in others}
        futures[last] = _run_inline(last_call, self.shards[last].client)
        outcomes = {index: _outcome(future) for index, future in futures.items()}
        for index, outcome in outcomes.items():
            if isinstance(outcome, ServerUnavailableError):
                self._mark_down(self.shards[index], outcome)
        return outcomes

    def _merge(self, live: list[int], assign: np.ndarray, weights: np.ndarray, results: Mapping[int, Any],
               with_info: bool, space: Space | None = None) -> Any:
        """The shards' draws put back in the order of `assign` (`space`: of what they returned,
        when not the rows' own)."""
        masks = {index: assign == k for k, index in enumerate(live) if not isinstance(results[index], int)}
        if space is None:
            parts = {index: self._flat(results[index][0]) for index in masks}
            batch = self._unflat(_scatter(parts, masks, assign.shape[0]))
        else:
            parts = {index: flatten_value(space, results[index][0]) for index in masks}
            batch = unflatten_value(space, _scatter(parts, masks, assign.shape[0]))
        if not with_info:
            return batch
        infos = {index: dataclasses.replace(results[index][1], probabilities=results[index][1].probabilities * weights[k],
                                            shard_ids=np.full(len(results[index][1]), index, np.int64))
                 for k, index in enumerate(live) if index in masks}
        merged: dict[str, np.ndarray] = {}
        for f in dataclasses.fields(SampleInfo):  # each field every shard's info has, scattered back
            values = {index: getattr(info, f.name) for index, info in infos.items()}
            if any(v is None for v in values.values()):
                continue
            out = np.empty(assign.shape[0], next(iter(values.values())).dtype)
            for index, value in values.items():
                out[masks[index]] = value
            merged[f.name] = out
        return batch, SampleInfo(**merged)

    def close(self) -> None:
        """Close every shard's client (rows still kept, `num_kept`, are dropped with a warning).
        Safe to call twice."""
        with self._lock:
            if self._kept.count():
                log.warning("closing a learner that still keeps %d rows (or windows) drawn for it that no call "
                            "returned: they are gone (call sample() until num_kept is 0 first)", self._kept.count())
                self._kept.take_all()
            super().close()
            self._pool.shutdown(wait=False, cancel_futures=True)


_EMPTY = object()


def _run_inline(call: Callable[[Any], Any], client: Any) -> cf.Future[Any]:
    future: cf.Future[Any] = cf.Future()
    try:
        future.set_result(call(client))
    except BaseException as exc:  # noqa: B036 (handed back through the future, as a pool would)
        future.set_exception(exc)
    return future


def _drawable(client: Any, table: str | None = None) -> int:
    """Rows a shard's `table` may still hand out: its length, less what its `max_times_sampled`
    removed (the writer counts those: its figures give them). Without a table on a shard of
    several: its length."""
    try:
        draws = client._table(table)
    except ConfigError:
        return len(client)
    if draws.removes:
        info = client.info()
        return int(info.get(f"table.{draws.name}.sampleable", info.get("sampleable", 0)) or 0)
    return len(client)


def _shares(n: int, lengths: np.ndarray, weights: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """How many of `n` rows to ask of each shard when its draws remove what they take: a
    multinomial draw by `weights`, no shard asked for more than it holds (`lengths`, as last
    seen) while others have room; only what all of them together lack is asked beyond that (it
    waits for rows, as a sample from one queue does)."""
    counts = np.minimum(rng.multinomial(n, weights), np.maximum(lengths, 0))
    room = np.maximum(lengths, 0) - counts
    excess = n - int(counts.sum())
    while excess > 0 and room.sum() > 0:
        extra = np.minimum(rng.multinomial(min(excess, int(room.sum())), room / room.sum()), room)
        counts, room, excess = counts + extra, room - extra, excess - int(extra.sum())
    if excess > 0:
        counts = counts + rng.multinomial(excess, weights)
    out: np.ndarray = counts.astype(np.int64)
    return out


def _share(call: Callable[[Any, int, int | None], Any], count: int, seed: int | None) -> Callable[[Any], Any]:
    return lambda client: call(client, count, seed)


def _shortfall(failed: Mapping[int, BaseException], what: str, num_shards: int) -> BaseException:
    """Why a draw over shards came up short: the shards' own refusal, the most telling first."""
    for cls in (RateLimitedError, NotEnoughDataError, ServerUnavailableError):
        for exc in failed.values():
            if isinstance(exc, cls):
                return exc
    for exc in failed.values():
        return exc
    return NotEnoughDataError(f"cannot sample {what}: no live shard of {num_shards} has any left")


def _drawer(call: Callable[[Any, int, int | None], Any], count: int, seed: int | None) -> Callable[[Any], Any]:
    def draw(client: Any) -> Any:
        try:
            return call(client, count, seed)
        except NotEnoughDataError:
            return _EMPTY

    return draw


def _prioritizer(ids: np.ndarray, values: np.ndarray, table: str | None) -> Callable[[Any], Any]:
    def update(client: Any) -> Any:
        return client.update_priorities(ids, values, table=table)

    return update


def _reader(index: int, ids: np.ndarray) -> Callable[[Any], Any]:
    def read(client: Any) -> Any:
        try:
            return client.get_rows(ids)
        except EvictedError as exc:
            raise EvictedError(f"shard {index}: {exc}") from exc

    return read


def _scatter(parts: Mapping[int, Mapping[str, Any]], masks: Mapping[int, np.ndarray], size: int) -> dict[str, Any]:
    """One flat batch of `size` rows from each shard's part, placed where its mask is true."""
    first = next(iter(parts.values()))
    out: dict[str, Any] = {}
    for path, arr in first.items():
        arr = np.asarray(arr)
        if len(parts) == 1:
            out[path] = arr
            continue
        # Text decodes to str arrays whose width is each part's longest: take the widest.
        dtype = np.result_type(*(np.asarray(part[path]).dtype for part in parts.values()))
        merged = np.empty((size, *arr.shape[1:]), dtype)
        for index, part in parts.items():
            merged[masks[index]] = part[path]
        out[path] = merged
    return out


def _without_mask(drawn: tuple[Any, SampleInfo]) -> tuple[Any, SampleInfo]:
    """A shard's padded draw without its mask: rebuilt from the merged `valid_steps`."""
    batch, info = drawn
    return unmasked(batch), info
