"""SegmentWriter: streams one segment into the file and publishes it at commit.

A writer keeps at most one block of rows in memory (about `segment_buffer_bytes`). That block
starts small (about 64 KiB of rows) and doubles as rows come, while the staging's memory budget
(`memory_bytes`, shared by every writer of the storage) allows; when it is full, or may not
grow, its rows are written to a free block of the file's hidden staging datasets
(`/_h5replay/staging/<leaf>`), so memory stays flat however long the episode grows and however
many segments are open. `commit` copies the staged blocks and the in-memory tail to their final
rows; until then nothing of the segment is visible through `get`. `abort` returns the blocks to
the free list.

The staging datasets are created with the file (SWMR forbids new objects later) and only ever
grow; a block is a range of `block_rows` rows in every staging dataset, of which a spill may
fill only the first ones. Blocks are handed out per process: staging contents do not survive a
reopen, and need not.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import h5py
import numpy as np

from h5replay.errors import SegmentStateError, SpaceMismatchError, StorageError
from h5replay.priorities import Given, PriorityColumns, check_given_priorities, one_row_priorities
from h5replay.spaces import LeafSpace, Schema
from h5replay.storage._h5file import h5_errors
from h5replay.storage._rowio import read_slice, write_rows

__all__ = ["SegmentWriter", "Staging", "StagingArea", "SegmentTarget"]

_SPARE_BUFFERS = 2
_FIRST_BLOCK_BYTES = 64 * 1024  # a writer's first block in memory; it doubles up to block_rows


class StagingArea(Protocol):
    """Where a segment writer keeps its rows until commit: blocks of `block_rows` rows, and in
    memory a block per writer that grows from `first_rows` rows while the budget allows (`reserve`;
    `in_memory` bytes of `row_bytes` a row are counted against it)."""

    block_rows: int
    first_rows: int
    row_bytes: int
    in_memory: int
    names: tuple[str, ...]

    def reserve(self, rows: int) -> bool: ...
    def unreserve(self, rows: int) -> None: ...
    def take_buffers(self, rows: int) -> dict[str, np.ndarray]: ...
    def take_spare(self) -> dict[str, np.ndarray] | None: ...
    def give_buffers(self, buffers: dict[str, np.ndarray]) -> None: ...
    def allocate(self) -> int: ...
    def release(self, blocks: list[int]) -> None: ...
    def write(self, block: int, arrays: Mapping[str, np.ndarray]) -> None: ...
    def read(self, block: int, first: int, stop: int) -> dict[str, np.ndarray]: ...


class SegmentTarget(Protocol):
    """What a segment writer needs of its storage (HDF5Storage is one)."""

    capacity: int | None
    schema: Schema  # how samples are checked and encoded

    def __len__(self) -> int: ...
    def write_ring(self, start: int, encoded: Mapping[str, np.ndarray]) -> None: ...
    def extend_length(self, length: int) -> None: ...
    def _require_mutable(self, what: str) -> None: ...


class Staging:
    """The free list of staging blocks of one open storage, over its staging datasets, and the
    memory budget of its writers' blocks (`memory_bytes`; None: no limit)."""

    def __init__(self, datasets: dict[str, h5py.Dataset], leaves: list[tuple[str, LeafSpace]], buffer_bytes: int,
                 memory_bytes: int | None = None) -> None:
        self.datasets = datasets
        self.names = tuple(datasets)
        self._leaves = leaves
        self.row_bytes = max(1, sum(leaf.row_bytes for _, leaf in leaves))
        self.block_rows = max(1, buffer_bytes // self.row_bytes)
        self.first_rows = max(1, min(self.block_rows, _FIRST_BLOCK_BYTES // self.row_bytes))
        self.memory_bytes = memory_bytes
        self.in_memory = 0  # bytes of writers' blocks held now (spares included)
        rows = min(ds.shape[0] for ds in datasets.values())
        self.num_blocks = rows // self.block_rows
        self._free = list(range(self.num_blocks - 1, -1, -1))
        # Writers' blocks kept for the next writers, smallest first: fresh pages cost a fault
        # each to touch, and a block grown by doubling copies its rows at every step.
        self._spare_buffers: list[dict[str, np.ndarray]] = []

    def reserve(self, rows: int) -> bool:
        """Count `rows` more rows of a writer's block against the budget; False when over it
        (spare blocks are freed first to make room)."""
        size = rows * self.row_bytes
        while self.memory_bytes is not None and self.in_memory + size > self.memory_bytes and self._spare_buffers:
            self._free_spare(self._spare_buffers.pop(0))
        if self.memory_bytes is not None and self.in_memory + size > self.memory_bytes:
            return False
        self.in_memory += size
        return True

    def unreserve(self, rows: int) -> None:
        self.in_memory = max(0, self.in_memory - rows * self.row_bytes)

    def take_buffers(self, rows: int) -> dict[str, np.ndarray]:
        """A block of `rows` rows per leaf, in memory (already reserved by the caller)."""
        return {path: np.empty((rows, *leaf.shape), dtype=leaf.storage_dtype) for path, leaf in self._leaves}

    def take_spare(self) -> dict[str, np.ndarray] | None:
        """The largest block kept from a writer that ended (still counted), or None."""
        return self._spare_buffers.pop() if self._spare_buffers else None

    def give_buffers(self, buffers: dict[str, np.ndarray]) -> None:
        """Take back a writer's block. The largest ones beyond the first size are kept as spares
        (smallest first), so the next writers start at the size the last ones grew to."""
        if _rows_of(buffers) <= self.first_rows:
            self._free_spare(buffers)
            return
        self._spare_buffers.append(buffers)
        self._spare_buffers.sort(key=_rows_of)
        if len(self._spare_buffers) > _SPARE_BUFFERS:
            self._free_spare(self._spare_buffers.pop(0))

    def _free_spare(self, buffers: dict[str, np.ndarray]) -> None:
        self.unreserve(_rows_of(buffers))

    def allocate(self) -> int:
        if self._free:
            return self._free.pop()
        block = self.num_blocks
        with h5_errors("growing the staging area"):
            for ds in self.datasets.values():
                if ds.shape[0] < (block + 1) * self.block_rows:
                    ds.resize((block + 1) * self.block_rows, axis=0)
        self.num_blocks += 1
        return int(block)

    def release(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    def write(self, block: int, arrays: Mapping[str, np.ndarray]) -> None:
        """Write rows at the start of `block` (a spill may fill only part of it)."""
        with h5_errors("staging segment rows"):
            for path, arr in arrays.items():
                ds = self.datasets[path]
                if not write_rows(ds, block * self.block_rows, arr):
                    ds[block * self.block_rows : block * self.block_rows + arr.shape[0]] = arr

    def read(self, block: int, first: int, stop: int) -> dict[str, np.ndarray]:
        base = block * self.block_rows
        with h5_errors("reading staged rows"):
            return {path: read_slice(ds, base + first, base + stop) for path, ds in self.datasets.items()}


def _rows_of(buffers: dict[str, np.ndarray]) -> int:
    return next(iter(buffers.values())).shape[0] if buffers else 0


class SegmentWriter:
    """Builds one segment off to the side; `commit(start_index)` publishes it, `abort()` drops it.

    Memory stays bounded (one block of rows) however long the segment grows. Any number of
    writers may be open on a storage and commit in any order. Not thread-safe. As a context
    manager it aborts on exit unless it was committed.

    `append` checks each sample's keys, dtypes and shapes at once, and the values of a Box (its
    bounds, NaN) once per block of appended rows, vectorised: before the block is spilled or
    grown, before an `extend`, and at `commit`, with the storage's `check_bounds`. A bad value
    found there raises SpaceMismatchError naming its row; the writer keeps the rows before it.
    """

    def __init__(self, storage: SegmentTarget, staging: StagingArea) -> None:
        self.storage = storage
        self._staging = staging
        self._schema = storage.schema  # the storage's checks when the writer was opened
        self._names = self._schema.names
        self._put_exact_row = self._schema.put_exact_row
        self._unchecked = 0  # rows of the block in memory from here on: values not checked yet
        self._columns: list[np.ndarray] = []  # the block's arrays, in the order of self._names
        self._borrowed: dict[str, np.ndarray] | None = None  # every row, uncopied (extend_stored(borrow=True))
        self._buffers: dict[str, np.ndarray] | None = None
        self._capacity = 0  # rows the block in memory holds (0: none yet)
        self._buffered = 0
        self._blocks: list[tuple[int, int]] = []  # (staging block, rows written in it), in order
        self.length = 0
        # append's fast path may fill the block up to this row: the block's capacity while the
        # writer is open, unfinished and without priorities, else 0 (then append takes the long way).
        self._fast_stop = 0
        self._finished = False
        self._state = "open"  # open | committed | aborted | invalid
        self._why_invalid = ""
        self._priorities: PriorityColumns | None = None  # once a row is given one
        #: How the buffer this writer will commit to splits priorities by table and checks each
        #: table's bound (`ReplayBuffer.open_segment_writer` sets it), so they are checked as they
        #: come. None: counts and values now, the tables at commit.
        self.split_priorities: Callable[[Any, int, bool], Mapping[str, np.ndarray]] | None = None

    def __len__(self) -> int:
        return self.length

    @property
    def is_finished(self) -> bool:
        """True once `finish`, `commit` or `abort` refused further rows."""
        return self._finished

    @is_finished.setter
    def is_finished(self, value: bool) -> None:
        self._finished = bool(value)
        self._reset_fast_stop()

    def _reset_fast_stop(self) -> None:
        fast = self._state == "open" and not self._finished and self._priorities is None
        self._fast_stop = self._capacity if fast else 0

    def __repr__(self) -> str:
        return f"<SegmentWriter {self._state}, {self.length} rows>"

    @property
    def priorities(self) -> Given | None:
        """The priorities given with the rows, by table (None: every prioritized table), one per
        row (NaN: none, the table's default); None if no row was given one. A prioritized table
        uses them at commit; others ignore them."""
        return None if self._priorities is None else self._priorities.rows(self.length)

    def _note_priorities(self, priorities: Any, n: int, missing_ok: bool = False) -> Mapping[str | None, np.ndarray] | None:
        """Check `priorities` for the next n rows, before anything is stored (None: none given)."""
        if priorities is None:
            return None
        if self.split_priorities is not None:
            return self.split_priorities(priorities, n, missing_ok) or None  # type: ignore[return-value]
        return check_given_priorities(priorities, n, missing_ok=missing_ok)

    def _keep_priorities(self, first: int, values: Mapping[str | None, np.ndarray] | None, n: int) -> None:
        if not values and self._priorities is None:
            return
        if self._priorities is None:
            self._priorities = PriorityColumns()
            self._reset_fast_stop()  # rows with priorities take the long way from now on
        self._priorities.put(first, n, values)

    @property
    def state(self) -> str:
        """'open', 'committed', 'aborted' or 'invalid' (its storage was closed)."""
        return self._state

    def _require_open(self, what: str) -> None:
        if self._state != "open":
            reason = self._why_invalid if self._state == "invalid" else f"it was {self._state}"
            raise SegmentStateError(f"cannot {what} this segment writer: {reason}")

    # ------------------------------------------------------------------ adding rows

    def append(self, value: Any, priority: float | Mapping[str, float] | None = None) -> None:
        """Add one sample (with its `priority` for every prioritized table, or by table name:
        `{"replay": 2.0}`). Its keys, dtypes and
        shapes are checked before anything is stored; its Box values with the block's (see the
        class). Samples of exactly the stored dtypes and shapes (a dict of ndarrays) take the fast
        path: no conversion, a row copy per leaf.

        Raises:
            SpaceMismatchError: the sample does not fit the space (the writer is unchanged); or a
                value appended earlier in this block is out of its bounds (the writer keeps the
                rows before it; this sample is not added either).
            ConfigError: the priority is not a finite number >= 0, or beyond the buffer's bound
                (`Prioritized.priority_limit`; the writer is unchanged).
            SegmentStateError: the writer was finished, committed or aborted.
        """
        row = self._buffered
        if row < self._fast_stop and priority is None:
            # The per-step hot path: a sample of exactly the stored dtypes and shapes, a row
            # free in the block, no priorities: one row copy per leaf and two counters.
            if self._put_exact_row(self._columns, row, value):
                self._buffered = row + 1
                self.length += 1
                return
        self._append(value, priority)

    def _append(self, value: Any, priority: float | Mapping[str, float] | None) -> None:
        """append's long way: checks the writer's state, converts, makes room, keeps priorities."""
        if self._state != "open" or self.is_finished:
            self._require_open("append to")
            raise SegmentStateError("cannot append to a finished segment writer")
        given = None if priority is None else self._note_priorities(one_row_priorities(priority), 1)
        if self._borrowed is not None:
            self._copy_borrowed()
        row = self._buffered
        if not (row < self._capacity and self._put_exact_row(self._columns, row, value)):
            # Converted and checked before anything changes; a full block is made room for after.
            encoded = self._schema.encode_one(value, check_values=False)
            if self._buffered == self._capacity:
                try:
                    self._make_room()
                except StorageError:
                    self.abort()
                    raise
            row = self._buffered
            for column, name in zip(self._columns, self._names):
                column[row] = encoded[name][0]
        if given is not None or self._priorities is not None:
            self._keep_priorities(self.length, given, 1)
        self._buffered = row + 1
        self.length += 1

    def extend(self, batch: Any, priorities: Any = None) -> None:
        """Add a batch of samples (a leading axis on every leaf), with one priority per row if
        given; all or nothing on bad input."""
        self._require_open("extend")
        if self.is_finished:
            raise SegmentStateError("cannot extend a finished segment writer")
        encoded, n = self._schema.encode_batch(batch)
        self._push(encoded, n, self._note_priorities(priorities, n))

    def extend_stored(self, arrays: Mapping[str, np.ndarray], num_rows: int, priorities: Any = None, *,
                      borrow: bool = False) -> None:
        """Add rows that are already in storage form and checked against the space, one array per
        leaf path (the server uses this for arrays off the wire, checked by `validate_stored`);
        `priorities` may hold NaN for rows given none.

        `borrow`: when the writer holds no rows yet, keep `arrays` themselves, uncopied, until
        the commit writes them (or until more rows come, which copies them into the block); the
        caller must leave them unchanged meanwhile. A whole episode received in one message then
        goes from the received frames straight into the file."""
        self._require_open("extend")
        if self.is_finished:
            raise SegmentStateError("cannot extend a finished segment writer")
        given = self._note_priorities(priorities, num_rows, missing_ok=True)
        ordered = {name: arrays[name] for name in self._staging.names}
        if borrow and num_rows > 0 and self.length == 0 and self._buffers is None and not self._blocks:
            if given is not None:
                self._keep_priorities(0, given, num_rows)
            self._borrowed = ordered
            self.length = num_rows
            return
        self._push(ordered, num_rows, given)

    def _copy_borrowed(self) -> None:
        """More rows come after borrowed ones: copy those into the block first (in order)."""
        borrowed, n = self._borrowed, self.length
        if borrowed is None:
            return
        self._borrowed = None
        self.length = 0
        kept = self._priorities
        self._push(borrowed, n, None if kept is None else {t: p.copy() for t, p in kept.rows(n).items()})

    def _push(self, encoded: Mapping[str, np.ndarray], n: int,
              priorities: Mapping[str | None, np.ndarray] | None = None) -> None:
        """Add rows whose values were checked (by encode_batch or validate_stored)."""
        if self._borrowed is not None:
            self._copy_borrowed()
        self._check_values("extend")
        if priorities is not None or self._priorities is not None:
            self._keep_priorities(self.length, priorities, n)
        offset = 0
        try:
            while offset < n:
                if self._buffered == self._capacity:
                    self._make_room()
                buffers = typing.cast("dict[str, np.ndarray]", self._buffers)
                take = min(n - offset, self._capacity - self._buffered)
                for path, arr in encoded.items():
                    buffers[path][self._buffered : self._buffered + take] = arr[offset : offset + take]
                self._buffered += take
                self._unchecked = self._buffered
                offset += take
                self.length += take
        except StorageError:
            # The file could not take the rows: the segment cannot be completed faithfully.
            self.abort()
            raise

    def _check_values(self, what: str) -> None:
        """Check the values of the rows appended to the block since the last check.

        Raises:
            SpaceMismatchError: a value is out of its Box's bounds, or NaN: the rows from its row
                on are dropped (the writer keeps those before it), and the message says so.
        """
        lo, hi = self._unchecked, self._buffered
        if lo >= hi or self._buffers is None:
            return
        first = self.length - self._buffered  # the segment row of the block's first row
        try:
            self._schema.check_values({p: b[lo:hi] for p, b in self._buffers.items()}, first + lo)
        except SpaceMismatchError as exc:
            bad = (exc.row if exc.row is not None else first + lo) - first
            dropped = self._buffered - bad
            self._buffered = self._unchecked = bad
            self.length -= dropped
            raise SpaceMismatchError(
                f"{exc}. Values are checked per block of appended rows, so this {what} found it: the segment "
                f"writer keeps its first {self.length} rows and dropped the {dropped} from that one on; append them "
                "again, or abort"
            ) from None
        self._unchecked = hi

    def _make_room(self) -> None:
        """The block in memory is full (or there is none): grow it, within the memory budget, or
        spill its rows to the file."""
        self._check_values("append")
        staging = self._staging
        if self._buffers is None:
            spare = staging.take_spare()
            if spare is not None:
                self._set_block(spare, _rows_of(spare))
                return
        if self._capacity < staging.block_rows:
            grown = min(staging.block_rows, max(staging.first_rows, 2 * self._capacity))
            if staging.reserve(grown):
                new = staging.take_buffers(grown)
                if self._buffers is not None:  # the outgrown block is freed, not kept as a spare
                    for path, old in self._buffers.items():
                        new[path][: self._buffered] = old[: self._buffered]
                    staging.unreserve(self._capacity)
                self._set_block(new, grown)
                return
            if self._buffers is None:  # over budget: even so a writer needs a row to work with
                staging.in_memory += staging.row_bytes
                self._set_block(staging.take_buffers(1), 1)
                return
        self._spill()

    def _set_block(self, buffers: dict[str, np.ndarray], rows: int) -> None:
        self._buffers, self._capacity = buffers, rows
        self._columns = [buffers[name] for name in self._names]
        self._reset_fast_stop()

    def _spill(self) -> None:
        buffers = typing.cast("dict[str, np.ndarray]", self._buffers)  # _make_room allocated them
        block = self._staging.allocate()
        rows = self._buffered
        try:
            self._staging.write(block, {path: b[:rows] for path, b in buffers.items()})
        except StorageError:
            self._staging.release([block])
            raise
        self._blocks.append((block, rows))
        self._buffered = self._unchecked = 0

    # ------------------------------------------------------------------ ending

    def finish(self) -> None:
        """Refuse further rows; the writer can still be committed. Idempotent."""
        if self._state in ("aborted", "invalid"):
            self._require_open("finish")
        self.is_finished = True

    def commit(self, start_index: int) -> None:
        """Write the segment at rows [start, start + len) (modulo a fixed capacity) and release it.

        A segment longer than the capacity keeps its last `capacity` rows (later rows win, as in
        numpy). On an unbounded storage `start_index` must be within [0, len(storage)] and the
        storage grows to hold the segment. Blocks until the rows are written (not flushed).

        Raises:
            SegmentStateError: already committed or aborted.
            SpaceMismatchError: a value appended since the last check is out of its bounds: the
                writer keeps the rows before it and stays open.
            IndexError: `start_index` leaves a gap in an unbounded storage.
            StorageError: HDF5 failed; the writer is aborted.
        """
        self._require_open("commit")
        self.storage._require_mutable("commit a segment")
        self._check_values("commit")
        start = int(start_index)
        capacity = self.storage.capacity
        if capacity is None and not 0 <= start <= len(self.storage):
            raise IndexError(f"segment start {start} is out of range for an unbounded storage of {len(self.storage)} rows")
        self.is_finished = True
        n = self.length
        skip = n - capacity if capacity is not None and n > capacity else 0
        try:
            if capacity is None and start + n > len(self.storage):
                self.storage.extend_length(start + n - len(self.storage))
            if self._borrowed is not None:  # then the writer's only rows
                self.storage.write_ring(start + skip, {p: a[skip:n] for p, a in self._borrowed.items()})
            first = 0
            for block, rows in self._blocks:
                stop = first + rows
                if stop > skip:
                    lo = max(first, skip) - first
                    self.storage.write_ring(start + first + lo, self._staging.read(block, lo, rows))
                first = stop
            tail_first = first
            if self._buffered and self._buffers is not None:
                lo = max(tail_first, skip) - tail_first
                arrays = {p: b[lo : self._buffered] for p, b in self._buffers.items()}
                self.storage.write_ring(start + tail_first + lo, arrays)
        except BaseException:
            self._release()
            self._state = "aborted"
            raise
        self._release()
        self._state = "committed"

    def abort(self) -> None:
        """Drop the segment: nothing of it becomes visible. Idempotent; refused after commit."""
        if self._state == "committed":
            raise SegmentStateError("cannot abort a segment writer that was committed")
        if self._state == "open":
            self._release()
            self._state = "aborted"
        self.is_finished = True

    def _release(self) -> None:
        if self._blocks:
            self._staging.release([block for block, _ in self._blocks])
        if self._buffers is not None:
            self._staging.give_buffers(self._buffers)
        self._blocks = []
        self._buffers = None
        self._borrowed = None
        self._columns = []
        self._capacity = self._fast_stop = 0
        self._buffered = self._unchecked = 0

    def _invalidate(self, reason: str) -> None:
        if self._state == "open":
            self._blocks = []
            self._buffers = None
            self._borrowed = None
            self._columns = []
            self._capacity = self._fast_stop = 0
            self._state = "invalid"
            self._why_invalid = reason

    def __enter__(self) -> SegmentWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._state == "open":
            self.abort()

