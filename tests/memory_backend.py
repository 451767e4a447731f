"""An in-memory storage and journal: a second backend for the storage contract, and a file-less
ReplayBuffer for fast unit tests of the server's request handling.

Test code, not part of the library: it keeps rows in numpy arrays, staged segment rows in a dict,
and the journal's state and episode records in memory. It must pass the same contract tests as
HDF5Storage (tests/unit/test_storage_contract.py); where it cannot (files, SWMR, pickling by
name), the contract says so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from h5replay.errors import ClosedError, ConfigError, ReadOnlyError
from h5replay.spaces import Schema, Space
from h5replay.storage._indices import normalize_index
from h5replay.storage.replay.buffer import ReplayBuffer
from h5replay.storage.replay.journal import EpisodeTable, State
from h5replay.storage.segment import SegmentWriter

_SPARE = 2


class MemoryStaging:
    """Segment writers' blocks, kept in a dict instead of the file's staging datasets."""

    def __init__(self, schema: Schema, block_rows: int) -> None:
        self._schema = schema
        self.block_rows = block_rows
        self.row_bytes = max(1, sum(leaf.row_bytes for _, leaf in schema.leaves))
        self.first_rows = max(1, min(block_rows, (64 << 10) // self.row_bytes))
        self.in_memory = 0
        self.names = schema.names
        self._blocks: dict[int, dict[str, np.ndarray]] = {}
        self._free: list[int] = []
        self._next = 0
        self._spare: list[dict[str, np.ndarray]] = []

    # Writers' blocks grow from first_rows as in the file's Staging; memory is not budgeted here.
    def reserve(self, rows: int) -> bool:
        self.in_memory += rows * self.row_bytes
        return True

    def unreserve(self, rows: int) -> None:
        self.in_memory = max(0, self.in_memory - rows * self.row_bytes)

    def take_buffers(self, rows: int) -> dict[str, np.ndarray]:
        if rows == self.block_rows and self._spare:
            return self._spare.pop()
        return {name: np.empty((rows, *leaf.shape), leaf.storage_dtype) for name, leaf in self._schema.leaves}

    def take_spare(self) -> dict[str, np.ndarray] | None:
        return self._spare.pop() if self._spare else None

    def give_buffers(self, buffers: dict[str, np.ndarray]) -> None:
        rows = next(iter(buffers.values())).shape[0] if buffers else 0
        if rows == self.block_rows and len(self._spare) < _SPARE:
            self._spare.append(buffers)
        else:
            self.unreserve(rows)

    def allocate(self) -> int:
        if self._free:
            return self._free.pop()
        self._next += 1
        return self._next - 1

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            self._blocks.pop(block, None)
        self._free.extend(reversed(blocks))

    def write(self, block: int, arrays: Mapping[str, np.ndarray]) -> None:
        self._blocks[block] = {name: np.array(arr, copy=True) for name, arr in arrays.items()}

    def read(self, block: int, first: int, stop: int) -> dict[str, np.ndarray]:
        return {name: arr[first:stop] for name, arr in self._blocks[block].items()}


class MemoryStorage:
    """Rows of one space in numpy arrays; the HDF5Storage contract without a file."""

    multiprocessing = False
    filename: str | None = None

    def __init__(self, space: Space, capacity: int | None, *, segment_buffer_bytes: int = 1 << 20) -> None:
        if capacity is not None and (isinstance(capacity, bool) or int(capacity) < 1):
            raise ConfigError(f"capacity must be a positive int or None, got {capacity!r}")
        self.single_instance_space = space
        self.schema = Schema(space)
        self.capacity = None if capacity is None else int(capacity)
        self.is_mutable = True
        self._closed = False
        rows = self.capacity or 0
        self._columns = {name: np.zeros((rows, *leaf.shape), leaf.storage_dtype) for name, leaf in self.schema.leaves}
        self._len = rows
        self._staging = MemoryStaging(self.schema, max(1, segment_buffer_bytes // max(1, self.schema.row_bytes)))
        self.flushes = 0

    # -- properties ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._len

    @property
    def leaves(self) -> list[tuple[str, Any]]:
        return list(self.schema.leaves)

    @property
    def row_bytes(self) -> int:
        return self.schema.row_bytes

    @property
    def closed(self) -> bool:
        return self._closed

    def _require_mutable(self, what: str) -> None:
        if self._closed:
            raise ClosedError("this storage was closed")
        if not self.is_mutable:
            raise ReadOnlyError(f"cannot {what}: the storage is read-only")

    # -- values ----------------------------------------------------------------------------------

    def encode_batch(self, batch: Any, num_rows: int | None = None) -> tuple[dict[str, np.ndarray], int]:
        return self.schema.encode_batch(batch, num_rows)

    def encode_one(self, sample: Any) -> dict[str, np.ndarray]:
        return self.schema.encode_one(sample)

    def flatten(self, value: Any) -> dict[str, Any]:
        return self.schema.flatten(value)

    def unflatten(self, leaves: Mapping[str, Any]) -> Any:
        return self.schema.unflatten(leaves)

    # -- reading ---------------------------------------------------------------------------------

    def get(self, index: Any) -> Any:
        if self._closed:
            raise ClosedError("this storage was closed")
        return self.read(*normalize_index(index, self._len))

    def read(self, kind: str, where: Any, decode: bool | str = True, row_ids: np.ndarray | None = None) -> Any:
        decode = decode is True  # nothing is compressed here: PACKED reads as stored arrays
        if kind == "int":
            rows = {name: col[where].copy() for name, col in self._columns.items()}
            return self.schema.decode_one(rows) if decode else rows
        if kind == "slice":
            rows = {name: col[where[0] : where[1]].copy() for name, col in self._columns.items()}
        else:
            rows = {name: col[np.asarray(where)] for name, col in self._columns.items()}
        return self.schema.decode(rows) if decode else rows

    def read_leaves(self, paths: Sequence[str], where: np.ndarray) -> dict[str, np.ndarray]:
        return {path: self._columns[path][np.asarray(where)] for path in paths}

    # -- writing ---------------------------------------------------------------------------------

    def set(self, index: Any, value: Any) -> None:
        self._require_mutable("write rows")
        kind, where = normalize_index(index, self._len)
        if kind == "int":
            encoded = self.encode_one(value)
            for name, col in self._columns.items():
                col[where] = encoded[name][0]
            return
        if kind == "slice":
            encoded, _ = self.encode_batch(value, where[1] - where[0])
            for name, col in self._columns.items():
                col[where[0] : where[1]] = encoded[name]
            return
        idx = np.asarray(where)
        flat_value = {name: np.asarray(v) for name, v in self.flatten(value).items()}
        if idx.ndim != 1:
            flat_value = {name: v.reshape((-1,) + v.shape[idx.ndim:]) if v.shape[: idx.ndim] == idx.shape else v
                          for name, v in flat_value.items()}
        encoded, _ = self.encode_batch(self.unflatten(flat_value), idx.size)
        for name, col in self._columns.items():
            col[idx.reshape(-1)] = encoded[name]  # numpy assigns in order: the last duplicate wins

    def write_ring(self, start: int, encoded: Mapping[str, np.ndarray]) -> None:
        n = next(iter(encoded.values())).shape[0] if encoded else 0
        if n == 0:
            return
        if self.capacity is None:
            if start + n > self._len:
                self.extend_length(start + n - self._len)
            for name, col in self._columns.items():
                col[start : start + n] = encoded[name]
            return
        cap = self.capacity
        rows = (np.arange(start, start + n) % cap)[-cap:]
        for name, col in self._columns.items():
            col[rows] = encoded[name][-cap:]

    def extend_length(self, length: int) -> None:
        self._require_mutable("extend the length")
        if self.capacity is not None:
            raise ConfigError(f"cannot extend a storage of fixed capacity {self.capacity}")
        if isinstance(length, bool) or int(length) < 0:
            raise ConfigError(f"length to extend by must be an int >= 0, got {length!r}")
        grown = self._len + int(length)
        for name, col in list(self._columns.items()):
            new = np.zeros((grown, *col.shape[1:]), col.dtype)
            new[: self._len] = col[: self._len]
            self._columns[name] = new
        self._len = grown

    def shrink_length(self, length: int) -> None:
        self._require_mutable("shrink the length")
        if self.capacity is not None:
            raise ConfigError(f"cannot shrink a storage of fixed capacity {self.capacity}")
        if isinstance(length, bool) or not 0 <= int(length) <= self._len:
            raise ConfigError(f"length to shrink by must be an int in [0, {self._len}], got {length!r}")
        self._len -= int(length)
        self._columns = {name: col[: self._len].copy() for name, col in self._columns.items()}

    def clear(self) -> None:
        self._require_mutable("clear")
        if self.capacity is None and self._len:
            self.shrink_length(self._len)

    def open_segment_writer(self) -> SegmentWriter:
        self._require_mutable("open a segment writer")
        return SegmentWriter(self, self._staging)

    # -- durability ------------------------------------------------------------------------------

    def flush(self, fsync: bool = False) -> None:
        self.flushes += 1

    def refresh(self) -> None:
        """Nothing to pick up: there is no other process."""

    def mark_stale(self) -> None:
        """Nothing is cached."""

    def invalidate_maps(self) -> None:
        """Nothing is mapped."""

    def close(self) -> None:
        self._closed = True


class MemoryJournal:
    """A ReplayBuffer's state and episode records, in memory (the JournalStore protocol)."""

    replay_id = "memory"
    configs: dict[str, object] = {}  # the buffer is given its tables
    tables: dict[str, object] = {}  # sampling state in memory only
    keys = None  # idempotency keys: kept by the buffer in memory only

    def __init__(self, storage: MemoryStorage) -> None:
        self.storage = storage
        self._state = State()
        self._records: dict[int, tuple[int, int]] = {}
        self.publishes = 0

    def close(self) -> None:
        """Nothing to release."""

    def read(self) -> State:
        return self._state

    def publish(self, state: State, fsync: bool = False) -> None:
        self.storage.flush(fsync)
        self._state = state
        self.publishes += 1

    def record(self, episode_id: int, slot: int, start: int, length: int) -> None:
        self._records[episode_id] = (start, length)

    def load(self, table: EpisodeTable, state: State) -> None:
        table.origin = state.ep_origin
        table.set_range(state.ep_begin, state.ep_begin)
        records = np.array([self._records[e] for e in range(state.ep_begin, state.ep_end)], np.int64).reshape(-1, 2)
        table.put_many(state.ep_begin, records)
        table.set_range(state.ep_begin, state.ep_end)

    def sync(self, table: EpisodeTable, old: State, new: State) -> None:
        self.load(table, new)

    def read_only_keys(self) -> None:
        """No key table: the buffer remembers keys in memory."""
        return None


def memory_replay_buffer(space: Space, capacity: int | None) -> ReplayBuffer:
    """A ReplayBuffer over memory: no file, no process, the buffer logic all the same."""
    storage = MemoryStorage(space, capacity)
    return ReplayBuffer(storage, journal=MemoryJournal(storage))  # type: ignore[arg-type]
