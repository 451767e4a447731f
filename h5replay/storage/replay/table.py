"""How a ReplayBuffer draws rows: the in-memory side of its sampling settings (`sampling.py`).

`Sampling` keeps, per physical row (slot), what the sampler needs: a sum tree of weights
(priority ** exponent for a prioritized sampler; 1 for a row that may still be sampled when rows
are removed; 0 for a slot not held), the raw priorities (writer) and how often each row was
sampled (writer, with `max_times_sampled`). The writer keeps it exact as rows come and go, and
holds the priority log entries of its updates until the next publish writes them; a reader
rebuilds it from the file once and then follows the priority log (`table_file.py`), reading
only what changed.

Draws come back as row ids with the probability each was drawn with, computed from the same
weights the draw used. Every priority that enters is checked against `Prioritized.priority_limit`
(its weight is at most `MAX_WEIGHT`), so the tree's total is always finite; values read from a
file are clipped to that bound (a damaged or hand-made file cannot make it inf either). Pure
numpy apart from the `SamplingFile` it is given (None: nothing kept).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from h5replay.errors import ConfigError, NotEnoughDataError
from h5replay.samplers.sumtree import SumTree
from h5replay.sampling import DEFAULT_TABLE, Prioritized, RateLimiter, SamplingConfig
from h5replay.storage.replay.ring import Ring
from h5replay.storage.replay.state import Counters, State
from h5replay.storage.replay.table_file import LOG_ENTRIES, SamplingFile

__all__ = ["Sampling"]

_SYNC_RETRIES = 8


class Sampling:
    """The sampler, rate limiter and per-row sampling state of one open buffer."""

    def __init__(self, config: SamplingConfig, capacity: int | None, store: SamplingFile | None, writer: bool,
                 index: int = 0, name: str = DEFAULT_TABLE) -> None:
        self.config = config
        #: The table's name, and its place among the buffer's tables (its counters in a State).
        self.name, self.index = name, index
        self.ring = Ring(capacity)
        self.capacity = capacity
        self.store = store
        self.writer = writer
        self.limiter = RateLimiter(config.rate_limit)
        part: Prioritized | None = config.sampler.prioritized_part
        self._exponent = part.exponent if part is not None else 1.0
        self._initial = part.initial_priority if part is not None else None
        self._limit = part.priority_limit if part is not None else np.inf
        size = capacity or 0
        #: Whether draws go through the tree (else: uniform or in order over [begin, end)).
        self.weighted = config.prioritized or (config.removes and writer)  # readers never draw removals
        self.tree = SumTree(size if self.weighted else 0)
        self.priorities = np.full(size, np.nan) if config.prioritized else None
        self.times = np.zeros(size, dtype=np.uint32) if config.removes and writer else None
        #: The largest priority given so far (the PER default for rows committed without one),
        #: kept in the file by every publish that changes it.
        self.max_priority = 1.0
        #: Rows held that were sampled max_times_sampled times (never sampled again).
        self.removed = 0
        #: Priority updates that named a row no longer held (ignored).
        self.ignored_updates = 0
        # Chunks of `priorities` updated since the last checkpoint (one flag per chunk).
        self._dirty_chunks = np.zeros(-(-size // _CHECKPOINT_CHUNK), dtype=bool)
        #: Entries of the priority log ring (a checkpoint before the ring overwrites unsaved ones).
        self.log_entries = store.log_entries if store is not None else LOG_ENTRIES
        # Log entries not yet in the file: (row ids, values) for updates _pending_at, ... in order.
        # Written by `write_log`, which every publish calls first (nothing reads them before).
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._pending_at = 0
        self._pending_count = 0

    # ------------------------------------------------------------------ slots and ids

    def _slots(self, ids: np.ndarray, state: State) -> np.ndarray:
        return self.ring.slots(ids, state.origin)  # type: ignore[no-any-return]

    def _ids(self, slots: np.ndarray, state: State) -> np.ndarray:
        return self.ring.ids(slots, state.begin, state.origin)

    def _pieces(self, first: int, stop: int, state: State) -> list[tuple[int, int, int]]:
        """(first slot, stop slot, first id) of the contiguous runs of ids [first, stop)."""
        return self.ring.pieces(first, stop, state.origin)

    def counters(self, state: State) -> Counters:
        """This table's counters in `state`."""
        return state.tables[self.index]

    def _grow(self, state: State, end: int) -> None:
        """Unbounded buffers: room for slots up to `end`'s."""
        if self.capacity is not None:
            return
        need = end - state.origin
        if self.weighted and need > len(self.tree):
            self.tree.grow(max(need, 2 * len(self.tree)))
        for name in ("priorities", "times"):
            arr = getattr(self, name)
            if arr is not None and need > arr.shape[0]:
                grown = np.full(max(need, 2 * arr.shape[0]), np.nan if name == "priorities" else 0, dtype=arr.dtype)
                grown[: arr.shape[0]] = arr
                setattr(self, name, grown)
        if self.priorities is not None and self.priorities.shape[0] > self._dirty_chunks.shape[0] * _CHECKPOINT_CHUNK:
            dirty = np.zeros(-(-self.priorities.shape[0] // _CHECKPOINT_CHUNK), dtype=bool)
            dirty[: self._dirty_chunks.shape[0]] = self._dirty_chunks
            self._dirty_chunks = dirty

    def _weights(self, priorities: np.ndarray) -> np.ndarray:
        if self.config.prioritized:
            weights: np.ndarray = np.power(priorities, self._exponent)
            return weights
        return np.ones(priorities.shape, dtype=np.float64)

    def _default(self) -> float:
        return self._initial if self._initial is not None else self.max_priority

    def _bounded(self, priorities: np.ndarray) -> np.ndarray:
        """Priorities read from the file, within [0, priority_limit] (NaN, none given, stays)."""
        bounded: np.ndarray = np.clip(priorities, 0.0, self._limit)
        return bounded

    # ------------------------------------------------------------------ what is held

    def sampleable(self, state: State) -> int:
        """Rows that may still be sampled (held, not removed)."""
        return state.length - self.removed

    def load(self, state: State, read_state: Callable[[], State] | None = None) -> None:
        """Rebuild everything from the file for `state` (open, a new generation, a lost reader).

        A reader passes `read_state`, to check the priority log it read was not overwritten."""
        if not self.weighted:
            return
        for _ in range(_SYNC_RETRIES):
            self._load_once(state)
            if read_state is None or not self.config.prioritized \
                    or self.counters(read_state()).pckpt <= self.counters(state).pckpt:
                return
        raise ConfigError("the writer rewrote the priority log on every attempt to read it")

    def _load_once(self, state: State) -> None:
        self.tree.clear()
        self._grow(state, state.end)
        self.removed = 0
        held_prio: list[np.ndarray] = []
        recorded = self._recorded_max(state)
        for s0, s1, _ in self._pieces(state.begin, state.end, state):
            p = self.store.read_priorities(s0, s1) if self.store is not None and self.config.prioritized else None
            if p is not None:
                p = self._bounded(p)
                held_prio.append(p)
                if self.priorities is not None:
                    self.priorities[s0:s1] = p
            if self.times is not None:  # the writer's: readers never draw what max_times_sampled removes
                t = self.store.read_times(s0, s1) if self.store is not None else np.zeros(s1 - s0, np.uint32)
                self.times[s0:s1] = t
                self.removed += int(np.count_nonzero(t >= self.config.max_times_sampled))
        finite = [p[np.isfinite(p)] for p in held_prio]
        seen = np.concatenate(finite) if finite else np.zeros(0)
        # The running maximum as of this publish (a file made before it was kept: the largest held).
        self.max_priority = recorded if recorded is not None else max(1.0, float(seen.max()) if seen.size else 1.0)
        for s0, s1, _ in self._pieces(state.begin, state.end, state):
            if self.config.prioritized:
                p = held_prio.pop(0)
                p = np.where(np.isfinite(p), p, self._default())
            else:
                p = np.ones(s1 - s0)
            w = self._weights(p)
            if self.times is not None:
                w = np.where(self.times[s0:s1] >= self.config.max_times_sampled, 0.0, w)
            self.tree.set_range(s0, w)
        self._apply_log(state, self.counters(state).pckpt, self.counters(state).plog)
        if recorded is None and self.priorities is not None and state.length:
            held = np.concatenate([self.priorities[s0:s1] for s0, s1, _ in self._pieces(state.begin, state.end, state)])
            self.max_priority = max(1.0, float(np.nanmax(held, initial=1.0)))

    def _recorded_max(self, state: State) -> float | None:
        """The running maximum priority the file records as of `state` (None: none)."""
        if self.store is None or not self.config.prioritized:
            return None
        recorded = self.store.read_max(state.seq)
        if recorded is None or not recorded >= 0:  # NaN or negative: a damaged entry, none
            return None
        return min(recorded, self._limit)

    def _apply_log(self, state: State, first: int, stop: int) -> None:
        if self.store is None or stop <= first or not self.config.prioritized:
            return
        ids, values = self.store.read_log(first, stop)
        values = np.where(np.isnan(values), self._default(), self._bounded(values))
        held = (ids >= state.begin) & (ids < state.end)
        slots = self._set_priorities(ids[held], values[held], state)
        if self.writer:  # a writer reopening the file: its next checkpoint must save these too
            self._dirty_chunks[slots // _CHECKPOINT_CHUNK] = True

    def sync(self, old: State, new: State, read_state: Callable[[], State]) -> None:
        """Reader: follow the writer from `old` to `new`, reading only what changed."""
        if not self.weighted:
            return
        was, now = self.counters(old), self.counters(new)
        if (new.generation != old.generation or new.origin != old.origin or new.begin >= old.end
                or now.plog - was.plog > self.log_entries // 2 or now.plog < was.plog):
            self.load(new, read_state)
            return
        if new.begin > old.begin:
            self._zero(old.begin, new.begin, old)
        first_new = max(old.end, new.begin)
        self._grow(new, new.end)
        for s0, s1, _ in self._pieces(first_new, new.end, new):
            p = self.store.read_priorities(s0, s1) if self.store is not None else np.full(s1 - s0, np.nan)
            p = np.where(np.isnan(p), self._default(), self._bounded(p))
            if self.priorities is not None:
                self.priorities[s0:s1] = p
            self.tree.set_range(s0, self._weights(p))
        self._apply_log(new, was.plog, now.plog)
        if now.plog > was.plog and self.counters(read_state()).pckpt > was.plog:
            self.load(new, read_state)  # the log moved under us: start from the file

    # ------------------------------------------------------------------ the writer's changes

    def _zero(self, first: int, stop: int, state: State) -> None:
        """Rows [first, stop) leave the buffer."""
        for s0, s1, _ in self._pieces(first, stop, state):
            self.tree.set_range(s0, 0.0, s1 - s0)
            if self.times is not None:
                self.removed -= int(np.count_nonzero(self.times[s0:s1] >= self.config.max_times_sampled))

    def released(self, old_begin: int, new_begin: int, state: State) -> None:
        """The writer moved `begin` from `old_begin` to `new_begin` (rows left the buffer)."""
        if self.weighted and new_begin > old_begin:
            self._zero(old_begin, min(new_begin, state.end), state)

    def added(self, state: State, first: int, n: int, priorities: np.ndarray | None) -> None:
        """Rows [first, first + n) joined the buffer (`priorities`: NaN where none was given).

        Raises:
            StorageError: the file refused the priorities or counters (the caller rolls back).
        """
        if not self.weighted or n == 0:
            return
        self._grow(state, first + n)
        if self.config.prioritized:
            given = priorities if priorities is not None else np.full(n, np.nan)
            values = np.where(np.isfinite(given), given, self._default())  # the default from before this commit
            finite = given[np.isfinite(given)]
            if finite.size:
                self.max_priority = max(self.max_priority, float(finite.max()))
        else:
            values = np.ones(n)
        offset = 0
        for s0, s1, _ in self._pieces(first, first + n, state):
            part = values[offset : offset + s1 - s0]
            offset += s1 - s0
            if self.store is not None and self.config.prioritized:
                self.store.write_priorities(s0, part)
            if self.times is not None:
                if self.store is not None:
                    self.store.write_times(s0, np.zeros(s1 - s0, np.uint32))
                self.times[s0:s1] = 0
            if self.priorities is not None:
                self.priorities[s0:s1] = part
            self.tree.set_range(s0, self._weights(part))

    def forget(self, first: int, stop: int, state: State) -> None:
        """Undo `added` for rows [first, stop) that a failed commit never made visible."""
        if self.weighted:
            for s0, s1, _ in self._pieces(first, stop, state):
                self.tree.set_range(s0, 0.0, s1 - s0)

    def clear(self) -> None:
        self.tree.clear()
        if self.times is not None:
            self.times[:] = 0
        self.removed = 0

    def _set_priorities(self, ids: np.ndarray, values: np.ndarray, state: State) -> np.ndarray:
        """Returns the slots of `ids`."""
        slots = self._slots(ids, state)
        w = self._weights(values)
        if self.times is not None:
            w = np.where(self.times[slots] >= self.config.max_times_sampled, 0.0, w)
        self.tree.set(slots, w)
        if self.priorities is not None:
            self.priorities[slots] = values
        return slots

    def update(self, ids: np.ndarray, values: np.ndarray, state: State) -> tuple[int, int]:
        """Set the priorities of rows `ids` (checked: held or older); logs every held one.

        Returns (entries logged, ids ignored: no longer held or removed). The log entries stay in
        memory until `write_log` (every publish calls it first): an update costs no file write."""
        if not self.config.prioritized:
            raise ConfigError(f"this buffer's sampler is {self.config.sampler!r}: only a Prioritized sampler keeps "
                              "priorities (choose it when the file is created)")
        held = (ids >= state.begin) & (ids < state.end)
        if self.times is not None and held.any():
            slots = self._slots(np.where(held, ids, state.begin), state)
            held &= self.times[slots] < self.config.max_times_sampled
        if not held.all():
            ids, values = ids[held], values[held]
        ignored = int(held.shape[0] - ids.shape[0])
        self.ignored_updates += ignored
        if ids.size:
            if self.store is not None:
                if self._pending_count >= _PENDING_ENTRIES:
                    self.write_log()  # first: if the file refuses, nothing of this update is applied
                if not self._pending:
                    self._pending_at = self.counters(state).plog
                self._pending.append((ids, values))
                self._pending_count += ids.shape[0]
            self.max_priority = max(self.max_priority, float(values.max()))
            slots = self._set_priorities(ids, values, state)
            self._dirty_chunks[slots // _CHECKPOINT_CHUNK] = True
        return int(ids.shape[0]), ignored

    def before_publish(self, seq: int) -> None:
        """Write what publish `seq` counts, before its state row: the log entries of the updates
        so far and the running maximum priority (when it changed).

        Raises:
            StorageError: the file refused them (the publish must not happen).
        """
        self.write_log()
        if self.store is not None and self.config.prioritized:
            self.store.write_max(seq, self.max_priority)

    def write_log(self) -> None:
        """Write the log entries of the updates so far to the file (not yet published).

        Raises:
            StorageError: the file refused them (they stay waiting).
        """
        if not self._pending or self.store is None:
            return
        pending = self._pending
        ids = np.concatenate([p[0] for p in pending]) if len(pending) > 1 else pending[0][0]
        values = np.concatenate([p[1] for p in pending]) if len(pending) > 1 else pending[0][1]
        self.store.write_log(self._pending_at, ids, values)
        self._pending, self._pending_count = [], 0

    def drop_log(self) -> None:
        """Forget the log entries not yet written (the buffer went back to its last publish)."""
        self._pending, self._pending_count = [], 0

    def checkpoint(self) -> None:
        """Write every priority updated since the last checkpoint into the priorities dataset."""
        chunks = np.flatnonzero(self._dirty_chunks)
        self._dirty_chunks[:] = False
        if self.store is None or self.priorities is None:
            return
        for chunk in chunks.tolist():
            s0 = chunk * _CHECKPOINT_CHUNK
            self.store.write_priorities(s0, self.priorities[s0 : s0 + _CHECKPOINT_CHUNK])

    def priorities_of(self, ids: np.ndarray, state: State) -> np.ndarray:
        """The current priorities of held rows `ids`."""
        if self.priorities is None:
            raise ConfigError(f"this buffer's sampler is {self.config.sampler!r}: only a Prioritized sampler keeps "
                              "priorities")
        values: np.ndarray = self.priorities[self._slots(ids, state)]  # fancy indexing copies
        return values

    def mark_sampled(self, ids: np.ndarray, state: State) -> None:
        """Count a sample of `ids` (each at most once per batch): rows reaching
        max_times_sampled are removed (never drawn again)."""
        if self.times is None or ids.size == 0:
            return
        slots = np.unique(self._slots(ids, state))
        times = self.times[slots] + 1
        self.times[slots] = times
        done = slots[times >= self.config.max_times_sampled]
        if done.size:
            self.tree.set(done, 0.0)
            self.removed += int(done.size)
        if self.store is not None:
            self.store.write_times_at(slots, times)

    def counts(self, first: int, stop: int, state: State) -> np.ndarray:
        """How often rows [first, stop) were sampled (zeros without max_times_sampled)."""
        out = np.zeros(max(0, stop - first), np.uint32)
        if not self.config.removes:
            return out
        for s0, s1, id0 in self._pieces(first, stop, state):
            at = id0 - first
            if self.times is not None:
                out[at : at + s1 - s0] = self.times[s0:s1]
            elif self.store is not None:
                out[at : at + s1 - s0] = self.store.read_times(s0, s1)
        return out

    def set_counts(self, first: int, counts: np.ndarray, state: State) -> None:
        """Writer: rows [first, first + len(counts)) were sampled that often (an export carries
        them): those at max_times_sampled leave the draws, as `mark_sampled` makes them."""
        if self.times is None or counts.size == 0:
            return
        offset = 0
        for s0, s1, _ in self._pieces(first, first + counts.shape[0], state):
            part = counts[offset : offset + s1 - s0]
            offset += s1 - s0
            done_before = int(np.count_nonzero(self.times[s0:s1] >= self.config.max_times_sampled))
            self.times[s0:s1] = part
            done = part >= self.config.max_times_sampled
            self.removed += int(np.count_nonzero(done)) - done_before
            if done.any():
                self.tree.set(s0 + np.flatnonzero(done), 0.0)
            if self.store is not None:
                self.store.write_times(s0, part)

    def first_held(self, state: State) -> int:
        """The id of the oldest row not removed (state.end if none): `begin` may move there."""
        if self.times is None or state.length == 0:
            return state.begin
        for s0, s1, first in self._pieces(state.begin, state.end, state):
            alive = np.flatnonzero(self.times[s0:s1] < self.config.max_times_sampled)
            if alive.size:
                return first + int(alive[0])
        return state.end

    # ------------------------------------------------------------------ draws

    def draw(self, state: State, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """(row ids, probabilities) of `n` rows drawn by the sampler from `state`.

        Raises:
            NotEnoughDataError: nothing to draw from, or (without replacement) fewer than n rows.
        """
        if state.length == 0:
            raise NotEnoughDataError("cannot sample from an empty replay buffer")
        return self.config.sampler.draw(_Held(self, state), n, rng)

    def _find_in_order(self, state: State, targets: np.ndarray) -> np.ndarray:
        """Slots at cumulative weights `targets`, counted from the oldest row held (id order)."""
        if self.capacity is None:
            base = self.tree.prefix(np.array([state.begin - state.origin]))[0]
            return self.tree.find(base + targets)
        b = state.begin % self.capacity
        base = self.tree.prefix(np.array([b]))[0]
        head = self.tree.total - base
        return np.where(targets < head, self.tree.find(np.minimum(base + targets, self.tree.total)),
                        self.tree.find(np.maximum(targets - head, 0.0)))

    def _range_sums(self, first: np.ndarray, stop: np.ndarray, state: State) -> np.ndarray:
        """Sum of the weights of ids [first, stop) for each pair (ids held)."""
        n = stop - first
        if self.capacity is None:
            s = first - state.origin
            sums: np.ndarray = np.maximum(self.tree.range_sums(s, s + n), 0.0)
            return sums
        s = first % self.capacity
        e = s + n
        head = self.tree.range_sums(s, np.minimum(e, self.capacity))
        tail = self.tree.range_sums(np.zeros_like(s), np.maximum(e - self.capacity, 0))
        out: np.ndarray = np.maximum(head + tail, 0.0)
        return out

    def draw_windows(
        self, state: State, starts: np.ndarray, lengths: np.ndarray, steps: int, n: int, rng: np.random.Generator,
        pad: bool = False,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(window start ids, index into the episodes, probabilities) of `n` windows of `steps`
        rows, each inside one of the episodes (`starts`, `lengths`), drawn by the sampler
        (uniform over all windows, by the priority of the window's first row, ...). `pad`: a
        window may start at any row of its episode (it is padded past the episode's end).

        Raises:
            NotEnoughDataError: no window fits, or every window's first row has priority 0.
            ConfigError: the sampler cannot draw windows (fifo / lifo, or rows being removed).
        """
        if self.config.ordered or self.config.removes:
            raise ConfigError("sample_sequences draws windows by chance or by priority; a Fifo / Lifo sampler or "
                              "max_times_sampled hands out rows: use sample(), or commit each unroll as an episode")
        windows = np.asarray(lengths, np.int64) if pad else np.maximum(lengths - steps + 1, 0)
        if not windows.any():
            raise NotEnoughDataError(f"no complete episode holds {steps} consecutive rows ({len(lengths)} "
                                     f"episodes, longest {int(lengths.max()) if len(lengths) else 0})")
        return self.config.sampler.draw_windows(_Held(self, state), starts, windows, n, rng)


class _Held:
    """The rows of one state as a table's sampler sees them (`h5replay.samplers.Rows`)."""

    def __init__(self, table: Sampling, state: State) -> None:
        self._table, self._state = table, state
        self.begin, self.end = state.begin, state.end
        self.sampleable = table.sampleable(state)
        self.removing = table.config.removes and table.weighted
        self.tree = table.tree if table.weighted else None

    def ids(self, slots: np.ndarray) -> np.ndarray:
        return self._table._ids(slots, self._state)

    def slots(self, ids: np.ndarray) -> np.ndarray:
        return self._table._slots(ids, self._state)

    def in_order(self, targets: np.ndarray) -> np.ndarray:
        return self._table._find_in_order(self._state, targets)

    def range_sums(self, first: np.ndarray, stop: np.ndarray) -> np.ndarray:
        return self._table._range_sums(first, stop, self._state)


_CHECKPOINT_CHUNK = 4096  # priorities rewritten per dirty chunk at a checkpoint
_PENDING_ENTRIES = 1 << 16  # log entries kept in memory at most before they are written (1 MiB)
