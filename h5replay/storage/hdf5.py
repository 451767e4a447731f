"""HDF5Storage: rows of one (nested) space in one HDF5 file, one dataset per leaf.

This module owns the file: creating it (atomically, under a temporary name renamed into place),
opening it (plain, SWMR writer or SWMR reader), its attributes (format version, space as JSON,
capacity) and the row I/O of `get` / `set`. It never decides where rows go: ring arithmetic and
episode bookkeeping live in `replay_buffer.py`; streaming segments in `segment.py`.

Layout of a file::

    /                       attrs: h5replay_format_version, h5replay_space (JSON), h5replay_capacity
    /<leaf path>            one dataset per leaf ("obs/image"); a bare leaf space is stored as "data"
    /_h5replay/staging/...  hidden rows of open segment writers (never part of the space)
    /_h5replay/replay/...   ReplayBuffer bookkeeping, when the file belongs to one

Every HDF5 object exists before SWMR starts (SWMR forbids creating objects later). Text leaves are
fixed-length UTF-8 byte fields, because SWMR cannot write variable-length strings.

Not thread-safe: one thread at a time per storage (h5py serialises HDF5 calls anyway).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import typing
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import h5py
import numpy as np

from h5replay.errors import (
    ClosedError,
    ConfigError,
    FormatVersionError,
    ReadOnlyError,
    SpaceMismatchError,
    StorageError,
)
from h5replay.storage import _layout
from h5replay.storage.fastread import MappedRows
from h5replay.storage.indexing import (
    fancy_indexing_to_supported_indexing,
    fancy_indexing_to_supported_set_indexing,
    read_slice,
    read_sorted_unique_rows,
    write_rows,
    write_sorted_unique_rows,
)
from h5replay.storage.recovery import WriterLock, clear_status_flags, status_flags
from h5replay.storage.spaces import (
    DEFAULT_KEY,
    BinarySpace,
    BoxSpace,
    DictSpace,
    LeafSpace,
    Space,
    TextSpace,
    flatten_value,
    named_leaves,
    space_from_json,
    unflatten_value,
)

if TYPE_CHECKING:
    from h5replay.storage.replay_buffer import ReplayBuffer
    from h5replay.storage.segment import SegmentWriter

__all__ = ["HDF5Storage", "FORMAT_VERSION"]

log = logging.getLogger("h5replay.storage")

FORMAT_VERSION = 1
ATTR_FORMAT = "h5replay_format_version"
ATTR_SPACE = "h5replay_space"
ATTR_CAPACITY = "h5replay_capacity"
INTERNAL_GROUP = "_h5replay"
_SWMR_WRITE_FLAG = 0x04  # superblock status flag: open for SWMR writing
# HDF5 format bounds: v110 structures are what SWMR needs; capping at v114 keeps files readable by
# HDF5 1.14 tools even when h5py is built on HDF5 2.x.
_LIBVER = ("v110", "v114")


@contextlib.contextmanager
def h5_errors(what: str) -> Iterator[None]:
    """Turn h5py / HDF5 failures into StorageError naming what was being done (the one place)."""
    try:
        yield
    except (OSError, RuntimeError, KeyError) as exc:
        if isinstance(exc, (FileNotFoundError, IndexError)):
            raise
        raise StorageError(f"HDF5 failed while {what}: {exc}") from exc


def _libver() -> tuple[str, str]:
    # h5py learnt the 'v114' bound in 3.6; older ones only know 'latest' as the upper bound.
    from h5py._hl import files as _files

    return _LIBVER if "v114" in getattr(_files, "libver_dict", {}) else ("v110", "latest")


def _h5_dtype(leaf: LeafSpace) -> Any:
    if isinstance(leaf, TextSpace):
        return h5py.string_dtype("utf-8", length=leaf.storage_dtype.itemsize)
    return leaf.storage_dtype


def _normalize_int(i: Any, length: int) -> int:
    j = int(i)
    if j < 0:
        j += length
    if not 0 <= j < length:
        raise IndexError(f"index {int(i)} is out of range for {length} rows")
    return j


def normalize_index(index: Any, length: int) -> tuple[str, Any]:
    """Classify a row index: ('int', i), ('slice', (start, stop)) or ('array', int64 ndarray).

    Negative values count from the end; every row is range-checked. Stepped slices and boolean
    masks become arrays. Raises IndexError (out of range) or TypeError (not an index).
    """
    if isinstance(index, (bool, np.bool_)):
        raise TypeError("a boolean is not a row index; use a boolean mask array")
    if isinstance(index, (int, np.integer)):
        return "int", _normalize_int(index, length)
    if index is Ellipsis:
        return "slice", (0, length)
    if isinstance(index, slice):
        start, stop, step = index.indices(length)
        if step == 1:
            return "slice", (start, max(start, stop))
        return "array", np.arange(start, stop, step, dtype=np.int64)
    if isinstance(index, (list, tuple)):
        index = np.asarray(index) if len(index) else np.zeros(0, dtype=np.int64)
    if isinstance(index, np.ndarray):
        if index.dtype.kind == "b":
            if index.shape != (length,):
                raise IndexError(f"boolean mask has shape {index.shape} but the storage has {length} rows")
            return "array", np.flatnonzero(index).astype(np.int64)
        if index.dtype.kind not in "iu":
            raise TypeError(f"row indices must be integers, got an array of {index.dtype}")
        if index.ndim == 0:
            return "int", _normalize_int(index[()], length)
        idx = index.astype(np.int64, copy=True)
        if idx.size:
            neg = idx < 0
            if neg.any():
                idx[neg] += length
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= length:
                bad = int(index.reshape(-1)[np.argmax((idx.reshape(-1) < 0) | (idx.reshape(-1) >= length))])
                raise IndexError(f"index {bad} is out of range for {length} rows")
        return "array", idx
    raise TypeError(f"unsupported row index of type {type(index).__name__}: use an int, slice, list, int array or mask")


class HDF5Storage:
    """Rows of `single_instance_space` in one HDF5 file, one dataset per leaf.

    Build one with `create` or `load_from`. The constructor wraps an already-open h5py root
    (File, Group or, for a single-leaf column, Dataset); `owns_root=False` marks a view that
    must not close the file.
    """

    DEFAULT_KEY = DEFAULT_KEY
    single_file_ext = ".hdf5"
    #: Memory a segment writer may buffer before it spills rows to the file's staging area.
    DEFAULT_SEGMENT_BUFFER_BYTES = 8 * 1024 * 1024

    def __init__(
        self,
        single_instance_space: Space,
        root: h5py.Group | h5py.Dataset | None,
        capacity: int | None = None,
        reduce_io: bool = True,
        check_file: bool = True,
        is_mutable: bool | None = None,
        multiprocessing: bool = False,
        filename: str | os.PathLike[str] | None = None,
        mode: str | None = None,
        full_name: str | None = None,
        h5py_kwargs: dict[str, Any] | None = None,
        length: int | None = None,
        owns_root: bool = True,
    ) -> None:
        if capacity is not None and (isinstance(capacity, bool) or int(capacity) < 1):
            raise ConfigError(f"capacity must be a positive int or None, got {capacity!r}")
        self.single_instance_space = single_instance_space
        self.capacity = None if capacity is None else int(capacity)
        self.reduce_io = reduce_io
        self.multiprocessing = multiprocessing
        self._owns_root = owns_root
        self._h5py_kwargs = dict(h5py_kwargs or {})
        self._full_name = full_name
        self._closed = False
        self._root: h5py.Group | h5py.Dataset | None = None
        self._file: h5py.File | None = None
        self._datasets: dict[str, h5py.Dataset] = {}
        self._mapped: dict[str, MappedRows | None] = {}
        self._dirty = False
        self._cursor: int | None = None
        self._writers: weakref.WeakSet[SegmentWriter] = weakref.WeakSet()
        self._staging: Any = None
        self._writer_lock: WriterLock | None = None
        self.segment_buffer_bytes = self.DEFAULT_SEGMENT_BUFFER_BYTES
        self._leaves = named_leaves(single_instance_space)
        if root is not None:
            self.filename: str | None = os.fspath(root.file.filename)
            self._mode = mode or ("r" if root.file.mode == "r" else "r+")
            self._full_name = full_name if full_name is not None else (root.name if root.name != "/" else None)
        else:
            if filename is None:
                raise ConfigError("HDF5Storage needs an open root or a filename")
            if check_file:
                raise ConfigError("check_file needs an open root; pass check_file=False for a lazily opened file")
            self.filename = os.fspath(filename)
            self._mode = mode or "r"
        self.is_mutable = (self._mode != "r") if is_mutable is None else bool(is_mutable)
        if root is not None:
            self._attach(root, check_file)
            self._len = self._read_length() if length is None else int(length)
        else:
            self._len = int(length if length is not None else (capacity or 0))

    # ------------------------------------------------------------------ opening and closing

    def _attach(self, root: h5py.Group | h5py.Dataset, check_file: bool) -> None:
        self._root = root
        self._file = None
        self._datasets = {}
        for path, leaf in self._leaves:
            if isinstance(root, h5py.Dataset):
                ds = root
            else:
                try:
                    ds = root[path]
                except KeyError as exc:
                    raise SpaceMismatchError(f"the file has no dataset for field '{path}'") from exc
            if not isinstance(ds, h5py.Dataset):
                raise SpaceMismatchError(f"'{path}' in the file is a group, but the space has a leaf there")
            if check_file:
                self._check_dataset(path, leaf, ds)
            self._datasets[path] = ds
        self._mapped = {}

    def _check_dataset(self, path: str, leaf: LeafSpace, ds: h5py.Dataset) -> None:
        if ds.shape[1:] != leaf.shape:
            raise SpaceMismatchError(f"dataset '{path}' has rows of shape {ds.shape[1:]} but the space expects {leaf.shape}")
        if isinstance(leaf, TextSpace):
            if ds.dtype.kind not in "SO":
                raise SpaceMismatchError(f"dataset '{path}' has dtype {ds.dtype} but text needs strings")
            if ds.dtype.kind == "S" and ds.dtype.itemsize < leaf.max_length:
                raise SpaceMismatchError(f"dataset '{path}' holds {ds.dtype.itemsize} bytes, less than max_length {leaf.max_length}")
        elif ds.dtype != leaf.storage_dtype:
            raise SpaceMismatchError(f"dataset '{path}' has dtype {ds.dtype} but the space expects {leaf.storage_dtype}")
        if self.capacity is not None and ds.maxshape[0] != self.capacity and ds.shape[0] != self.capacity:
            raise SpaceMismatchError(f"dataset '{path}' holds {ds.shape[0]} rows but the capacity is {self.capacity}")

    def _read_length(self) -> int:
        if self.capacity is not None:
            return self.capacity
        lengths = {ds.shape[0] for ds in self._datasets.values()}
        return min(lengths) if lengths else 0

    def _ensure_open(self) -> None:
        if self._closed:
            raise ClosedError(f"this storage of {self.filename!r} was closed")
        if self._root is not None:
            return
        if self.filename is None:
            raise ClosedError("this storage has no file to reopen")
        kwargs = dict(self._h5py_kwargs)
        if self._mode == "r" and self.multiprocessing:
            kwargs["swmr"] = True
        with h5_errors(f"opening {self.filename}"):
            try:
                f = h5py.File(self.filename, self._mode, **kwargs)
            except OSError:
                if self._mode != "r" or "locking" in kwargs:
                    raise
                # Another process holds the file for writing (HDF5 locks it), or this process opened
                # it with other locking flags: a reader of flushed data may skip the lock.
                f = h5py.File(self.filename, self._mode, locking=False, **kwargs)
        root = f if self._full_name is None else f[self._full_name]
        self._owns_root = True
        self._attach(root, check_file=False)
        self._len = self._read_length()

    @property
    def root(self) -> h5py.Group | h5py.Dataset:
        """The h5py root (opened lazily after unpickling)."""
        self._ensure_open()
        return typing.cast("h5py.Group | h5py.Dataset", self._root)

    def close(self) -> None:
        """Close the file (when this storage owns it). Safe to call twice. Open segment writers die."""
        if self._closed:
            return
        for writer in list(self._writers):
            writer._invalidate("its storage was closed")
        self._cursor = None
        for mapped in self._mapped.values():
            if mapped is not None:
                mapped.close()
        self._mapped = {}
        root, self._root = self._root, None
        self._file = None
        self._datasets = {}
        self._closed = True
        if root is not None and self._owns_root:
            with contextlib.suppress(Exception):
                root.file.close()
        if self._writer_lock is not None:
            self._writer_lock.release()

    def __enter__(self) -> HDF5Storage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __getstate__(self) -> dict[str, Any]:
        return {
            "space": self.single_instance_space.to_json(),
            "filename": self.filename,
            "full_name": self._full_name,
            "capacity": self.capacity,
            "reduce_io": self.reduce_io,
            "multiprocessing": self.multiprocessing,
            "length": self._len,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A pickled storage reopens read-only by filename, lazily, in whatever process unpickles it.
        self.__init__(  # type: ignore[misc]
            space_from_json(state["space"]),
            None,
            capacity=state["capacity"],
            reduce_io=state["reduce_io"],
            check_file=False,
            is_mutable=False,
            multiprocessing=state["multiprocessing"],
            filename=state["filename"],
            mode="r",
            full_name=state["full_name"],
            length=state["length"],
        )

    # ------------------------------------------------------------------ properties

    def __len__(self) -> int:
        return self._len

    @property
    def is_multiprocessing_safe(self) -> bool:
        return self.multiprocessing or not self.is_mutable

    @property
    def cache_filename(self) -> str | None:
        return self.filename

    @property
    def file(self) -> h5py.File:
        """The h5py File (kept: h5py builds a new File object on every `.file` access)."""
        if self._file is None:
            self._file = self.root.file
        return self._file

    @property
    def leaves(self) -> list[tuple[str, LeafSpace]]:
        """(dataset path, leaf space) for every leaf, in storage order."""
        return list(self._leaves)

    def dataset(self, path: str) -> h5py.Dataset:
        """The h5py dataset of one leaf."""
        self._ensure_open()
        return self._datasets[path]

    def _require_mutable(self, what: str) -> None:
        self._ensure_open()
        if not self.is_mutable:
            raise ReadOnlyError(f"cannot {what}: {self.filename!r} is open read-only")

    # ------------------------------------------------------------------ creation and loading

    @classmethod
    def create(
        cls,
        single_instance_space: Space,
        capacity: int | None,
        cache_path: str | os.PathLike[str] | None = None,
        multiprocessing: bool = False,
        initial_capacity: int | None = None,
        compression: Mapping[str, Any] | str | None = None,
        compression_level: Mapping[str, Any] | int | None = None,
        chunks: Mapping[str, Any] | bool | tuple[int, ...] | None = None,
        reduce_io: bool = True,
        **kwargs: Any,
    ) -> HDF5Storage:
        """Create a new file at `cache_path` and return a writable storage over it.

        The file is built under a temporary name in the same directory and renamed into place, so
        a crash never leaves a half-made file at `cache_path`. With `multiprocessing=True` the
        file is then held in SWMR write mode: other processes may open it with
        `load_from(path, space, read_only=True, multiprocessing=True)` while this one writes.

        Extra keyword arguments: `overwrite=False` (replace an existing file), `before_swmr`
        (a callable given the root group to add datasets before SWMR starts; used by
        ReplayBuffer), `segment_buffer_bytes`, and anything else goes to `h5py.File`.

        Raises:
            ConfigError: a missing path, an existing file without overwrite, or invalid options.
        """
        if cache_path is None:
            raise ConfigError("HDF5Storage.create needs cache_path: the file to create")
        overwrite = bool(kwargs.pop("overwrite", False))
        before_swmr: Callable[[h5py.Group], None] | None = kwargs.pop("before_swmr", None)
        buffer_bytes = kwargs.pop("segment_buffer_bytes", None)
        path = os.fspath(cache_path)
        if os.path.isdir(path):
            raise ConfigError(f"cache_path {path!r} is a directory; give the path of the file to create")
        if os.path.exists(path) and not overwrite:
            raise ConfigError(f"{path!r} already exists; open it with load_from, or pass overwrite=True")
        if capacity is not None:
            if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
                raise ConfigError(f"capacity must be a positive int or None, got {capacity!r}")
            if initial_capacity is not None and initial_capacity != capacity:
                raise ConfigError("with a fixed capacity, initial_capacity must be None or equal to it")
        initial_rows = 0 if initial_capacity is None else int(initial_capacity)
        if initial_rows < 0:
            raise ConfigError(f"initial_capacity must be >= 0, got {initial_capacity!r}")
        leaves = named_leaves(single_instance_space)
        if not leaves:
            raise ConfigError("the space has no leaves; an empty DictSpace cannot be stored")
        layouts = {
            p: _layout.dataset_kwargs(
                p, leaf.shape, leaf.row_bytes, capacity, initial_rows,
                compression=compression, compression_level=compression_level,
                chunks=chunks, multiprocessing=multiprocessing,
            )
            for p, leaf in leaves
        }
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        lock = WriterLock(path).acquire()
        try:
            storage = cls._create_locked(
                single_instance_space, capacity, path, multiprocessing, leaves, layouts, reduce_io,
                before_swmr, buffer_bytes, kwargs,
            )
        except BaseException:
            lock.release()
            raise
        storage._writer_lock = lock
        return storage

    @classmethod
    def _create_locked(
        cls, single_instance_space: Space, capacity: int | None, path: str, multiprocessing: bool,
        leaves: list[tuple[str, LeafSpace]], layouts: dict[str, dict[str, Any]], reduce_io: bool,
        before_swmr: Callable[[h5py.Group], None] | None, buffer_bytes: int | None, kwargs: dict[str, Any],
    ) -> HDF5Storage:
        """The body of `create`, run while holding the file's writer lock."""
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".h5replay-", suffix=".tmp", dir=directory)
        os.close(fd)
        try:
            try:
                f = h5py.File(tmp, "w", libver=_libver(), **kwargs)
            except TypeError as exc:
                raise ConfigError(f"invalid h5py.File option: {exc}") from exc
            with h5_errors(f"creating {path}"):
                for p, leaf in leaves:
                    f.create_dataset(p, dtype=_h5_dtype(leaf), **layouts[p])
                f.attrs[ATTR_FORMAT] = FORMAT_VERSION
                f.attrs[ATTR_SPACE] = json.dumps(single_instance_space.to_json())
                f.attrs[ATTR_CAPACITY] = -1 if capacity is None else int(capacity)
                internal = f.create_group(INTERNAL_GROUP)
                from h5replay.storage.segment import create_staging  # staging layout lives with the writer

                create_staging(internal, leaves)
                if before_swmr is not None:
                    before_swmr(f)
                f.flush()
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(Exception):
                f.close()
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        storage = cls(
            single_instance_space, f, capacity=capacity, reduce_io=reduce_io, check_file=True,
            is_mutable=True, multiprocessing=multiprocessing, h5py_kwargs=kwargs,
        )
        storage.filename = path
        if buffer_bytes is not None:
            storage.segment_buffer_bytes = int(buffer_bytes)
        if multiprocessing:
            with h5_errors("starting SWMR write mode"):
                f.swmr_mode = True
        return storage

    @classmethod
    def load_from(
        cls,
        path: str | os.PathLike[str],
        single_instance_space: Space | None,
        *,
        capacity: int | None = None,
        read_only: bool = True,
        multiprocessing: bool = False,
        reduce_io: bool = True,
        **kwargs: Any,
    ) -> HDF5Storage:
        """Open an existing file. The space and capacity are read from the file when it has them.

        `read_only=False, multiprocessing=True` reopens the file as the SWMR writer;
        `read_only=True, multiprocessing=True` opens it as an SWMR reader that sees rows the
        writer flushed (call `refresh()` to pick up new ones).

        Raises:
            FileNotFoundError: no file at `path`.
            FormatVersionError: the file was written by an unknown h5replay format.
            SpaceMismatchError: the file does not hold `single_instance_space`.
            StorageError: HDF5 cannot open the file.
        """
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no HDF5 file at {path!r}")
        buffer_bytes = kwargs.pop("segment_buffer_bytes", None)
        h5kw = dict(kwargs)
        mode = "r" if read_only else "r+"
        if not read_only:
            h5kw.setdefault("libver", _libver())  # SWMR writing needs the v110 format bounds
        if read_only and multiprocessing:
            h5kw["swmr"] = True
            h5kw.setdefault("locking", False)
        lock = None if read_only else WriterLock(path).acquire()
        try:
            if lock is not None and clear_status_flags(path):
                log.warning("%s was not closed cleanly (its writer died); cleared its status flags and reopening "
                            "it at its last published state", path)
            with h5_errors(f"opening {path}"):
                try:
                    f = h5py.File(path, mode, **h5kw)
                except TypeError as exc:
                    raise ConfigError(f"invalid h5py.File option: {exc}") from exc
                except OSError:
                    # A live (or killed) SWMR writer marks the file; plain readers are refused, SWMR
                    # readers are not. Read it as one: it sees exactly what the writer published.
                    if not read_only or multiprocessing or not status_flags(path) & _SWMR_WRITE_FLAG:
                        raise
                    multiprocessing = True
                    h5kw.update(swmr=True, locking=False)
                    f = h5py.File(path, mode, **h5kw)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        try:
            stored_space, stored_capacity = _read_header(f)
            if stored_space is None:
                length, inferred_capacity, inferred_space = cls.build_space_from_hdf5_file(f)
                stored_space = inferred_space
                stored_capacity = inferred_capacity
            space = stored_space
            if single_instance_space is not None:
                if single_instance_space != stored_space:
                    raise SpaceMismatchError(
                        f"{path!r} holds {stored_space!r}, not the requested {single_instance_space!r}"
                    )
                space = single_instance_space
            if capacity is not None and stored_capacity is not None and capacity != stored_capacity:
                raise ConfigError(f"{path!r} has capacity {stored_capacity}, not {capacity}")
            storage = cls(
                space, f, capacity=stored_capacity, reduce_io=reduce_io, check_file=True,
                is_mutable=not read_only, multiprocessing=multiprocessing, h5py_kwargs=h5kw,
            )
            if buffer_bytes is not None:
                storage.segment_buffer_bytes = int(buffer_bytes)
            storage._writer_lock = lock
            if multiprocessing and not read_only:
                with h5_errors("starting SWMR write mode"):
                    f.swmr_mode = True
        except BaseException:
            f.close()
            if lock is not None:
                lock.release()
            raise
        return storage

    @staticmethod
    def build_space_from_hdf5_file(root: h5py.Group | h5py.Dataset) -> tuple[int, int | None, Space]:
        """(length, capacity, space) of a file or group; exact when h5replay wrote it.

        For raw files (no h5replay attributes) the space is inferred from the datasets: text from
        string dtypes, bool as BinarySpace, numbers as unbounded BoxSpaces. A group whose only
        member is `data` is a bare leaf. Names starting with '_' or '.' are skipped. A dataset
        that can grow (maxshape[0] != shape[0]) makes the storage unbounded.
        """
        if isinstance(root, h5py.Group):
            space, capacity = _read_header(root)
            if space is not None:
                leaves = named_leaves(space)
                length = capacity if capacity is not None else min(root[p].shape[0] for p, _ in leaves)
                return int(length), capacity, space
        return _infer_space(root, "")

    @staticmethod
    def load_replay_buffer_from_raw_hdf5(path: str | os.PathLike[str]) -> ReplayBuffer:
        """A read-only ReplayBuffer over a file written by plain h5py (datasets sharing a first axis)."""
        from h5replay.storage.replay_buffer import ReplayBuffer

        return ReplayBuffer.from_raw_hdf5(path)

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
        return flatten_value(self.single_instance_space, value)

    def unflatten(self, leaves: Mapping[str, Any]) -> Any:
        """A nested dict (or the bare value for a leaf space) from {dataset path: value}."""
        return unflatten_value(self.single_instance_space, leaves)

    def encode_batch(self, batch: Any, num_rows: int | None = None) -> tuple[dict[str, np.ndarray], int]:
        """Validate a batch against the space; returns ({path: stored array}, rows). Writes nothing."""
        flat = self.flatten(batch)
        encoded: dict[str, np.ndarray] = {}
        for path, leaf in self._leaves:
            arr = leaf.encode_batch(flat[path], num_rows, key=path)
            num_rows = arr.shape[0] if num_rows is None else num_rows
            encoded[path] = arr
        return encoded, int(num_rows or 0)

    def encode_one(self, sample: Any) -> dict[str, np.ndarray]:
        """Validate one sample; returns {path: stored batch of one row}. Writes nothing."""
        flat = self.flatten(sample)
        return {path: leaf.encode_one(flat[path], key=path) for path, leaf in self._leaves}

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
                and not self._dirty and int(index.view(np.uint64).max()) < self._len):
            rows = self._mapped_rows(index)
            if rows is not None:
                return self.unflatten({path: leaf.decode_batch(rows[path]) for path, leaf in self._leaves})
        return self.read(*normalize_index(index, self._len))

    def _mapped_rows(self, flat: np.ndarray) -> dict[str, np.ndarray] | None:
        out = {}
        for path, _ in self._leaves:
            mapped = self._mapping(path)
            rows = None if mapped is None else mapped.take_checked(flat)
            if rows is None:
                return None
            out[path] = rows
        return out

    def read(self, kind: str, where: Any, decode: bool = True) -> Any:
        """Rows for an index already normalized by `normalize_index` (no range check here).

        With `decode=False` returns {dataset path: stored array} (text as UTF-8 bytes), which is
        what the server sends over the wire.
        """
        self._ensure_open()
        if kind == "int":
            one = np.array([where], dtype=np.int64)
            rows = {path: self._read_rows(path, "array", one)[0] for path, _ in self._leaves}
            if not decode:
                return rows
            return self.unflatten({path: leaf.decode_one(rows[path]) for path, leaf in self._leaves})
        rows = {path: self._read_rows(path, kind, where) for path, _ in self._leaves}
        if not decode:
            return rows
        return self.unflatten({path: leaf.decode_batch(rows[path]) for path, leaf in self._leaves})

    def _read_rows(self, path: str, kind: str, where: Any) -> np.ndarray:
        ds = self._datasets[path]
        with h5_errors(f"reading '{path}'"):
            if kind == "slice":
                start, stop = where
                return read_slice(ds, start, stop)
            idx: np.ndarray = where
            flat = idx.reshape(-1)
            rows = self._mapped_read(path, flat)
            if rows is None:
                if flat.size > 1 and np.all(flat[1:] > flat[:-1]):
                    rows = read_sorted_unique_rows(ds, flat)
                else:
                    unique, inverse = fancy_indexing_to_supported_indexing(flat)
                    rows = read_sorted_unique_rows(ds, unique)[inverse.reshape(-1)]
            return rows.reshape(idx.shape + rows.shape[1:])

    def _mapped_read(self, path: str, flat: np.ndarray) -> np.ndarray | None:
        # The map sees only what reached the file: skip it while this process has unflushed writes.
        if self._dirty or flat.size < 2:
            return None
        mapped = self._mapping(path)
        return None if mapped is None else mapped.take_checked(flat)

    def _mapping(self, path: str) -> MappedRows | None:
        """The leaf's memory map, opened on first use (None when its layout cannot be mapped)."""
        if path not in self._mapped:
            self._mapped[path] = MappedRows.open(self._datasets[path])
        return self._mapped[path]

    def get_column(self, nested_keys: str | Sequence[str]) -> HDF5Storage:
        """A storage over the sub-space at `nested_keys` ("obs/image" or ("obs", "image")), sharing
        this storage's file handle: writes through it are visible here; closing this one ends it."""
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
        with h5_errors("writing rows"):
            for path, _ in self._leaves:
                arr = encoded[path]  # (rows, *row_shape): _encode_for_index flattened an N-d index
                write_sorted_unique_rows(self._datasets[path], unique, np.ascontiguousarray(arr[positions]))
        self._dirty = True

    def _encode_for_index(self, value: Any, idx: np.ndarray) -> tuple[dict[str, np.ndarray], int]:
        if idx.ndim == 1:
            return self.encode_batch(value, idx.shape[0])
        # An N-d index takes a value of shape idx.shape + row: validate it flattened.
        flat_value = _reshape_batch(self.flatten(value), idx.shape)
        return self.encode_batch(self.unflatten(flat_value), idx.size)

    def _write_range(self, start: int, encoded: Mapping[str, np.ndarray]) -> None:
        """Write whole rows [start, start + n) of every leaf; rows must already exist."""
        with h5_errors("writing rows"):
            for path, _ in self._leaves:
                ds, arr = self._datasets[path], encoded[path]
                if arr.shape[0] and not write_rows(ds, start, arr):
                    ds[start : start + arr.shape[0]] = arr
        self._dirty = True

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
        """Drop the last `length` rows of an unbounded storage."""
        self._require_mutable("shrink the length")
        if self.capacity is not None:
            raise ConfigError(f"cannot shrink a storage of fixed capacity {self.capacity}")
        if isinstance(length, bool) or not 0 <= int(length) <= self._len:
            raise ConfigError(f"length to shrink by must be an int in [0, {self._len}], got {length!r}")
        self._resize_all(self._len - int(length))

    def _resize_all(self, new_len: int) -> None:
        old = self._len
        done: list[h5py.Dataset] = []
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
        self._dirty = True
        self._drop_maps()

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
        from h5replay.storage.segment import SegmentWriter, Staging

        if self._staging is None:
            self._staging = Staging(self)
        writer = SegmentWriter(self, self._staging)
        self._writers.add(writer)
        return writer

    @property
    def has_open_segment(self) -> bool:
        return self._cursor is not None

    @property
    def pending_segment_length(self) -> int:
        return 0

    def mark_segment_start(self, start_index: int) -> None:
        """Open the single append cursor at `start_index` (modulo a fixed capacity)."""
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
        """Write one sample at the cursor and advance it (rows are visible at once)."""
        if self._cursor is None:
            raise ConfigError("no open segment: call mark_segment_start(index) before append()")
        self._require_mutable("append")
        encoded = self.encode_one(value)
        self.write_ring(self._cursor, encoded)
        self._cursor = self._cursor + 1
        if self.capacity is not None:
            self._cursor %= self.capacity

    def mark_segment_end(self) -> None:
        self._cursor = None

    def abort_segment(self) -> None:
        """Close the cursor. Rows it already wrote stay written."""
        self._cursor = None

    def get_segments(self) -> None:
        """HDF5Storage keeps no segment index (the ReplayBuffer does)."""
        return None

    # ------------------------------------------------------------------ durability

    def flush(self, fsync: bool = False) -> None:
        """Push everything written so far to the OS (visible to SWMR readers, survives a crash of
        this process). `fsync=True` also forces it to the disk (survives power loss)."""
        self._ensure_open()
        if not self.is_mutable:
            return
        with h5_errors("flushing"):
            self.file.flush()
            if fsync:
                os.fsync(self.file.id.get_vfd_handle())
        self._dirty = False
        for mapped in self._mapped.values():
            if mapped is not None:
                mapped.refresh()

    def refresh(self) -> None:
        """Reader side: pick up rows and lengths another process flushed (SWMR readers)."""
        self._ensure_open()
        if self.multiprocessing and not self.is_mutable:
            with h5_errors("refreshing"):
                for ds in self._datasets.values():
                    ds.refresh()
            self._len = self._read_length()
        for mapped in self._mapped.values():
            if mapped is not None:
                mapped.refresh()

    def _drop_maps(self) -> None:
        for mapped in self._mapped.values():
            if mapped is not None:
                mapped.close()
        self._mapped = {}

    def dumps(self, path: str | os.PathLike[str]) -> None:
        """Flush (when `path` is this file) or write a complete copy of the storage to `path`,
        atomically (a temporary file renamed into place)."""
        self._ensure_open()
        target = os.path.abspath(os.fspath(path))
        if self.filename and os.path.abspath(self.filename) == target:
            if self._full_name is not None or isinstance(self._root, h5py.Dataset):
                raise ConfigError(f"cannot dump a column view onto the file {target!r} it is a view of")
            self.flush()
            return
        if self.is_mutable:
            self.flush()
        directory = os.path.dirname(target)
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".h5replay-", suffix=".tmp", dir=directory)
        os.close(fd)
        try:
            with h5_errors(f"writing a copy to {target}"), h5py.File(tmp, "w", libver=_libver()) as out:
                root = self.root
                if isinstance(root, h5py.Dataset):
                    root.file.copy(root, out, name=DEFAULT_KEY)
                else:
                    for name in root:
                        if name != INTERNAL_GROUP:
                            root.copy(root[name], out, name=name)
                    from h5replay.storage.segment import create_staging

                    create_staging(out.create_group(INTERNAL_GROUP), self._leaves)
                out.attrs[ATTR_FORMAT] = FORMAT_VERSION
                out.attrs[ATTR_SPACE] = json.dumps(self.single_instance_space.to_json())
                out.attrs[ATTR_CAPACITY] = -1 if self.capacity is None else self.capacity
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


# ---------------------------------------------------------------------- module helpers


def _join_path(prefix: str, key: str) -> str:
    return f"{prefix}/{key}" if prefix else key


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


def _read_header(group: h5py.Group) -> tuple[Space | None, int | None]:
    """(space, capacity) from h5replay's attributes, or (None, None) for a raw file."""
    attrs = group.attrs
    if ATTR_SPACE not in attrs:
        return None, None
    version = int(attrs.get(ATTR_FORMAT, 0))
    if version != FORMAT_VERSION:
        raise FormatVersionError(
            f"{group.file.filename!r} has h5replay format version {version}; this h5replay reads version "
            f"{FORMAT_VERSION}. Upgrade h5replay, or export the file with the version that wrote it."
        )
    raw = attrs[ATTR_SPACE]
    text = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
    try:
        space = space_from_json(json.loads(text))
    except (ValueError, TypeError) as exc:
        raise StorageError(f"{group.file.filename!r} has an unreadable space description: {exc}") from exc
    capacity = int(attrs.get(ATTR_CAPACITY, -1))
    return space, (None if capacity < 0 else capacity)


def _infer_space(node: h5py.Group | h5py.Dataset, path: str) -> tuple[int, int | None, Space]:
    if isinstance(node, h5py.Dataset):
        if node.ndim == 0:
            raise SpaceMismatchError(f"dataset '{path or node.name}' is a scalar; rows need a first axis")
        length = int(node.shape[0])
        capacity = length if node.maxshape[0] == node.shape[0] else None
        dt = node.dtype
        string_info = h5py.check_string_dtype(dt)
        leaf: LeafSpace
        if string_info is not None:
            # Variable-length strings have no stored limit: allow long texts (4096 characters).
            leaf = TextSpace(dt.itemsize if string_info.length else 4096)
        elif dt.kind == "b":
            leaf = BinarySpace(node.shape[1:])
        elif dt.kind in "fiu":
            leaf = BoxSpace(-np.inf, np.inf, node.shape[1:], dt)
        else:
            raise SpaceMismatchError(f"dataset '{path or node.name}' has unsupported dtype {dt}")
        return length, capacity, leaf
    members = [n for n in node if not n.startswith(("_", "."))]
    if DEFAULT_KEY in members and len(members) == 1:
        return _infer_space(node[DEFAULT_KEY], _join_path(path, DEFAULT_KEY))
    if not members:
        raise SpaceMismatchError(f"group '{path or '/'}' holds no datasets")
    parts: dict[str, Space] = {}
    lengths: dict[str, tuple[int, int | None]] = {}
    for name in members:
        length, capacity, sub = _infer_space(node[name], _join_path(path, name))
        parts[name] = sub
        lengths[name] = (length, capacity)
    first_name, first = next(iter(lengths.items()))
    for name, lc in lengths.items():
        if lc[0] != first[0]:
            raise SpaceMismatchError(
                f"'{_join_path(path, name)}' has {lc[0]} rows but '{_join_path(path, first_name)}' has {first[0]}; "
                "all datasets must share their first axis"
            )
    capacity = first[1] if all(lc[1] == first[1] for lc in lengths.values()) else None
    return first[0], capacity, DictSpace(parts)
