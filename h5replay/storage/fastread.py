"""Random row reads that bypass HDF5 through a read-only memory map of the file.

Without filters, HDF5 stores a contiguous dataset as one run of bytes at ``DatasetID.get_offset()``
and each allocated chunk of a chunked dataset as one run of bytes at its chunk address (from
``DatasetID.chunk_iter`` or ``get_chunk_info_by_coord``). ``MappedRows`` maps the file read-only
and gathers rows with numpy: 256 random rows cost tens of microseconds instead of HDF5's
milliseconds, within 3x of a numpy memmap gather.

This module owns that map and the chunk-address table. It must not write to the file, create
HDF5 objects, or know about spaces: it reads rows of one dataset, or says (``None``) that the
caller should read them through h5py.
"""

from __future__ import annotations

import math
import mmap
import os
import stat
from types import TracebackType
from typing import Any

import h5py
import numpy as np

from h5replay.errors import ClosedError
from h5replay.storage._rowio import check_out, plain_dtype, raw_file_type

__all__ = ["MappedChunk", "MappedRows"]

# HDF5 1.14.4 started to include the user block in chunk addresses (HDFGroup/hdf5#3003, fixed by
# PR #4236); before that the caller had to add it. H5Dget_offset always included it.
_CHUNK_ADDRESSES_INCLUDE_USERBLOCK = h5py.version.hdf5_version_tuple >= (1, 14, 4)
# H5Dchunk_iter reports chunk coordinates in elements from HDF5 1.14.0 (HDFGroup/hdf5#1419);
# earlier versions reported chunk indices, so there we look chunks up one by one instead.
_CHUNK_ITER_USABLE = h5py.version.hdf5_version_tuple >= (1, 14, 0) and hasattr(
    h5py.h5d.DatasetID, "chunk_iter"
)
# A read that misses a few chunks asks HDF5 for each (~20 µs per get_chunk_info_by_coord);
# more than this many and one chunk_iter walk of the whole index (~2 µs per chunk) is cheaper
# for the tables this project makes (hundreds to tens of thousands of chunks).
_MAX_CHUNK_LOOKUPS = 16

# Row-base sentinels of the chunk table. A row's byte offset is rowbase[chunk] + row * row_bytes;
# with either sentinel it stays negative for any file below 2**60 bytes, so a single "offset < 0"
# check finds every row whose chunk is not known to be allocated.
_UNKNOWN = np.int64(-(1 << 62))  # not asked yet (or asked before the last refresh)
_MISSING = np.int64(-(1 << 62) - (1 << 60))  # asked since the last refresh: not allocated

# The ufuncs' own reduce skips ndarray.max()'s Python wrapper: ~1 µs of the ~10 µs a read costs.
_MAX = np.maximum.reduce
_MIN = np.minimum.reduce


def _unmappable_reason(dataset: Any) -> str | None:
    """Why ``dataset`` cannot be read through a map, or None when it can."""
    if not isinstance(dataset, h5py.Dataset):
        return f"expected an h5py.Dataset, got {type(dataset).__name__}"
    shape = dataset.shape
    if shape is None or len(shape) == 0:
        return f"dataset {dataset.name!r} has shape {shape}; it has no rows"
    fid = dataset.file.id
    if fid.get_access_plist().get_driver() != h5py.h5fd.SEC2:
        return f"the file driver is {dataset.file.driver!r}, not the default 'sec2'"
    filename = dataset.file.filename
    if not os.path.isfile(filename):
        return f"{filename!r} is not a regular file"
    dcpl = dataset.id.get_create_plist()
    layout = dcpl.get_layout()
    if layout not in (h5py.h5d.CONTIGUOUS, h5py.h5d.CHUNKED):
        return f"dataset {dataset.name!r} is neither contiguous nor chunked (layout {layout})"
    if dcpl.get_external_count() > 0:
        return f"dataset {dataset.name!r} keeps its data in external files"
    if dcpl.get_nfilters() > 0:
        names = [dcpl.get_filter(i)[3].decode(errors="replace") for i in range(dcpl.get_nfilters())]
        return f"dataset {dataset.name!r} has filters {names}; their bytes are not rows"
    dtype = dataset.dtype
    if not (raw_file_type(dtype, dataset.id.get_type()) and dtype.isnative):
        return f"dataset {dataset.name!r} has dtype {dtype}, not a native fixed-size type"
    if math.prod(shape[1:]) == 0:
        return f"dataset {dataset.name!r} has empty rows (shape {shape})"
    if layout == h5py.h5d.CHUNKED:
        chunks = dcpl.get_chunk()
        if tuple(chunks[1:]) != tuple(shape[1:]):
            return f"dataset {dataset.name!r} has chunks {chunks} that do not hold whole rows"
    return None


def _check_non_negative(flat: np.ndarray) -> None:
    lowest = int(_MIN(flat))
    if lowest < 0:
        raise IndexError(f"row {lowest} is negative; normalise negative indices (i + len) first")


class MappedRows:
    """Rows of one uncompressed dataset, gathered from a read-only memory map of its file.

    The map sees only bytes that reached the file. A process that *writes* through h5py may hold
    rows in HDF5's caches (the chunk cache, the sieve buffer, metadata) until ``File.flush()``:
    the caller (the storage) uses this path only when nothing was written since the last flush,
    and calls ``refresh()`` after new data was flushed. An SWMR reader calls
    ``Dataset.refresh()`` first (so HDF5 sees the new chunk index), then ``refresh()`` here.

    Chunk addresses are cached: without filters a chunk never moves once allocated, so
    ``refresh()`` keeps the known ones and only forgets which chunks were missing. After a
    dataset *shrinks* (resize down, clear) call ``invalidate()``: its chunks may be freed and
    reused, and reading a stale address past a truncated end of file would crash with SIGBUS.

    Not thread-safe; give each thread its own, or lock around it. Use ``MappedRows.open`` to get
    one, and ``close()`` (or a ``with`` block) to release the map.
    """

    def __init__(self, dataset: h5py.Dataset) -> None:
        """Map ``dataset``'s file. ``MappedRows.open`` returns None where this raises.

        Raises:
            ValueError: The dataset cannot be read through a map; the message says why.
        """
        reason = _unmappable_reason(dataset)
        if reason is not None:
            raise ValueError(reason)
        self._dataset = dataset
        self._dsid = dataset.id
        dtype = plain_dtype(dataset.dtype)
        self.dtype: np.dtype[Any] = dtype
        self.row_shape: tuple[int, ...] = tuple(dataset.shape[1:])
        self.row_bytes: int = math.prod(self.row_shape) * dtype.itemsize
        dcpl = self._dsid.get_create_plist()
        chunked = dcpl.get_layout() == h5py.h5d.CHUNKED
        self._chunk_rows = int(dcpl.get_chunk()[0]) if chunked else 0
        self.chunk_rows: int | None = self._chunk_rows or None
        """Rows per chunk, or None for a contiguous dataset."""
        userblock = dataset.file.id.get_create_plist().get_userblock()
        self._chunk_base = 0 if _CHUNK_ADDRESSES_INCLUDE_USERBLOCK else int(userblock)
        self._fd = self._open_fd(dataset)
        self._mm: mmap.mmap | None = None
        self._map_size = 0
        self._closed = False
        # Contiguous layout: the rows as one ndarray over the map.
        self._num_rows = int(dataset.shape[0])
        self._offset: int | None = None
        self._rows: np.ndarray | None = None
        # Chunked layout: per chunk, the byte offset of its row 0 minus chunk * chunk bytes (so a
        # row's offset is rowbase[row // chunk_rows] + row * row_bytes); and a void view with one
        # row-sized element starting at every byte of the map, indexed by byte offset.
        self._rowbase = np.empty(0, dtype=np.int64)
        self._window: np.ndarray | None = None

    @classmethod
    def open(cls, dataset: h5py.Dataset) -> MappedRows | None:
        """A map over ``dataset``, or None when the fast path cannot apply.

        None when: a filter is set (compression, shuffle, fletcher32...), the byte order is not
        native, the dtype is not a plain fixed-size one (numbers, bool, null-padded ``S{k}``), the
        layout is neither contiguous nor chunked, a chunk does not hold whole rows, the file
        driver is not the default sec2, or the file is not a regular file.
        """
        if _unmappable_reason(dataset) is not None:
            return None
        return cls(dataset)

    # -- public API --------------------------------------------------------------------------

    def read(self, index: np.ndarray, out: np.ndarray | None = None) -> np.ndarray | None:
        """Gather rows in the order of ``index``. Does not block on HDF5 (page faults aside).

        Args:
            index: Integer rows, any shape and order, duplicates allowed; the caller has checked
                them against the dataset's length and made them non-negative.
            out: Optional C-contiguous, writeable array of shape ``(*index.shape, *row_shape)``
                and the dataset's dtype, filled and returned.

        Returns:
            An owned array of shape ``(*index.shape, *row_shape)`` (never a view into the map), or
            None when a requested row has no storage in the file yet (an unallocated contiguous
            dataset, an unwritten chunk, bytes not yet flushed), even after asking HDF5 again.
            The caller then reads through h5py.

        Raises:
            ClosedError: ``close()`` was called.
            TypeError: ``index`` is not an integer array, or ``out`` has the wrong dtype.
            ValueError: ``out`` has the wrong shape or layout.
            IndexError: An index is negative, or beyond a contiguous dataset's rows.
        """
        self._check_open()
        index = np.asarray(index)
        if index.dtype.kind not in "iu":
            raise TypeError(f"a row index must be an integer array, got dtype {index.dtype}")
        shape = (*index.shape, *self.row_shape)
        if out is not None:
            self._check_out(out, shape)
        if index.size == 0:
            return out if out is not None else np.empty(shape, dtype=self.dtype)
        # Each numpy call costs ~0.5-2 µs against ~10 µs for the whole gather: skip the no-ops.
        flat = index if index.ndim == 1 else index.reshape(-1)
        if flat.dtype != np.intp:
            flat = flat.astype(np.intp)
        flat_out = None if out is None else out.reshape(flat.shape[0], *self.row_shape)
        if not self._chunk_rows:
            rows = self._read_contiguous(flat, flat_out)
        else:
            rows = self._read_chunked(flat, flat_out)
        if rows is None:
            return None
        if out is not None:
            return out
        return rows if index.ndim == 1 else rows.reshape(shape)

    def take_checked(self, flat: np.ndarray) -> np.ndarray | None:
        """`read` for a 1-D intp array the caller has range-checked and made non-negative: the
        hot path of `HDF5Storage.get`, with no re-validation. None when `read` must decide."""
        if self._closed:
            return None
        if not self._chunk_rows:
            rows = self._rows
            if rows is not None and rows.shape[0] == self._num_rows:
                return rows.take(flat, axis=0, mode="clip")
            return self.read(flat)
        window = self._window
        if window is not None and flat.shape[0]:
            chunks = flat // self._chunk_rows
            # Rows past the chunk table (a dataset that grew since it was scanned) go to `read`.
            if int(chunks.max()) < self._rowbase.shape[0]:
                offsets = self._rowbase.take(chunks)
                offsets += flat * self.row_bytes
                if int(offsets.view(np.uint64).max()) < window.shape[0]:  # unknown/missing chunks are negative
                    return window[offsets].view(self.dtype).reshape(flat.shape[0], *self.row_shape)
        return self.read(flat)

    def refresh(self) -> None:
        """Let the next read see data flushed since the last one. Cheap: no HDF5 call.

        Chunks found missing are asked about again on the next read that needs them, and the
        map grows when a needed offset lies past its end. If the file shrank, everything is
        dropped as by ``invalidate()``.

        Raises:
            ClosedError: ``close()`` was called.
        """
        self._check_open()
        if os.fstat(self._fd).st_size < self._map_size:
            self.invalidate()
            return
        self._rowbase[self._rowbase == _MISSING] = _UNKNOWN
        if self._rows is not None and self._rows.shape[0] < self._num_rows:
            self._rows = None  # mapped before all rows reached the file: look again

    def invalidate(self) -> None:
        """Drop the chunk table, the dataset offset and the map; the next read starts afresh.

        Raises:
            ClosedError: ``close()`` was called.
        """
        self._check_open()
        self._offset = None
        self._rowbase = np.empty(0, dtype=np.int64)
        self._unmap()

    def close(self) -> None:
        """Release the map and its file descriptor. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._unmap()
        os.close(self._fd)

    def __enter__(self) -> MappedRows:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        layout = f"chunks of {self._chunk_rows} rows" if self._chunk_rows else "contiguous"
        state = "closed" if self._closed else f"{self._map_size} bytes mapped"
        return f"<MappedRows {self._dataset.name!r} {self.dtype} {layout}, {state}>"

    # -- contiguous layout -------------------------------------------------------------------

    def _read_contiguous(self, flat: np.ndarray, out: np.ndarray | None) -> np.ndarray | None:
        rows = self._rows
        # One reduction checks both ends: a negative row is huge as uint64.
        highest = int(_MAX(flat.view(np.uint64)))
        if rows is None or highest >= rows.shape[0]:
            _check_non_negative(flat)
            if highest >= self._num_rows:
                raise IndexError(
                    f"row {highest} is out of range for a dataset of {self._num_rows} rows"
                )
            rows = self._map_contiguous()
            if rows is None or highest >= rows.shape[0]:
                return None
        # mode="clip" skips numpy's buffered bounds check (3-5x slower); the rows were checked.
        return np.take(rows, flat, axis=0, out=out, mode="clip")

    def _map_contiguous(self) -> np.ndarray | None:
        if self._offset is None:
            # get_offset() is not None-safe: with a user block, "unallocated" comes back as a
            # small number (HADDR_UNDEF + userblock wraps around), so ask the allocation status.
            if self._dsid.get_space_status() != h5py.h5d.SPACE_STATUS_ALLOCATED:
                return None
            self._offset = int(self._dsid.get_offset())
        offset = self._offset
        if self._map_size < offset + self._num_rows * self.row_bytes:
            self._remap()
        available = min(self._num_rows, max(0, self._map_size - offset) // self.row_bytes)
        if self._mm is None or available == 0:
            return None
        self._rows = np.ndarray(
            (available, *self.row_shape), dtype=self.dtype, buffer=self._mm, offset=offset
        )
        return self._rows

    # -- chunked layout ----------------------------------------------------------------------

    def _read_chunked(self, flat: np.ndarray, out: np.ndarray | None) -> np.ndarray | None:
        if self._chunk_rows == 1:
            _check_non_negative(flat)
        # Divided as uint64, a negative row becomes a chunk number >= 2**63 // chunk_rows, past
        # any table: the lookup raises IndexError (which _row_offsets reports) instead of
        # wrapping to the end of the table. This saves a reduction on every read.
        chunk = flat.view(np.uint64) // self._chunk_rows
        offsets = self._row_offsets(flat, chunk)
        window = self._window
        # Negative offsets (unknown or missing chunks) become huge as uint64: one check for both.
        if window is None or int(_MAX(offsets.view(np.uint64))) >= window.shape[0]:
            if int(offsets.min()) < 0:
                if not self._find_chunks(np.unique(chunk[offsets < 0])):
                    return None
                offsets = self._row_offsets(flat, chunk)
            window = self._window
            if window is None or int(offsets.max()) >= window.shape[0]:
                window = self._map_window(int(offsets.max()))
                if window is None:
                    return None
        # Fancy indexing copies (never a view into the map). On a 1-D void window it is a plain
        # memcpy per row: ~4 µs for 256 rows of 28 B, against ~20 µs on a typed 2-D window.
        rows: np.ndarray = window[offsets].view(self.dtype).reshape(flat.shape[0], *self.row_shape)
        if out is None:
            return rows
        out[...] = rows
        return out

    def _row_offsets(self, flat: np.ndarray, chunk: np.ndarray) -> np.ndarray:
        try:
            base = self._rowbase[chunk]
        except IndexError:
            _check_non_negative(flat)
            self._grow_table(int(chunk.max()) + 1)
            base = self._rowbase[chunk]
        base += flat * self.row_bytes
        offsets: np.ndarray = base
        return offsets

    def _grow_table(self, num_chunks: int) -> None:
        old = self._rowbase
        if num_chunks <= old.shape[0]:
            return
        self._rowbase = np.full(max(num_chunks, 2 * old.shape[0]), _UNKNOWN, dtype=np.int64)
        self._rowbase[: old.shape[0]] = old

    def _find_chunks(self, chunks: np.ndarray) -> bool:
        """Ask HDF5 where ``chunks`` are; True when every one of them is allocated."""
        state = self._rowbase[chunks]
        if np.any(state == _MISSING):
            return False
        if chunks.shape[0] <= _MAX_CHUNK_LOOKUPS or not _CHUNK_ITER_USABLE:
            self._lookup_chunks(chunks.tolist())
        else:
            self._scan_chunks()
        state = self._rowbase[chunks]
        still = state < 0
        self._rowbase[chunks[still]] = _MISSING
        return not bool(np.any(still))

    def _chunk_row_base(self, chunk: int, address: int) -> int:
        return self._chunk_base + address - chunk * self._chunk_rows * self.row_bytes

    def _chunk_usable(self, info: Any) -> bool:
        return (
            info.byte_offset is not None
            and info.filter_mask == 0
            and info.size == self._chunk_rows * self.row_bytes
        )

    def _lookup_chunks(self, chunks: list[int]) -> None:
        zeros = (0,) * len(self.row_shape)
        for chunk in chunks:
            info = self._dsid.get_chunk_info_by_coord((chunk * self._chunk_rows, *zeros))
            if self._chunk_usable(info):
                self._rowbase[chunk] = self._chunk_row_base(chunk, int(info.byte_offset))

    def _scan_chunks(self) -> None:
        """Walk the whole chunk index once (h5py's chunk_iter), recording every chunk.

        Chunks of the current extent that the walk did not report are marked missing, so reads
        of them return None without another walk until ``refresh()``.
        """
        found: list[tuple[int, int]] = []
        chunk_rows = self._chunk_rows

        def visit(info: Any) -> None:
            if self._chunk_usable(info):
                found.append((info.chunk_offset[0] // chunk_rows, info.byte_offset))

        self._dsid.chunk_iter(visit)
        num_chunks = -(-int(self._dsid.shape[0]) // chunk_rows)
        self._grow_table(num_chunks)
        unknown = self._rowbase[:num_chunks] == _UNKNOWN
        self._rowbase[:num_chunks][unknown] = _MISSING
        if found:
            chunks = np.array([c for c, _ in found], dtype=np.int64)
            addresses = np.array([a for _, a in found], dtype=np.int64)
            self._grow_table(int(chunks.max()) + 1)
            self._rowbase[chunks] = (
                self._chunk_base + addresses - chunks * (chunk_rows * self.row_bytes)
            )

    def _map_window(self, highest_offset: int) -> np.ndarray | None:
        if highest_offset + self.row_bytes > self._map_size:
            self._remap()
        if self._mm is None or self._map_size < self.row_bytes:
            return None
        # One void "row" starting at every byte of the map: row r of chunk k is element
        # rowbase[k] + r * row_bytes. Overlapping elements are fine for reading.
        self._window = np.ndarray(
            (self._map_size - self.row_bytes + 1,),
            dtype=np.dtype((np.void, self.row_bytes)),
            buffer=self._mm,
            offset=0,
            strides=(1,),
        )
        if highest_offset >= self._window.shape[0]:
            return None
        return self._window

    # -- the map -----------------------------------------------------------------------------

    @staticmethod
    def _open_fd(dataset: h5py.Dataset) -> int:
        # Map through the very file HDF5 has open (its sec2 descriptor), not a name that may be
        # relative to another working directory, renamed or replaced since.
        try:
            handle = dataset.file.id.get_vfd_handle()
        except Exception:  # noqa: BLE001 - any failure: fall back to the name
            handle = None
        if isinstance(handle, int) and handle >= 0:
            fd = os.dup(handle)
        else:
            fd = os.open(dataset.file.filename, os.O_RDONLY)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ValueError(f"{dataset.file.filename!r} is not a regular file")
        return fd

    def _remap(self) -> None:
        size = os.fstat(self._fd).st_size
        if size == self._map_size and self._mm is not None:
            return
        self._unmap()
        if size > 0:
            self._mm = mmap.mmap(self._fd, size, access=mmap.ACCESS_READ)
            self._map_size = size

    def _unmap(self) -> None:
        self._rows = None
        self._window = None
        mm, self._mm, self._map_size = self._mm, None, 0
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # a view still exists somewhere; the map goes when it does

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this MappedRows was closed; open a new one with MappedRows.open")

    def _check_out(self, out: np.ndarray, shape: tuple[int, ...]) -> None:
        check_out(out, shape, self.dtype)


class MappedChunk:
    """The one chunk of a small, fixed-size, unfiltered dataset, mapped read-only: a row another
    process rewrites in place (the journal's state row), read with one copy and no HDF5 call.

    Such a chunk never moves once allocated (no filter changes its size; the dataset is never
    resized), so its address is looked up once. Torn reads are the caller's to detect (the
    state row carries a checksum). Use `MappedChunk.open`, and `close()` when done.
    """

    def __init__(self, dataset: h5py.Dataset, fd: int, address: int, nbytes: int) -> None:
        page = mmap.ALLOCATIONGRANULARITY
        start = address - address % page
        self._mm: mmap.mmap | None = mmap.mmap(fd, address - start + nbytes, access=mmap.ACCESS_READ, offset=start)
        os.close(fd)  # the map keeps the file
        self.values: np.ndarray = np.frombuffer(self._mm, dtype=plain_dtype(dataset.dtype),
                                                count=int(dataset.shape[0]), offset=address - start)
        """The dataset's values, live: copy them out (`np.copyto`) before use."""

    @classmethod
    def open(cls, dataset: h5py.Dataset) -> MappedChunk | None:
        """A map of `dataset`'s only chunk, or None when it is not one allocated, unfiltered chunk
        holding the whole (1-D, fixed-size) dataset in a regular file (then read through h5py)."""
        if _unmappable_reason(dataset) is not None or dataset.ndim != 1 or dataset.maxshape != dataset.shape:
            return None
        dcpl = dataset.id.get_create_plist()
        if dcpl.get_layout() != h5py.h5d.CHUNKED or tuple(dcpl.get_chunk()) != tuple(dataset.shape):
            return None
        info = dataset.id.get_chunk_info_by_coord((0,))
        nbytes = int(dataset.shape[0]) * dataset.dtype.itemsize
        if info.byte_offset is None or info.size != nbytes:
            return None  # not allocated (yet)
        userblock = 0 if _CHUNK_ADDRESSES_INCLUDE_USERBLOCK else int(dataset.file.id.get_create_plist().get_userblock())
        address = int(info.byte_offset) + userblock
        fd = MappedRows._open_fd(dataset)
        if os.fstat(fd).st_size < address + nbytes:
            os.close(fd)
            return None
        return cls(dataset, fd, address, nbytes)

    def close(self) -> None:
        """Release the map (views taken of `values` keep it alive until they go). Safe twice."""
        mm, self._mm = self._mm, None
        self.values = np.empty(0, dtype=self.values.dtype)
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass
