"""HDF5Storage: rows of one (nested) space in one HDF5 file, one dataset per leaf.

The class of the design document, and nothing else: `get` / `set` of rows, length management,
segment writers; its file (create, load, check, flush, close) is `_storage_file.py`'s half of the
class, the file's own steps `_h5file.py`'s. Index forms are `_indices.py`'s, the row I/O engine is
`_rowio.py` (and `fastread.py`, the memory-mapped path), raw-file inference is `_rawfile.py`'s. It
never decides where rows go: ring arithmetic and episodes belong to `replay/` (the buffer and its
journal), which sits on this module and is never imported by it. The design document's
`load_replay_buffer_from_raw_hdf5` (a ReplayBuffer over a plain h5py file) therefore comes from
h5replay.storage, the package above both: it is `ReplayBuffer.from_raw_hdf5`.

Layout of a file::

    /                       attrs: h5replay_format_version, h5replay_space (JSON), h5replay_capacity,
                            h5replay_replay_id
    /<leaf path>            one dataset per leaf ("obs/image"); a bare leaf space is stored as "data"
    /_h5replay/staging/...  hidden rows of open segment writers (never part of the space)
    /_h5replay/replay/...   the replay journal, when the file belongs to a ReplayBuffer

Not thread-safe: one thread at a time per storage (h5py serialises HDF5 calls anyway).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import h5py
import numpy as np

from h5replay.codecs import PackedRows
from h5replay.errors import ConfigError, SpaceMismatchError, StorageError
from h5replay.spaces import DEFAULT_KEY, DictSpace, Schema, Space
from h5replay.storage import _h5file
from h5replay.storage._h5file import INTERNAL_GROUP, STAGING_GROUP, h5_errors
from h5replay.storage._indices import normalize_index
from h5replay.storage._rawfile import infer_space
from h5replay.storage._rowio import read_slice, read_sorted_unique_rows, write_rows, write_sorted_unique_rows
from h5replay.storage._storage_file import _StorageFile
from h5replay.storage.fastread import MappedRows
from h5replay.storage.indexing import fancy_indexing_to_supported_indexing, fancy_indexing_to_supported_set_indexing
from h5replay.storage.packed import PackedColumn
from h5replay.storage.segment import SegmentWriter, Staging

__all__ = ["HDF5Storage", "FORMAT_VERSION", "PACKED"]

FORMAT_VERSION = _h5file.FORMAT_VERSION
#: `read(..., decode=PACKED)`: compressed leaves as stored (PackedRows), the rest as with decode=False.
PACKED = "packed"


class HDF5Storage(_StorageFile):
    """Rows of `single_instance_space` in one HDF5 file, one dataset per leaf.

    Build one with `create` or `load_from`. The constructor wraps an already-open h5py root
    (File, Group or, for a single-leaf column, Dataset); `owns_root=False` marks a view that
    must not close the file. `reduce_io=False` reads through h5py's own selections instead of
    the sorted-run engine and the memory map (slower; for files that must not be mapped).
    Opening, creating, flushing and closing are `_StorageFile`'s (_storage_file.py).
    """

    DEFAULT_KEY = DEFAULT_KEY

    # ------------------------------------------------------------------ plain h5py groups

    @staticmethod
    def build_space_from_hdf5_file(root: h5py.Group | h5py.Dataset) -> tuple[int, int | None, Space]:
        """(length, capacity, space) of a file or group; exact when h5replay wrote it.

        For raw files (no h5replay attributes) the space is inferred from the datasets: text from
        string dtypes, bool as BinarySpace, numbers as unbounded BoxSpaces. A group whose only
        member is `data` is a bare leaf. Names starting with '_' or '.' are skipped. A dataset
        that can grow (maxshape[0] != shape[0]) makes the storage unbounded.
        """
        if isinstance(root, h5py.Group):
            space, capacity = _h5file.read_header(root)
            if space is not None:
                leaves = Schema(space).leaves
                length = capacity if capacity is not None else min(root[p].shape[0] for p, _ in leaves)
                return int(length), capacity, space
        return infer_space(root)

    @staticmethod
    def call_function_on_first_dataset(root: h5py.Group, function: Callable[[h5py.Dataset], Any]) -> Any:
        """`function(dataset)` for the first dataset found (datasets before subgroups, by name)."""
        if isinstance(root, h5py.Dataset):
            return function(root)
        groups = []
        for name in root:
            if name == INTERNAL_GROUP:
                continue
            item = root[name]
            if isinstance(item, h5py.Dataset):
                return function(item)
            groups.append(item)
        for group in groups:
            with contextlib.suppress(ValueError):
                return HDF5Storage.call_function_on_first_dataset(group, function)
        raise ValueError("no dataset found in the HDF5 group")

    @staticmethod
    def call_function_on_every_dataset(root: h5py.Group, function: Callable[[h5py.Dataset], None]) -> None:
        """`function(dataset)` for every dataset under `root` (h5replay's own group excluded)."""
        if isinstance(root, h5py.Dataset):
            function(root)
            return
        for name in root:
            if name == INTERNAL_GROUP:
                continue
            HDF5Storage.call_function_on_every_dataset(root[name], function)

    @staticmethod
    def get_from(
        root: h5py.Group | h5py.Dataset, single_instance_space: Space, index: Any, reduce_io: bool = True
    ) -> Any:
        """`get` on any h5py group or dataset holding `single_instance_space` (no file handling)."""
        view = HDF5Storage(
            single_instance_space, root, capacity=None, reduce_io=reduce_io,
            check_file=False, is_mutable=False, owns_root=False,
        )
        return view.get(index)

    @staticmethod
    def set_to(root: h5py.Group | h5py.Dataset, single_instance_space: Space, index: Any, value: Any) -> None:
        """`set` on any h5py group or dataset holding `single_instance_space` (no file handling)."""
        view = HDF5Storage(
            single_instance_space, root, capacity=None, check_file=False, is_mutable=True, owns_root=False,
        )
        view.set(index, value)

    # ------------------------------------------------------------------ values <-> leaves

    def flatten(self, value: Any) -> dict[str, Any]:
        """{dataset path: leaf value} from a nested sample or batch; names missing or extra keys."""
        return self.schema.flatten(value)

    def unflatten(self, leaves: Mapping[str, Any]) -> Any:
        """A nested dict (or the bare value for a leaf space) from {dataset path: value}."""
        return self.schema.unflatten(leaves)

    @property
    def check_bounds(self) -> bool:
        """Whether writes refuse Box values outside the space's bounds, and NaN (True by default;
        a setting of this open storage, not recorded in the file)."""
        return self.schema.check_bounds

    @check_bounds.setter
    def check_bounds(self, on: bool) -> None:
        self.schema = Schema(self.single_instance_space, check_bounds=bool(on))

    def encode_batch(self, batch: Any, num_rows: int | None = None) -> tuple[dict[str, np.ndarray], int]:
        """Validate a batch against the space; returns ({path: stored array}, rows). Writes nothing."""
        return self.schema.encode_batch(batch, num_rows)

    def encode_one(self, sample: Any) -> dict[str, np.ndarray]:
        """Validate one sample; returns {path: stored batch of one row}. Writes nothing."""
        return self.schema.encode_one(sample)

    # ------------------------------------------------------------------ reading

    def get(self, index: Any) -> Any:
        """Rows at `index`, in the order asked (duplicates included).

        `index` is an int (one unbatched sample), a slice (any step), Ellipsis, a list or integer
        array (any order, duplicates, negatives, any shape), or a boolean mask. Batched text comes
        back as object arrays of `str`. Reads use `read_sorted_unique_rows`, or a read-only memory
        map of the file when the data is flushed, uncompressed and allocated.

        Raises:
            IndexError: an index is out of range.
            TypeError: `index` is not a row index.
        """
        self._ensure_open()
        # The sampling hot path: a 1-D int64 array, checked with one reduction (negatives wrap to
        # huge unsigned values), gathered straight from the file's memory map.
        if (type(index) is np.ndarray and index.dtype == np.int64 and index.ndim == 1 and index.size > 1
                and int(index.view(np.uint64).max()) < self._len):
            rows = self._mapped_rows(index)
            if rows is not None:
                return self.schema.decode(rows)
        return self.read(*normalize_index(index, self._len))

    def read(self, kind: str, where: Any, decode: bool | str = True, row_ids: np.ndarray | None = None) -> Any:
        """Rows for an index already normalized by `normalize_index` (no range check here).

        With `decode=False` returns {dataset path: stored array} (text as UTF-8 bytes, compressed
        leaves decoded); with `decode=PACKED`, the same but a compressed leaf's rows as stored, a
        `PackedRows` (what a reader process sends over the wire). `row_ids` (one per row of
        `where`) name the rows in the error of a damaged record.

        Raises:
            DamagedRecordError: a compressed row's record is damaged (it is never returned).
        """
        self._ensure_open()
        return self._read(kind, where, decode, row_ids)

    def read_leaves(self, paths: Sequence[str], where: np.ndarray) -> dict[str, np.ndarray]:
        """Stored rows of some leaves (by path) at physical rows `where` (any shape); compressed
        leaves decoded."""
        self._ensure_open()
        return {path: self._read_leaf(path, "array", where, False, None) for path in paths}

    @property
    def compressed_leaves(self) -> dict[str, str]:
        """{leaf path: codec} of the leaves stored as compressed records."""
        self._ensure_open()
        return {path: column.codec_name for path, column in self._packed.items()}

    def compressed_leaf(self, path: str) -> PackedColumn:
        """The layout of a compressed leaf (codec_name, level, slot_bytes, spill_slots(), and its
        datasets(): slots, meta, spill), for what copies or describes a file; `dataset(path)` has
        no single dataset to give for it.

        Raises:
            KeyError: `path` is not a compressed leaf.
        """
        self._ensure_open()
        if path not in self._packed:
            raise KeyError(f"'{path}' is not a compressed leaf (those are {sorted(self._packed)})")
        return self._packed[path]

    def _read(self, kind: str, where: Any, decode: bool | str, row_ids: np.ndarray | None) -> Any:
        if kind == "int":
            one = np.array([where], dtype=np.int64)
            rows = {path: self._read_leaf(path, "array", one, False, row_ids)[0] for path, _ in self._leaves}
            return self.schema.decode_one(rows) if decode is True else rows
        rows = {path: self._read_leaf(path, kind, where, decode == PACKED, row_ids) for path, _ in self._leaves}
        return self.schema.decode(rows) if decode is True else rows

    def _read_leaf(self, path: str, kind: str, where: Any, as_stored: bool, row_ids: np.ndarray | None) -> Any:
        column = self._packed.get(path) if self._packed else None
        if column is None:
            return self._read_rows(path, kind, where)
        if kind == "slice":
            positions: np.ndarray = np.arange(where[0], where[1], dtype=np.int64)
            lead: tuple[int, ...] = positions.shape
        else:
            positions, lead = np.asarray(where, np.int64).reshape(-1), np.shape(where)
        ids = None if row_ids is None else np.asarray(row_ids).reshape(-1)
        if as_stored:
            records = column.records(positions, ids)
            return PackedRows(records.blob, records.meta.reshape(*lead, records.meta.shape[-1]))
        return column.read(positions, ids).reshape(*lead, *column.row_shape)

    def _mapped_rows(self, flat: np.ndarray) -> dict[str, np.ndarray] | None:
        out = {}
        for path, _ in self._leaves:
            column = self._packed.get(path) if self._packed else None
            rows = self._mapped_read(path, flat) if column is None else column.read(flat)
            if rows is None:
                return None
            out[path] = rows
        return out

    def _gather(self, key: str, flat: np.ndarray) -> np.ndarray:
        """Rows `flat` (1-d, in range) of one of a compressed leaf's datasets, by its key."""
        if flat.shape[0] == 0:
            ds = self._datasets[key]
            return np.zeros((0, *ds.shape[1:]), dtype=ds.dtype)
        return self._read_rows(key, "array", flat)

    def _read_rows(self, path: str, kind: str, where: Any) -> np.ndarray:
        ds = self._datasets[path]
        if kind == "array" and where.size > 1:
            flat = where.reshape(-1)
            mapped = self._mapped_read(path, flat)
            if mapped is not None:
                return mapped.reshape(where.shape + mapped.shape[1:])
        self._refresh_if_stale()
        with h5_errors(f"reading '{path}'"):
            if kind == "slice":
                start, stop = where
                return read_slice(ds, start, stop)
            idx: np.ndarray = where
            flat = idx.reshape(-1)
            if not self.reduce_io:
                unique, inverse = fancy_indexing_to_supported_indexing(flat)
                rows = ds[unique] if unique.size else read_slice(ds, 0, 0)
                rows = np.asarray(rows)[inverse.reshape(-1)]
            elif flat.size > 1 and np.all(flat[1:] > flat[:-1]):
                rows = read_sorted_unique_rows(ds, flat)
            else:
                unique, inverse = fancy_indexing_to_supported_indexing(flat)
                rows = read_sorted_unique_rows(ds, unique)[inverse.reshape(-1)]
            return rows.reshape(idx.shape + rows.shape[1:])

    def _mapped_read(self, path: str, flat: np.ndarray) -> np.ndarray | None:
        """Rows from the memory map, or None (unmappable, unallocated rows)."""
        if not self.reduce_io:
            return None
        if self._io.dirty:  # the map sees only what reached the file: write the cached chunks out first
            with h5_errors("flushing written rows before a mapped read"):
                self._io.flush_written()
        mapped = self._mapping(path)
        if mapped is None:
            return None
        rows = mapped.take_checked(flat)
        if rows is None and self._stale:
            # An SWMR reader may not know of chunks the writer allocated since: ask HDF5 afresh.
            self._refresh_if_stale()
            rows = mapped.take_checked(flat)
        return rows

    def _mapping(self, path: str) -> MappedRows | None:
        """The leaf's memory map, opened on first use (None when its layout cannot be mapped)."""
        key = self._map_keys[path]
        maps = self._io.maps
        if key not in maps:
            maps[key] = MappedRows.open(self._datasets[path])
        return maps[key]

    def get_column(self, nested_keys: str | Sequence[str]) -> HDF5Storage:
        """A storage over the sub-space at `nested_keys` ("obs/image" or ("obs", "image")), sharing
        this storage's file handle: writes through either are seen by both; closing this one ends it."""
        keys = nested_keys.split("/") if isinstance(nested_keys, str) else list(nested_keys)
        space: Space = self.single_instance_space
        for key in keys:
            if not isinstance(space, DictSpace) or key not in space.spaces:
                raise KeyError(f"no field {'/'.join(keys)!r} in {self.single_instance_space!r}")
            space = space.spaces[key]
        node = self.root[("/".join(keys))] if keys else self.root
        view = HDF5Storage(
            space, node, capacity=self.capacity, reduce_io=self.reduce_io, check_file=False,
            is_mutable=self.is_mutable, multiprocessing=self.multiprocessing, owns_root=False, length=self._len,
        )
        view.filename = self.filename
        view._io = self._io  # one dirty flag and one set of maps for the file
        return view

    # ------------------------------------------------------------------ writing

    def set(self, index: Any, value: Any) -> None:
        """Write rows at `index` (same index kinds as `get`). With duplicate indices the last value
        wins, as in numpy. Every leaf is validated before anything is written.

        Raises:
            ReadOnlyError: the storage is read-only.
            SpaceMismatchError: `value` does not fit the space or the number of rows.
            IndexError: an index is out of range.
        """
        self._require_mutable("write rows")
        kind, where = normalize_index(index, self._len)
        if kind == "int":
            encoded = self.encode_one(value)
            self._write_range(where, encoded)
            return
        if kind == "slice":
            start, stop = where
            encoded, _ = self.encode_batch(value, stop - start)
            self._write_range(start, encoded)
            return
        idx: np.ndarray = where
        encoded, _ = self._encode_for_index(value, idx)
        flat = idx.reshape(-1)
        unique, positions = fancy_indexing_to_supported_set_indexing(flat)
        records = {path: column.encode(encoded[path][positions]) for path, column in self._packed.items()}
        self._io.wrote(self._datasets.values())
        with h5_errors("writing rows"):
            for path, _ in self._leaves:
                arr = encoded[path]  # (rows, *row_shape): _encode_for_index flattened an N-d index
                if path in records:
                    self._packed[path].write(unique, records[path], _write_sorted)
                else:
                    write_sorted_unique_rows(self._datasets[path], unique, np.ascontiguousarray(arr[positions]))

    def _encode_for_index(self, value: Any, idx: np.ndarray) -> tuple[dict[str, np.ndarray], int]:
        if idx.ndim == 1:
            return self.encode_batch(value, idx.shape[0])
        # An N-d index takes a value of shape idx.shape + row: validate it flattened.
        flat_value = _reshape_batch(self.flatten(value), idx.shape)
        return self.encode_batch(self.unflatten(flat_value), idx.size)

    def _write_range(self, start: int, encoded: Mapping[str, np.ndarray]) -> None:
        """Write whole rows [start, start + n) of every leaf; rows must already exist."""
        # Compressed first (the costly part), so nothing is written if a codec fails.
        records = {path: column.encode(encoded[path]) for path, column in self._packed.items()}
        self._io.wrote(self._datasets.values())  # before the write: a failed one may still reach HDF5's caches
        with h5_errors("writing rows"):
            for path, _ in self._leaves:
                arr = encoded[path]
                if path in records:
                    if arr.shape[0]:
                        positions = np.arange(start, start + arr.shape[0], dtype=np.int64)
                        self._packed[path].write(positions, records[path], _write_sorted)
                    continue
                ds = self._datasets[path]
                if arr.shape[0] and not write_rows(ds, start, arr):
                    ds[start : start + arr.shape[0]] = arr

    def write_ring(self, start: int, encoded: Mapping[str, np.ndarray]) -> None:
        """Write rows at [start, start + n) modulo the capacity (two writes when they wrap).

        For an unbounded storage the length grows to cover the rows. Used by segment writers and
        the replay buffer; the caller has validated `encoded`.
        """
        n = next(iter(encoded.values())).shape[0] if encoded else 0
        if n == 0:
            return
        if self.capacity is None:
            if start + n > self._len:
                self.extend_length(start + n - self._len)
            self._write_range(start, encoded)
            return
        cap = self.capacity
        if n > cap:  # only the last `cap` rows survive, as with numpy's last-wins assignment
            encoded = {p: a[n - cap :] for p, a in encoded.items()}
            start, n = start + n - cap, cap
        start %= cap
        first = min(n, cap - start)
        self._write_range(start, {p: a[:first] for p, a in encoded.items()})
        if first < n:
            self._write_range(0, {p: a[first:] for p, a in encoded.items()})

    # ------------------------------------------------------------------ length management

    def extend_length(self, length: int) -> None:
        """Grow an unbounded storage by `length` rows (zero-filled). All leaves or none grow."""
        self._require_mutable("extend the length")
        if self.capacity is not None:
            raise ConfigError(f"cannot extend a storage of fixed capacity {self.capacity}")
        if isinstance(length, bool) or int(length) < 0:
            raise ConfigError(f"length to extend by must be an int >= 0, got {length!r}")
        self._resize_all(self._len + int(length))

    def shrink_length(self, length: int) -> None:
        """Drop the last `length` rows of an unbounded storage. Their file space may be reused,
        so memory maps of them are dropped (a reader must do the same: see ReplayBuffer)."""
        self._require_mutable("shrink the length")
        if self.capacity is not None:
            raise ConfigError(f"cannot shrink a storage of fixed capacity {self.capacity}")
        if isinstance(length, bool) or not 0 <= int(length) <= self._len:
            raise ConfigError(f"length to shrink by must be an int in [0, {self._len}], got {length!r}")
        self._resize_all(self._len - int(length))
        self._io.drop_maps()

    def _resize_all(self, new_len: int) -> None:
        old = self._len
        done: list[h5py.Dataset] = []
        self._io.wrote(self._datasets.values())
        try:
            with h5_errors(f"resizing to {new_len} rows"):
                for ds in self._datasets.values():
                    ds.resize(new_len, axis=0)
                    done.append(ds)
        except StorageError:
            with contextlib.suppress(Exception):
                for ds in done:
                    ds.resize(old, axis=0)
            raise
        self._len = new_len

    def clear(self) -> None:
        """Abort the open cursor segment; an unbounded storage becomes empty. A fixed-capacity
        storage keeps its length (its capacity) and its bytes: the rows are simply no longer
        meaningful to whoever tracks them (the replay buffer resets its ring)."""
        self._require_mutable("clear")
        self.abort_segment()
        if self.capacity is None and self._len:
            self.shrink_length(self._len)

    # ------------------------------------------------------------------ segments

    def open_segment_writer(self) -> SegmentWriter:
        """A streaming SegmentWriter: rows go to hidden staging rows in the file as they arrive
        (memory stays bounded), and become visible only at `commit(start_index)`."""
        self._require_mutable("open a segment writer")
        if self._staging is None:
            with h5_errors("opening the staging area"):
                group = self.file[STAGING_GROUP]
                datasets = {path: group[path] for path, _ in self._leaves}
                if self._uncached_writes:
                    datasets = {path: _h5file.for_writing(ds) for path, ds in datasets.items()}
            self._staging = Staging(datasets, self._leaves, self.segment_buffer_bytes, self.segment_memory_bytes)
        writer = SegmentWriter(self, self._staging)
        self._writers.add(writer)
        return writer

    @property
    def has_open_segment(self) -> bool:
        """True between `mark_segment_start` and `mark_segment_end` (the single append cursor)."""
        return self._cursor is not None

    def mark_segment_start(self, start_index: int) -> None:
        """Open the single append cursor at `start_index` (modulo a fixed capacity).

        Raises:
            ConfigError: a cursor is already open.
            IndexError: `start_index` would leave a gap in an unbounded storage.
        """
        self._require_mutable("start a segment")
        if self._cursor is not None:
            raise ConfigError("a segment is already open; call mark_segment_end() first")
        start = int(start_index)
        if self.capacity is not None:
            start %= self.capacity
        elif not 0 <= start <= self._len:
            raise IndexError(f"segment start {start} is out of range for a storage of {self._len} rows")
        self._cursor = start

    def append(self, value: Any) -> None:
        """Write one sample at the cursor and advance it (rows are visible at once in this process).

        Raises:
            ConfigError: no cursor is open.
            SpaceMismatchError: the sample does not fit the space (nothing is written).
        """
        if self._cursor is None:
            raise ConfigError("no open segment: call mark_segment_start(index) before append()")
        self._require_mutable("append")
        encoded = self.encode_one(value)
        self.write_ring(self._cursor, encoded)
        self._cursor = self._cursor + 1
        if self.capacity is not None:
            self._cursor %= self.capacity

    def mark_segment_end(self) -> None:
        """Close the cursor (rows it wrote stay)."""
        self._cursor = None

    def abort_segment(self) -> None:
        """Close the cursor. Rows it already wrote stay written."""
        self._cursor = None

    def get_segments(self) -> None:
        """HDF5Storage keeps no segment index (the ReplayBuffer does)."""
        return None


def _write_sorted(ds: h5py.Dataset, rows: np.ndarray, values: np.ndarray) -> None:
    write_sorted_unique_rows(ds, rows, values)


def _reshape_batch(flat: Mapping[str, Any], index_shape: tuple[int, ...]) -> dict[str, Any]:
    out = {}
    for path, value in flat.items():
        arr = np.asarray(value) if not isinstance(value, np.ndarray) else value
        if arr.shape[: len(index_shape)] != index_shape:
            raise SpaceMismatchError(
                f"field '{path}' has leading shape {arr.shape[:len(index_shape)]} but the index has shape {index_shape}"
            )
        out[path] = arr.reshape((-1,) + arr.shape[len(index_shape):])
    return out
