"""SegmentWriter: streams one segment into the file and publishes it at commit.

A writer keeps at most one block of rows in memory (about `segment_buffer_bytes`). When the
block fills it is written to a free block of the file's hidden staging datasets
(`/_h5replay/staging/<leaf>`), so memory stays flat however long the episode grows. `commit`
copies the staged blocks and the in-memory tail to their final rows; until then nothing of the
segment is visible through `get`. `abort` returns the blocks to the free list.

The staging datasets are created with the file (SWMR forbids new objects later) and only ever
grow; a block is a range of `block_rows` rows in every staging dataset. Blocks are handed out
per process: staging contents do not survive a reopen, and need not.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Any, Protocol

import h5py
import numpy as np

from h5replay.errors import SegmentStateError, StorageError
from h5replay.sampling import check_priorities
from h5replay.spaces import LeafSpace
from h5replay.storage._h5file import h5_errors
from h5replay.storage._rowio import read_slice, write_rows

__all__ = ["SegmentWriter", "Staging", "StagingArea", "SegmentTarget"]

_SPARE_BUFFERS = 2


class StagingArea(Protocol):
    """Where a segment writer keeps its rows until commit: blocks of `block_rows` rows."""

    block_rows: int
    names: tuple[str, ...]

    def take_buffers(self) -> dict[str, np.ndarray]: ...
    def give_buffers(self, buffers: dict[str, np.ndarray]) -> None: ...
    def allocate(self) -> int: ...
    def release(self, blocks: list[int]) -> None: ...
    def write(self, block: int, arrays: Mapping[str, np.ndarray]) -> None: ...
    def read(self, block: int, first: int, stop: int) -> dict[str, np.ndarray]: ...


class SegmentTarget(Protocol):
    """What a segment writer needs of its storage (HDF5Storage is one)."""

    capacity: int | None

    def __len__(self) -> int: ...
    def encode_one(self, sample: Any) -> dict[str, np.ndarray]: ...
    def encode_batch(self, batch: Any, num_rows: int | None = None) -> tuple[dict[str, np.ndarray], int]: ...
    def write_ring(self, start: int, encoded: Mapping[str, np.ndarray]) -> None: ...
    def extend_length(self, length: int) -> None: ...
    def _require_mutable(self, what: str) -> None: ...


class Staging:
    """The free list of staging blocks of one open storage, over its staging datasets."""

    def __init__(self, datasets: dict[str, h5py.Dataset], leaves: list[tuple[str, LeafSpace]], buffer_bytes: int) -> None:
        self.datasets = datasets
        self.names = tuple(datasets)
        self._leaves = leaves
        row_bytes = sum(leaf.row_bytes for _, leaf in leaves)
        self.block_rows = max(1, buffer_bytes // max(1, row_bytes))
        rows = min(ds.shape[0] for ds in datasets.values())
        self.num_blocks = rows // self.block_rows
        self._free = list(range(self.num_blocks - 1, -1, -1))
        # Writers' memory blocks, kept for the next writer: fresh pages cost a fault each to touch.
        self._spare_buffers: list[dict[str, np.ndarray]] = []

    def take_buffers(self) -> dict[str, np.ndarray]:
        """One block of rows per leaf, in memory, for a writer."""
        if self._spare_buffers:
            return self._spare_buffers.pop()
        return {path: np.empty((self.block_rows, *leaf.shape), dtype=leaf.storage_dtype) for path, leaf in self._leaves}

    def give_buffers(self, buffers: dict[str, np.ndarray]) -> None:
        if len(self._spare_buffers) < _SPARE_BUFFERS:
            self._spare_buffers.append(buffers)

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
        with h5_errors("staging segment rows"):
            for path, arr in arrays.items():
                ds = self.datasets[path]
                if not write_rows(ds, block * self.block_rows, arr):
                    ds[block * self.block_rows : block * self.block_rows + arr.shape[0]] = arr

    def read(self, block: int, first: int, stop: int) -> dict[str, np.ndarray]:
        base = block * self.block_rows
        with h5_errors("reading staged rows"):
            return {path: read_slice(ds, base + first, base + stop) for path, ds in self.datasets.items()}


class SegmentWriter:
    """Builds one segment off to the side; `commit(start_index)` publishes it, `abort()` drops it.

    Memory stays bounded (one block of rows) however long the segment grows. Any number of
    writers may be open on a storage and commit in any order. Not thread-safe. As a context
    manager it aborts on exit unless it was committed.
    """

    def __init__(self, storage: SegmentTarget, staging: StagingArea) -> None:
        self.storage = storage
        self._staging = staging
        self._block_rows = staging.block_rows
        self._buffers: dict[str, np.ndarray] | None = None
        self._buffered = 0
        self._blocks: list[int] = []
        self.length = 0
        self.is_finished = False
        self._state = "open"  # open | committed | aborted | invalid
        self._why_invalid = ""
        self._priorities: np.ndarray | None = None  # per row, NaN where none was given

    def __len__(self) -> int:
        return self.length

    def __repr__(self) -> str:
        return f"<SegmentWriter {self._state}, {self.length} rows>"

    @property
    def priorities(self) -> np.ndarray | None:
        """The priority given with each row (NaN: none, the buffer's default), or None if no row
        was given one. A prioritized buffer uses them at commit; others ignore them."""
        return None if self._priorities is None else self._priorities[: self.length]

    def _note_priorities(self, priorities: Any, n: int, missing_ok: bool = False) -> np.ndarray | None:
        """Check `priorities` for the next n rows, before anything is stored (None: none given)."""
        if priorities is None:
            return None
        return check_priorities(priorities, n, missing_ok=missing_ok)

    def _keep_priorities(self, first: int, values: np.ndarray | None, n: int) -> None:
        if values is None and self._priorities is None:
            return
        need = first + n
        if self._priorities is None or self._priorities.shape[0] < need:
            size = max(need, 2 * (0 if self._priorities is None else self._priorities.shape[0]), 64)
            grown = np.full(size, np.nan)
            if self._priorities is not None:
                grown[: first] = self._priorities[:first]
            self._priorities = grown
        self._priorities[first:need] = np.nan if values is None else values

    @property
    def state(self) -> str:
        """'open', 'committed', 'aborted' or 'invalid' (its storage was closed)."""
        return self._state

    def _require_open(self, what: str) -> None:
        if self._state != "open":
            reason = self._why_invalid if self._state == "invalid" else f"it was {self._state}"
            raise SegmentStateError(f"cannot {what} this segment writer: {reason}")

    # ------------------------------------------------------------------ adding rows

    def append(self, value: Any, priority: float | None = None) -> None:
        """Add one sample (with its `priority`, for a prioritized buffer). Validated before
        anything is stored.

        Raises:
            SpaceMismatchError: the sample does not fit the space (the writer is unchanged).
            ConfigError: the priority is not a finite number >= 0 (the writer is unchanged).
            SegmentStateError: the writer was finished, committed or aborted.
        """
        if self._state != "open" or self.is_finished:
            self._require_open("append to")
            raise SegmentStateError("cannot append to a finished segment writer")
        given = self._note_priorities(None if priority is None else [priority], 1)
        encoded = self.storage.encode_one(value)
        if given is not None or self._priorities is not None:
            self._keep_priorities(self.length, given, 1)
        # The per-step hot path: one row straight into the block, no batch bookkeeping.
        buffers = self._buffers
        if buffers is None:
            buffers = self._buffers = self._staging.take_buffers()
        row = self._buffered
        for path, arr in encoded.items():
            buffers[path][row] = arr[0]
        self._buffered = row + 1
        self.length += 1
        if self._buffered == self._block_rows:
            try:
                self._spill()
            except StorageError:
                self.abort()
                raise

    def extend(self, batch: Any, priorities: Any = None) -> None:
        """Add a batch of samples (a leading axis on every leaf), with one priority per row if
        given; all or nothing on bad input."""
        self._require_open("extend")
        if self.is_finished:
            raise SegmentStateError("cannot extend a finished segment writer")
        encoded, n = self.storage.encode_batch(batch)
        self._push(encoded, n, self._note_priorities(priorities, n))

    def extend_stored(self, arrays: Mapping[str, np.ndarray], num_rows: int, priorities: Any = None) -> None:
        """Add rows that are already in storage form and checked against the space, one array per
        leaf path (the server uses this for arrays off the wire, checked by `validate_stored`);
        `priorities` may hold NaN for rows given none."""
        self._require_open("extend")
        if self.is_finished:
            raise SegmentStateError("cannot extend a finished segment writer")
        given = self._note_priorities(priorities, num_rows, missing_ok=True)
        self._push({name: arrays[name] for name in self._staging.names}, num_rows, given)

    def _push(self, encoded: Mapping[str, np.ndarray], n: int, priorities: np.ndarray | None = None) -> None:
        if priorities is not None or self._priorities is not None:
            self._keep_priorities(self.length, priorities, n)
        if self._buffers is None:
            self._buffers = self._staging.take_buffers()
        offset = 0
        try:
            while offset < n:
                take = min(n - offset, self._block_rows - self._buffered)
                for path, arr in encoded.items():
                    self._buffers[path][self._buffered : self._buffered + take] = arr[offset : offset + take]
                self._buffered += take
                offset += take
                self.length += take
                if self._buffered == self._block_rows:
                    self._spill()
        except StorageError:
            # The file could not take the rows: the segment cannot be completed faithfully.
            self.abort()
            raise

    def _spill(self) -> None:
        buffers = typing.cast("dict[str, np.ndarray]", self._buffers)  # _push allocated them
        block = self._staging.allocate()
        try:
            self._staging.write(block, buffers)
        except StorageError:
            self._staging.release([block])
            raise
        self._blocks.append(block)
        self._buffered = 0

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
            IndexError: `start_index` leaves a gap in an unbounded storage.
            StorageError: HDF5 failed; the writer is aborted.
        """
        self._require_open("commit")
        self.storage._require_mutable("commit a segment")
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
            for k, block in enumerate(self._blocks):
                first, stop = k * self._block_rows, (k + 1) * self._block_rows
                if stop <= skip:
                    continue
                lo = max(first, skip) - first
                self.storage.write_ring(start + first + lo, self._staging.read(block, lo, self._block_rows))
            tail_first = len(self._blocks) * self._block_rows
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
            self._staging.release(self._blocks)
        if self._buffers is not None:
            self._staging.give_buffers(self._buffers)
        self._blocks = []
        self._buffers = None
        self._buffered = 0

    def _invalidate(self, reason: str) -> None:
        if self._state == "open":
            self._blocks = []
            self._buffers = None
            self._state = "invalid"
            self._why_invalid = reason

    def __enter__(self) -> SegmentWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._state == "open":
            self.abort()
