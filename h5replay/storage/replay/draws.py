"""Draws: the buffer's sampling verbs, and the counters sampling keeps.

`sample` and `sample_sequences` draw by a table's sampler under its rate limit, read the rows
against one state (`_consistent`) and count what was handed out (rows a table sampled
`max_times_sampled` times leave it); `update_priorities` sets a prioritized table's priorities,
checkpointing its log as it fills; `carry_over` / `carry_sample_counts` take an export's counters.
A mixin of `ReplayBuffer`: the samplers themselves live in `table.py` / `tables.py`, the reads and
publishes in `buffer.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from h5replay.errors import ConfigError, NotEnoughDataError, RateLimitedError, ReadOnlyError
from h5replay.priorities import check_priorities
from h5replay.records import SampleInfo
from h5replay.spaces import Space
from h5replay.storage.replay.episodes import EpisodeTable
from h5replay.storage.replay.ring import as_row_ids
from h5replay.storage.replay.rows import RowStore
from h5replay.storage.replay.state import State
from h5replay.storage.replay.table import Sampling
from h5replay.storage.replay.tables import Tables
from h5replay.windows import check_pad_space, masked, window_rows

__all__ = ["Draws", "positive_int"]

_T = TypeVar("_T")


def positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def ordered_draw(sampling: Sampling, view: State, size: int, rng: np.random.Generator,
                 skip: int) -> tuple[np.ndarray, np.ndarray]:
    """(row ids, probabilities) of `size` draws by `sampling`; an in-order sampler (fifo, lifo)
    first passes over `skip` rows of its order (a later part of a batch split over requests, so
    that no row comes twice in it). Random samplers draw each part afresh: `skip` is nothing to them."""
    if skip < 0:
        raise ConfigError(f"skip must be >= 0, got {skip}")
    if not skip or not sampling.config.ordered:
        return sampling.draw(view, size, rng)
    g, probabilities = sampling.draw(view, size + skip, rng)
    return g[skip:], probabilities[skip:]


class Draws:
    """ReplayBuffer's sampling verbs: sample / sample_sequences, priorities updated, the rate
    limit asked, and the sampling counters an export carries over."""

    # What this mixin uses of ReplayBuffer (set in its __init__, defined in buffer.py).
    storage: RowStore
    _state: State
    _published: State
    _episodes: EpisodeTable
    _tables: Tables
    _limit_inserts: bool

    if TYPE_CHECKING:

        @property
        def capacity(self) -> int | None: ...
        @property
        def space(self) -> Space: ...
        @property
        def is_mutable(self) -> bool: ...
        def _check_open(self) -> None: ...
        def _require_writable(self, what: str) -> None: ...
        def _phys(self, ids: Any, view: State) -> Any: ...
        def _move_begin(self, begin: int) -> None: ...

        def _publish(self, fsync: bool = False) -> None: ...
        def _consistent(self, attempt: Callable[[State], tuple[_T, int]]) -> _T: ...

    def _check_sampler(self, sampling: Sampling) -> None:
        """Readers may sample only when sampling changes nothing (see Table.writer_only)."""
        why = sampling.config.writer_only
        if why is not None and not self.is_mutable:
            raise ReadOnlyError(f"cannot sample from a read-only buffer: {self._tables.named(sampling, why)}, so only "
                                "the writer samples (through the server, learners' samples go to it)")

    def rate_limit_blocker(self, rows: int, *, sampling: bool, table: str | None = None) -> tuple[str | None, bool]:
        """Writer: why a sample from `table` (or an insert, into every table) of `rows` rows must
        wait now, and whether it would wait forever (too big for a limiter's window); (None,
        False) when it may go ahead."""
        if sampling:
            return self._tables.sample_blocker(self._tables.pick(table), rows, self._state, self.capacity)
        return self._tables.insert_blocker(rows, self._state)

    def carry_over(self, *, inserted: int, sampled: int | dict[str, int], limit_inserts: bool,
                   max_priority: float | dict[str, float] | None = None, seq: int | None = None,
                   generation: int | None = None) -> None:
        """Writer: take the rate limiters' counters of the buffer this one copies (an export):
        rows inserted, and rows each table sampled (an int: the only table's); whether inserts
        are limited meanwhile (rows copied were inserted once already); each prioritized table's
        running maximum priority, the default of rows committed without one; with `seq` and
        `generation`, its publish and clear counters too, so the copy's publishes follow the
        source's (a learner's view of the replay never goes back).

        Raises:
            ConfigError: a table that is not this buffer's, or a bad maximum priority.
        """
        self._require_writable("carry counters over")
        counts = sampled if isinstance(sampled, dict) else {self._tables.pick(None).name: sampled}
        maxima = max_priority if isinstance(max_priority, dict) or max_priority is None else \
            {self._tables.pick(None).name: max_priority}
        state = self._state.replace(inserted=int(inserted))
        for name, count in counts.items():
            state = state.with_table(self._tables.pick(name).index, sampled=int(count))
        for name, value in (maxima or {}).items():
            t = self._tables.pick(name)
            if t.config.prioritized:
                bound = check_priorities([value], 1, sampler=t.config.sampler)[0]
                t.max_priority = max(t.max_priority, float(bound))
        if seq is not None:
            state = state.replace(seq=max(state.seq, int(seq)))
        if generation is not None:
            state = state.replace(generation=int(generation))
        self._state = state
        self._limit_inserts = limit_inserts

    def sample_counts(self, first: int, stop: int, *, table: str | None = None) -> np.ndarray:
        """How often each row of ids [first, stop) (held) was sampled by `table`, as uint32:
        what its `max_times_sampled` counts (zeros for a table without it)."""
        self._check_open()
        return self._tables.pick(table).counts(first, stop, self._state)

    def carry_sample_counts(self, first: int, counts: np.ndarray, *, table: str | None = None) -> None:
        """Writer: `table`'s sample counts of rows [first, first + len(counts)) (just copied by
        an export): rows it sampled `max_times_sampled` times stay removed from it in the copy."""
        self._require_writable("carry sample counts over")
        self._tables.pick(table).set_counts(first, np.asarray(counts, np.uint32), self._state)
        head = self._tables.first_held(self._state)
        if head > self._state.begin:
            self._move_begin(head)

    def _check_sample(self, sampling: Sampling, rows: int) -> None:
        if self.is_mutable and sampling.config.rate_limit.active:
            reason, _ = self._tables.sample_blocker(sampling, rows, self._state, self.capacity)
            if reason is not None:
                raise RateLimitedError(reason)

    def _count_sampled(self, sampling: Sampling, row_ids: np.ndarray, rows: int) -> None:
        """Writer: `sampling`'s table handed out `rows` rows (ids: the rows themselves, or
        windows' first rows when nothing is removed). Rows sampled max_times_sampled times leave
        that table, and `begin` moves past a head of rows every table removed."""
        if not self.is_mutable:
            return
        counters = sampling.counters(self._state)
        self._state = self._state.with_table(sampling.index, sampled=counters.sampled + rows)
        if sampling.config.removes:
            sampling.mark_sampled(row_ids, self._state)
            first = self._tables.first_held(self._state)
            if first > self._state.begin:
                self._move_begin(first)

    def sample(
        self, batch_size: int, rng: np.random.Generator | None = None, *, with_info: bool = False,
        decode: bool | str = True, table: str | None = None, skip: int = 0,
    ) -> Any:
        """`batch_size` rows drawn by `table`'s sampler (None: the only table): uniformly or by
        priority, with replacement; or (fifo / lifo, or when rows are removed) without. With
        `with_info=True` returns (batch, SampleInfo) with each row's id, episode and draw
        probability. `skip`: an in-order sampler passes over that many rows of its order first
        (the later part of a batch a learner splits over requests).

        Raises:
            ConfigError: no such table, or none named where there are several.
            NotEnoughDataError: nothing to sample (or too few rows for a draw without replacement).
            RateLimitedError: (writer) the rate limit holds samples back until more rows are inserted.
            ReadOnlyError: a reader of a table whose sampling only the writer may do.
        """
        size = positive_int(batch_size, "batch_size")
        sampling = self._tables.pick(table)
        rng = rng if rng is not None else np.random.default_rng()
        self._check_sampler(sampling)
        self._check_sample(sampling, size)

        def attempt(view: State) -> tuple[tuple[Any, np.ndarray, np.ndarray], int]:
            g, probabilities = ordered_draw(sampling, view, size, rng, skip)
            return (self.storage.read("array", self._phys(g, view), decode, g), g, probabilities), int(g.min())

        batch, g, probabilities = self._consistent(attempt)
        self._count_sampled(sampling, g, size)
        if not with_info:
            return batch
        return batch, SampleInfo(g.astype(np.uint64), self._episodes.find(g), probabilities)

    def sample_sequences(
        self, batch_size: int, length: int, rng: np.random.Generator | None = None, *, with_info: bool = False,
        decode: bool | str = True, rows: bool = True, table: str | None = None, pad: bool = False,
    ) -> Any:
        """`batch_size` windows of `length` consecutive rows, each inside one complete episode,
        uniform over all such windows (prioritized: by the priority of the window's first row),
        drawn by `table` (None: the only one). Leaves come back shaped (batch_size, length, ...).
        With `with_info=True` returns (batch, SampleInfo) (ids of each window's first row).
        `rows=False` draws the windows without reading them (batch is None). Counts
        batch_size * length rows sampled.

        `pad=True`: a window may start at any step of its episode, the last `length - 1`
        included; steps past the episode's end are zeros and `batch["mask"]` ((batch_size,
        length) bool) marks the episode's steps (`SampleInfo.valid_steps` counts them).

        Raises:
            ConfigError: no such table, a sampler that cannot draw windows, or (pad) a space
                that is not a Dict or already has a 'mask' key.
            NotEnoughDataError: no complete episode holds a window (of `length` rows, unless padded).
            RateLimitedError, ReadOnlyError: as `sample`.
        """
        size = positive_int(batch_size, "batch_size")
        steps = positive_int(length, "length")
        if pad:
            check_pad_space(self.space)
        sampling = self._tables.pick(table)
        rng = rng if rng is not None else np.random.default_rng()
        self._check_sampler(sampling)
        self._check_sample(sampling, size * steps)

        def attempt(view: State) -> tuple[tuple[Any, SampleInfo], int]:
            if steps > view.length and not pad:
                raise NotEnoughDataError(f"no window of {steps} rows fits in the {view.length} rows held")
            ids, starts, lengths = self._episodes.complete(view.begin)
            g0, k, probabilities = sampling.draw_windows(view, starts, lengths, steps, size, rng, pad)
            valid = np.minimum(starts[k] + lengths[k] - g0, steps).astype(np.int64) if pad else None
            info = SampleInfo(g0.astype(np.uint64), ids[k].astype(np.uint64), probabilities, valid_steps=valid)
            if not rows:
                return (None, info), int(g0.min())
            if valid is None:
                g = g0[:, None] + np.arange(steps, dtype=np.int64)[None, :]
                return (self.storage.read("array", self._phys(g, view), decode, g), info), int(g0.min())
            g = window_rows(g0, valid, steps)  # padded: the rows are zeroed past each episode's end, so decoded
            batch = self.storage.read("array", self._phys(g, view), decode if decode is True else False, g)
            return (masked(batch, valid, steps), info), int(g0.min())

        batch, info = self._consistent(attempt)
        self._count_sampled(sampling, info.row_ids.astype(np.int64), size * steps)
        return (batch, info) if with_info else batch

    def update_priorities(self, row_ids: Any, priorities: Any, *, table: str | None = None) -> int:
        """Set the priorities of rows by id in a prioritized `table` (None: the only one). Ids no
        longer held (evicted, cleared, or removed by that table's max_times_sampled) are ignored
        and counted in `info()`; a later id for the same row wins. Durable at the next flush,
        commit or close.

        Returns:
            How many ids were ignored.

        Raises:
            ConfigError: no such table, or it keeps no priorities, or a priority is negative,
                NaN, infinite or beyond the sampler's `priority_limit`, or there are not as many
                priorities as ids (nothing is changed).
            IndexError: an id was never committed (nothing is changed).
        """
        self._require_writable("update priorities")
        sampling = self._tables.pick(table)
        ids = as_row_ids(row_ids)
        if not sampling.config.prioritized:
            raise ConfigError(f"table {sampling.name!r} samples by {type(sampling.config.sampler).__name__}(): only "
                              "a Prioritized sampler keeps priorities (choose it when the file is created)")
        values = check_priorities(priorities, ids.shape[0], sampler=sampling.config.sampler)
        if ids.size and int(ids.max()) >= self._state.end:
            raise IndexError(f"row id {int(ids.max())} was never committed: the next row id is {self._state.end}")
        ignored = 0
        log_entries = sampling.log_entries
        step = log_entries // 2
        for first in range(0, max(ids.shape[0], 1), step):
            part_ids, part_values = ids[first : first + step], values[first : first + step]
            if sampling.counters(self._state).plog + part_ids.shape[0] - log_entries > \
                    sampling.counters(self._published).pckpt:
                self._checkpoint_priorities(sampling)
            logged, skipped = sampling.update(part_ids, part_values, self._state)
            plog = sampling.counters(self._state).plog + logged
            self._state = self._state.with_table(sampling.index, plog=plog)
            ignored += skipped
        return ignored

    def _checkpoint_priorities(self, sampling: Sampling) -> None:
        """Write a table's updated priorities into its dataset and publish that, so its log's
        older entries may be overwritten. Every update applied is published first: the dataset
        never holds a priority no publish counts, which a crash would recover and a reader's full
        load would read (both load the dataset, then the log from `pckpt`)."""
        self._publish()
        sampling.checkpoint()
        self._state = self._state.with_table(sampling.index, pckpt=sampling.counters(self._state).plog)
        self._publish()
