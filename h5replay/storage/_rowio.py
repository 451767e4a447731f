"""The private row-I/O engine: whole rows of one h5py ``Dataset`` through h5py's low-level API.

``read_sorted_unique_rows``, ``read_slice``, ``write_rows`` and ``write_sorted_unique_rows`` move
whole rows (axis 0), reusing one dataspace and type per dataset (h5py makes each anew per call,
~8-14 µs apiece). The memory type is the dataset's own file type, so bytes move unconverted:
numbers, bools (an HDF5 enum) and fixed-length UTF-8 strings (numpy ``S{k}``, which h5py's own
assignment cannot write). Other types (variable-length strings, compounds) fall back to h5py's
high-level indexing. Reads pick the cheapest strategy by a cost model measured on this machine.

How the file was opened matters as much: a reader opened without HDF5's sieve buffer and chunk
cache (``sieve_buf_size=0``, ``rdcc_nbytes=0``) reads random rows 1.7-4x faster, because every
scattered row otherwise drags a 64 KiB sieve or chunk-cache fill with it. That is the caller's
choice; nothing here depends on it.

This module must not know about spaces, groups or files: every function takes one open dataset,
and nothing here creates an HDF5 object. Callers normalise negative indices first; an index that
is out of range, unsorted or duplicated raises instead of silently reading nothing.
`indexing.py` re-exports the three functions the design document names.
"""

from __future__ import annotations

import functools
import math
import operator
import threading
import weakref
from typing import Any

import h5py
import numpy as np

__all__ = ["CHUNK_TARGET_BYTES", "read_sorted_unique_rows", "read_slice", "write_rows", "write_sorted_unique_rows",
           "write_points", "check_out", "plain_dtype", "raw_file_type"]

CHUNK_TARGET_BYTES = 64 * 1024
"""Default chunk size: whole rows of about 64 KiB, so one row lives in one chunk."""

# How read_sorted_unique_rows picks a strategy: an estimated cost in microseconds for each, the
# cheapest wins. The constants were measured on this project's 2-core VM (h5py 3.16, HDF5 2.0,
# warm page cache, default sieve and chunk cache) reading 256 random rows of 4 B ... 32 KiB.
# A low-level H5Dread costs ~20 µs with its selection; each run of consecutive rows read on its
# own ~10 µs (contiguous) or ~13 µs (chunked) plus the copy; a point selection ~0.25 µs per
# element; h5py's hyperslab union ~7 µs per run, but only on contiguous rank-2 data (on rank-4
# images it falls apart into tiny pieces and on chunked data it costs 10-100x the runs).
_US_PER_READ = 20.0
_US_PER_POINT = 0.25
_US_PER_RUN_CONTIGUOUS = 10.0
_US_PER_RUN_CHUNKED = 13.0
_US_PER_UNION_RUN = 7.0
_US_PER_RUN_BYTE = 1 / 2000.0  # copying a run out of the page cache, ~2 GB/s
_US_PER_SPAN_BYTE = 1 / 4000.0  # reading the bounding slice, ~4 GB/s
_MAX_SPAN_BYTES = 64 * 1024 * 1024  # never allocate more than this for the bounding slice
_MAX_UNION_ROW_BYTES = 32 * 1024  # measured: the union still wins at 32 KiB rows (rank 2)
_MAX_POINTS_PER_READ = 1 << 20  # bounds the coordinate array (16 MiB for rank-2 rows)
_MAX_CACHED_MSPACES = 32

# ---------------------------------------------------------------------------------------------
# Row I/O
# ---------------------------------------------------------------------------------------------


def read_sorted_unique_rows(
    dataset: h5py.Dataset, index: np.ndarray, out: np.ndarray | None = None
) -> np.ndarray:
    """Read ``dataset[index]`` for a sorted, duplicate-free set of rows. Blocks on the file.

    A single consecutive span is one slice read. Otherwise the cheapest of these is used, by a
    cost model measured on this machine: the bounding slice read once and picked in memory (when
    it wastes little), one point selection (rows of a few elements: ~2-5x faster than one read
    per row), h5py's hyperslab union (contiguous rank-2 rows up to 32 KiB), or one read per run
    of consecutive rows (large rows such as images, 4-100x faster than any combined selection).

    Args:
        dataset: An open dataset with at least one axis.
        index: 1-D integers, strictly increasing, each in ``[0, len(dataset))``.
        out: Optional C-contiguous, writeable array of shape ``(len(index), *row_shape)`` and the
            dataset's dtype, filled and returned.

    Returns:
        The rows, shape ``(len(index), *row_shape)``: ``S{k}`` for fixed-length strings, ``bool``
        for bools.

    Raises:
        TypeError: ``index`` is not an integer array, or ``out`` has the wrong dtype.
        ValueError: ``index`` is not 1-D or not strictly increasing; ``out`` has the wrong shape.
        IndexError: An index is negative or not below ``len(dataset)``.
    """
    io = _row_io(dataset)
    shape = dataset.shape
    rows, steps = _checked_rows(index, shape[0])
    n = rows.shape[0]
    out = io.output(n, out)
    if n == 0 or io.row_elems == 0:
        return out
    first, last = int(rows[0]), int(rows[-1])
    span = last - first + 1
    if io.mtype is None:
        out[...] = dataset[first : last + 1] if span == n else dataset[rows]
        return out
    if span == n:
        io.read_span(dataset.id, shape, first, out)
        return out
    run_starts = np.flatnonzero(steps != 1) + 1
    method = io.choose(n, run_starts.size + 1, span)
    if method == "span":
        buffer = np.empty((span, *io.row_shape), dtype=io.out_dtype)
        io.read_span(dataset.id, shape, first, buffer)
        np.take(buffer, rows - first, axis=0, out=out, mode="clip")
    elif method == "points":
        io.read_points(dataset.id, shape, rows, out)
    elif method == "union":
        # h5py builds the union in C (~7 µs/run against ~10 µs/run for read calls of our own).
        dataset.read_direct(out, source_sel=rows)
    else:
        io.read_runs(dataset.id, shape, rows, run_starts, out)
    return out


def read_slice(
    dataset: h5py.Dataset, start: int, stop: int, out: np.ndarray | None = None
) -> np.ndarray:
    """Read rows ``[start, stop)`` with one low-level read. Blocks on the file.

    Args:
        dataset: An open dataset with at least one axis.
        start: First row, ``0 <= start <= stop``.
        stop: One past the last row, ``stop <= len(dataset)``.
        out: Optional C-contiguous, writeable array of shape ``(stop - start, *row_shape)`` and
            the dataset's dtype, filled and returned.

    Returns:
        The rows, shape ``(stop - start, *row_shape)``.

    Raises:
        TypeError: ``start`` or ``stop`` is not an integer, or ``out`` has the wrong dtype.
        IndexError: The rows are not within ``[0, len(dataset)]``.
        ValueError: ``out`` has the wrong shape or layout.
    """
    io = _row_io(dataset)
    shape = dataset.shape
    start_row = _as_row_number(start, "start")
    stop_row = _as_row_number(stop, "stop")
    if not 0 <= start_row <= stop_row <= shape[0]:
        raise IndexError(
            f"rows [{start_row}, {stop_row}) are out of range for a dataset of {shape[0]} rows"
        )
    out = io.output(stop_row - start_row, out)
    if stop_row == start_row or io.row_elems == 0:
        return out
    if io.mtype is None:
        out[...] = dataset[start_row:stop_row]
        return out
    io.read_span(dataset.id, shape, start_row, out)
    return out


def write_slots(dataset: h5py.Dataset, rows: dict[int, np.ndarray], shape: tuple[int, ...]) -> None:
    """Write one-row arrays to their slots (row numbers, any order) with
    `write_sorted_unique_rows`: the records a group commit made, written together at its
    publish. `shape`: the dataset's current shape, which its writer keeps."""
    if rows:
        slots = sorted(rows)
        write_sorted_unique_rows(dataset, np.array(slots), np.concatenate([rows[s] for s in slots]), shape=shape)


def write_rows(
    dataset: h5py.Dataset, start: int, value: Any, num_rows: int | None = None, *,
    shape: tuple[int, ...] | None = None,
) -> bool:
    """Write ``dataset[start:start + n] = value`` with one low-level write, when that is exact.

    The fast path applies when ``value`` is a plain numpy array of ``n >= 1`` whole rows (shape
    ``(n, *row_shape)``, ``n == num_rows`` if given), the rows fit in the dataset's current
    length, and ``value``'s dtype equals the dataset's or numpy casts it safely (``int16`` into
    ``float32``; ``S4`` into ``S8``; not ``float64`` into ``float32``, nor ``U`` into ``S``).
    Fixed-length strings are written as raw ``S{k}`` bytes, unconverted.

    Args:
        dataset: An open, writable dataset with at least one axis.
        start: First row to write.
        value: The rows.
        num_rows: The expected number of rows, if the caller knows it.
        shape: The dataset's current shape, if the caller knows it (a resizable dataset's is
            otherwise asked of h5py, ~15 us).

    Returns:
        True when the rows were written; False, having written nothing, when the fast path does
        not apply (the caller falls back to h5py assignment, which broadcasts and converts).

    Raises:
        TypeError: ``start`` is not an integer.
    """
    io = _row_io(dataset)
    return io.write_rows(dataset.id, shape or io.fixed_shape or dataset.shape, start, value, num_rows)


def write_sorted_unique_rows(
    dataset: h5py.Dataset, index: np.ndarray, value: Any, *, shape: tuple[int, ...] | None = None,
) -> None:
    """Write ``dataset[index] = value`` as one write per run of consecutive rows. Blocks.

    Each run goes through ``write_rows``; a run it refuses (a dtype that needs HDF5's
    conversion, say) is written by h5py's slice assignment instead. Runs are written in order with
    no rollback: if one fails, earlier runs stay written.

    Args:
        dataset: An open, writable dataset with at least one axis.
        index: 1-D integers, strictly increasing, each in ``[0, len(dataset))``.
        value: ``len(index)`` rows, or anything numpy broadcasts to them (one row, a scalar).
        shape: The dataset's current shape, if the caller knows it (as for ``write_rows``).

    Raises:
        TypeError: ``index`` is not an integer array.
        ValueError: ``index`` is not 1-D or not strictly increasing, or ``value`` does not fit.
        IndexError: An index is negative or not below ``len(dataset)``.
    """
    io = _row_io(dataset)
    shape = dataset.shape if shape is None else shape
    rows, steps = _checked_rows(index, shape[0])
    n = rows.shape[0]
    values = io.as_rows(value, n)
    if n == 0:
        return
    run_starts = (np.flatnonzero(steps != 1) + 1).tolist()
    bounds = zip([0, *run_starts], [*run_starts, n], strict=True)
    for a, b in bounds:
        first = int(rows[a])
        part = values[a:b]
        if not io.write_rows(dataset.id, shape, first, part, b - a):
            dataset[first : first + (b - a)] = part


def write_points(dataset: h5py.Dataset, index: np.ndarray, values: np.ndarray) -> None:
    """Write ``dataset[index] = values`` on a 1-D dataset of numbers with one point selection.

    For a few hundred scattered elements (priorities, counters) this is ~15x faster than one write
    per run (~1.3 µs an element against ~20 µs a run). ``index`` must be sorted, duplicate-free
    and in range; ``values`` of the dataset's dtype, one per index.

    Raises:
        ValueError: not a 1-D dataset, or ``values`` does not match ``index``.
    """
    if len(dataset.shape) != 1:
        raise ValueError(f"write_points needs a 1-D dataset, {dataset.name!r} has shape {dataset.shape}")
    rows, _ = _checked_rows(index, dataset.shape[0])
    data = np.ascontiguousarray(values, dtype=dataset.dtype)
    if data.shape != rows.shape:
        raise ValueError(f"{rows.shape[0]} points but values of shape {data.shape}")
    if rows.shape[0] == 0:
        return
    io = _row_io(dataset)
    with io.lock:
        fspace = dataset.id.get_space()
        fspace.select_elements(rows.astype(np.uint64).reshape(-1, 1))
        dataset.id.write(io.mspace((rows.shape[0],)), fspace, data)


# ---------------------------------------------------------------------------------------------
# Internals
# ---------------------------------------------------------------------------------------------


def _checked_rows(index: Any, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Validate a sorted, duplicate-free row index; return it as intp plus its steps."""
    rows = np.asarray(index)
    if rows.size == 0 and rows.ndim == 1 and rows.dtype.kind in "iuf":
        empty = np.empty(0, dtype=np.intp)
        return empty, empty
    if rows.dtype.kind not in "iu":
        raise TypeError(f"a row index must be an integer array, got dtype {rows.dtype}")
    if rows.ndim != 1:
        raise ValueError(f"a row index must be 1-D, got shape {rows.shape}")
    if rows.dtype.kind == "u" and int(rows.max()) > np.iinfo(np.intp).max:
        raise IndexError(
            f"row {int(rows.max())} is out of range for a dataset of {num_rows} rows"
        )
    rows = rows.astype(np.intp, copy=False)
    steps = np.diff(rows)
    if rows.size > 1 and int(steps.min()) <= 0:
        pos = int(np.argmax(steps <= 0))
        raise ValueError(
            "a row index must be strictly increasing (sorted, no duplicates): "
            f"index[{pos}]={int(rows[pos])} is followed by {int(rows[pos + 1])}"
        )
    if int(rows[0]) < 0:
        raise IndexError(
            f"row {int(rows[0])} is negative; normalise negative indices (i + len) first"
        )
    if int(rows[-1]) >= num_rows:
        raise IndexError(
            f"row {int(rows[-1])} is out of range for a dataset of {num_rows} rows"
        )
    return rows, steps


def _as_row_number(value: Any, name: str) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer row number, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer row number, got {value!r}") from None


def plain_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """The dtype without h5py's metadata (``S8`` rather than ``S8`` tagged utf-8)."""
    if dtype.kind in "biufcS" and dtype.fields is None and dtype.subdtype is None:
        return np.dtype(dtype.str)
    return dtype


def raw_file_type(dtype: np.dtype[Any], file_type: h5py.h5t.TypeID) -> bool:
    """Whether the dataset's bytes are exactly numpy's bytes for ``dtype``.

    True for numbers (any byte order h5py reports), bools (h5py's one-byte enum), complex (h5py's
    {r, i} compound) and null-padded fixed-length strings; False for variable-length and
    space-padded strings, compounds and anything whose size differs.
    """
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
        return False
    if dtype.kind not in "biufcS" or file_type.get_size() != dtype.itemsize:
        return False
    if dtype.kind == "S":
        return (
            isinstance(file_type, h5py.h5t.TypeStringID)
            and not file_type.is_variable_str()
            and file_type.get_strpad() == h5py.h5t.STR_NULLPAD
        )
    if dtype.kind == "b":
        return isinstance(file_type, h5py.h5t.TypeEnumID)
    return True



def check_out(out: Any, shape: tuple[int, ...], dtype: np.dtype[Any]) -> None:
    """Check an `out=` array for rows: an ndarray of exactly `shape` and `dtype`, C-contiguous
    and writeable.

    Raises:
        TypeError: not an ndarray, or another dtype.
        ValueError: another shape, or not C-contiguous and writeable.
    """
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy array, got {type(out).__name__}")
    if out.shape != shape:
        raise ValueError(f"out has shape {out.shape}, expected {shape}")
    if out.dtype != dtype:
        raise TypeError(f"out has dtype {out.dtype}, expected the dataset's {dtype}")
    if not (out.flags.c_contiguous and out.flags.writeable):
        raise ValueError("out must be a C-contiguous, writeable array")

class _RowIO:
    """What one open dataset needs for low-level row I/O, computed once.

    Holds no reference to the dataset: every method takes the ``DatasetID`` and the current
    shape. The lock makes "select then read" atomic when threads share a dataset.
    """

    __slots__ = (
        "out_dtype",
        "row_shape",
        "row_elems",
        "row_bytes",
        "rank",
        "fixed_shape",
        "chunked",
        "mtype",
        "lock",
        "_fspace",
        "_fspace_shape",
        "_mspaces",
        "_inner_coords",
        "_zeros",
    )

    def __init__(self, dataset: h5py.Dataset) -> None:
        shape = dataset.shape
        if shape is None or len(shape) == 0:
            raise TypeError(
                f"dataset {dataset.name!r} has shape {shape}; row I/O needs at least one axis"
            )
        dtype = dataset.dtype
        self.out_dtype = plain_dtype(dtype)
        self.row_shape: tuple[int, ...] = tuple(shape[1:])
        self.row_elems = math.prod(self.row_shape)
        self.row_bytes = self.row_elems * dtype.itemsize
        self.rank = len(shape)
        # A dataset that cannot be resized keeps its shape: no need to ask h5py again (its
        # Dataset.shape costs ~15 us a call, and a commit writes several rows).
        self.fixed_shape: tuple[int, ...] | None = tuple(shape) if dataset.maxshape == shape else None
        dsid = dataset.id
        self.chunked = dsid.get_create_plist().get_layout() == h5py.h5d.CHUNKED
        file_type = dsid.get_type()
        self.mtype: h5py.h5t.TypeID | None = (
            file_type if raw_file_type(dtype, file_type) else None
        )
        self.lock = threading.Lock()
        self._fspace: h5py.h5s.SpaceID | None = None
        self._fspace_shape: tuple[int, ...] | None = None
        self._mspaces: dict[tuple[int, ...], h5py.h5s.SpaceID] = {}
        self._inner_coords: np.ndarray | None = None
        self._zeros = (0,) * len(self.row_shape)

    # -- helpers ---------------------------------------------------------------------------

    def output(self, n: int, out: np.ndarray | None) -> np.ndarray:
        expected = (n, *self.row_shape)
        if out is None:
            return np.empty(expected, dtype=self.out_dtype)
        check_out(out, expected, self.out_dtype)
        return out

    def choose(self, n: int, num_runs: int, span: int) -> str:
        """The cheapest read strategy by the measured cost model (see the module constants)."""
        per_run = _US_PER_RUN_CHUNKED if self.chunked else _US_PER_RUN_CONTIGUOUS
        costs = {
            "runs": num_runs * per_run + n * self.row_bytes * _US_PER_RUN_BYTE,
            "points": _US_PER_READ + n * self.row_elems * _US_PER_POINT,
        }
        if (
            not self.chunked
            and self.rank == 2
            and self.row_bytes <= _MAX_UNION_ROW_BYTES
            and self.out_dtype.kind in "biuf"
        ):
            costs["union"] = _US_PER_READ + num_runs * _US_PER_UNION_RUN
        span_bytes = span * self.row_bytes
        if span_bytes <= _MAX_SPAN_BYTES:
            costs["span"] = _US_PER_READ + span_bytes * _US_PER_SPAN_BYTE
        return min(costs, key=costs.__getitem__)

    def file_space(self, dsid: h5py.h5d.DatasetID, shape: tuple[int, ...]) -> h5py.h5s.SpaceID:
        # Getting a dataspace costs ~10 µs; reuse it until the dataset's extent changes.
        if self._fspace is None or shape != self._fspace_shape:
            self._fspace = dsid.get_space()
            self._fspace_shape = shape
        return self._fspace

    def mspace(self, shape: tuple[int, ...]) -> h5py.h5s.SpaceID:
        space = self._mspaces.get(shape)
        if space is None:
            if len(self._mspaces) >= _MAX_CACHED_MSPACES:
                self._mspaces.clear()
            space = self._mspaces[shape] = h5py.h5s.create_simple(shape)
        return space

    def inner_coords(self) -> np.ndarray:
        """Coordinates of every element within one row, shape ``(row_elems, rank - 1)``."""
        if self._inner_coords is None:
            grid = np.indices(self.row_shape, dtype=np.uint64)
            self._inner_coords = grid.reshape(len(self.row_shape), -1).T.copy()
        return self._inner_coords

    # -- reads (callers hold validated arguments; ``out`` is C-contiguous) --------------------

    def read_span(
        self, dsid: h5py.h5d.DatasetID, shape: tuple[int, ...], first: int, out: np.ndarray
    ) -> None:
        count = (out.shape[0], *self.row_shape)
        with self.lock:
            fspace = self.file_space(dsid, shape)
            fspace.select_hyperslab((first, *self._zeros), count)
            dsid.read(self.mspace(count), fspace, out, self.mtype)

    def read_runs(
        self,
        dsid: h5py.h5d.DatasetID,
        shape: tuple[int, ...],
        rows: np.ndarray,
        run_starts: np.ndarray,
        out: np.ndarray,
    ) -> None:
        starts = [0, *run_starts.tolist()]
        stops = [*starts[1:], rows.shape[0]]
        firsts = rows[starts].tolist()
        zeros, row_shape, mtype = self._zeros, self.row_shape, self.mtype
        with self.lock:
            fspace = self.file_space(dsid, shape)
            for a, b, first in zip(starts, stops, firsts, strict=True):
                count = (b - a, *row_shape)
                fspace.select_hyperslab((first, *zeros), count)
                dsid.read(self.mspace(count), fspace, out[a:b], mtype)

    def read_points(
        self, dsid: h5py.h5d.DatasetID, shape: tuple[int, ...], rows: np.ndarray, out: np.ndarray
    ) -> None:
        rows_per_read = max(1, _MAX_POINTS_PER_READ // self.row_elems)
        with self.lock:
            fspace = self.file_space(dsid, shape)
            for a in range(0, rows.shape[0], rows_per_read):
                part = rows[a : a + rows_per_read]
                k = part.shape[0]
                if self.rank == 1:
                    coords = part.astype(np.uint64).reshape(k, 1)
                else:
                    grid = np.empty((k, self.row_elems, self.rank), dtype=np.uint64)
                    grid[:, :, 0] = part[:, None]
                    grid[:, :, 1:] = self.inner_coords()
                    coords = grid.reshape(k * self.row_elems, self.rank)
                fspace.select_elements(coords)
                dsid.read(self.mspace((k * self.row_elems,)), fspace, out[a : a + k], self.mtype)

    # -- writes ------------------------------------------------------------------------------

    def write_rows(
        self,
        dsid: h5py.h5d.DatasetID,
        shape: tuple[int, ...],
        start: Any,
        value: Any,
        num_rows: int | None,
    ) -> bool:
        if self.mtype is None or not isinstance(value, np.ndarray):
            return False
        if isinstance(value, np.ma.MaskedArray) or value.ndim != self.rank:
            return False
        if value.shape[1:] != self.row_shape:
            return False
        n = value.shape[0]
        if n < 1 or (num_rows is not None and n != num_rows):
            return False
        first = _as_row_number(start, "start")
        if first < 0 or first + n > shape[0]:
            return False
        if value.dtype != self.out_dtype:
            if not np.can_cast(value.dtype, self.out_dtype, "safe"):
                return False
            value = value.astype(self.out_dtype)
        value = np.ascontiguousarray(value)
        if self.row_elems == 0:
            return True
        count = (n, *self.row_shape)
        with self.lock:
            fspace = self.file_space(dsid, shape)
            fspace.select_hyperslab((first, *self._zeros), count)
            dsid.write(self.mspace(count), fspace, value, self.mtype)
        return True

    def as_rows(self, value: Any, n: int) -> np.ndarray:
        """``value`` as ``n`` rows (a broadcast view when it is one row or a scalar)."""
        if isinstance(value, np.ndarray):
            array: np.ndarray = value
        else:
            array = np.asarray(value, dtype=self.out_dtype if self.out_dtype.kind == "O" else None)
        expected = (n, *self.row_shape)
        if array.shape == expected:
            return array
        try:
            rows: np.ndarray = np.broadcast_to(array, expected)
        except ValueError:
            raise ValueError(
                f"a value of shape {array.shape} cannot be written to {n} rows of shape "
                f"{self.row_shape}; pass shape {expected} or one row"
            ) from None
        return rows


# One _RowIO per open DatasetID object, keyed by identity (h5py ids hash by file and address, so
# an id of a closed file could alias a new one). The entry goes when the DatasetID object does.
_ROW_IO: dict[int, tuple[weakref.ReferenceType[Any], _RowIO]] = {}


def _forget_row_io(key: int, ref: weakref.ReferenceType[Any]) -> None:
    entry = _ROW_IO.get(key)
    if entry is not None and entry[0] is ref:
        del _ROW_IO[key]


def _row_io(dataset: h5py.Dataset) -> _RowIO:
    if not isinstance(dataset, h5py.Dataset):
        raise TypeError(f"expected an h5py.Dataset, got {type(dataset).__name__}")
    dsid = dataset.id
    key = id(dsid)
    entry = _ROW_IO.get(key)
    if entry is not None and entry[0]() is dsid:
        return entry[1]
    io = _RowIO(dataset)
    _ROW_IO[key] = (weakref.ref(dsid, functools.partial(_forget_row_io, key)), io)
    return io

