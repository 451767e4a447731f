"""HDF5Storage's file: opened, created or loaded, checked against the space, flushed, closed.

`_StorageFile` is the part of HDF5Storage (hdf5.py, which adds rows, length and segments) that
holds one open h5py root and its datasets: `create` and `load_from` (the file's own steps are
`_h5file.py`'s), the checks of each dataset against its leaf, reopening lazily after unpickling,
the memory maps the datasets share with column views, and durability (flush, refresh, copies,
close). It never reads or writes rows itself.

Not thread-safe: one thread at a time per storage (h5py serialises HDF5 calls anyway).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import typing
import weakref
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import h5py
import numpy as np

from h5replay.errors import ClosedError, ConfigError, ReadOnlyError, SpaceMismatchError, StorageError
from h5replay.spaces import DEFAULT_KEY, LeafSpace, Schema, Space, TextSpace, space_from_json
from h5replay.storage import _h5file, _layout, packed
from h5replay.storage._h5file import DEFAULT_OPEN_TIMEOUT, INTERNAL_GROUP, Prepare, Verify, h5_errors
from h5replay.storage._rawfile import infer_space
from h5replay.storage.fastread import MappedRows
from h5replay.storage.packed import PackedColumn
from h5replay.storage.recovery import WriterLock
from h5replay.storage.segment import SegmentWriter, Staging

__all__: list[str] = []

log = logging.getLogger("h5replay.storage")

_S = TypeVar("_S", bound="_StorageFile")


class _SharedIO:
    """What a storage and its column views must agree on: which datasets have writes HDF5 still
    holds in its caches (the memory map would read stale bytes of them), and the maps themselves,
    keyed by dataset name so a flush seen by one is seen by all."""

    def __init__(self) -> None:
        self.dirty = False
        self.written: dict[str, h5py.Dataset] = {}  # by name, since the last flush
        self.maps: dict[str, MappedRows | None] = {}

    def wrote(self, datasets: Iterable[h5py.Dataset]) -> None:
        """Note writes to `datasets` (before they are made: a failed write may still have reached
        HDF5's caches)."""
        self.dirty = True
        for ds in datasets:
            self.written[ds.name] = ds

    def flush_written(self) -> None:
        """Write the cached chunks of the datasets written since the last flush to the file
        (H5Dflush), so the memory map reads what was written. Data only: the file's metadata,
        and with it what SWMR readers and a crash see, stays as the last full flush left it.
        Costs a small part of the HDF5 read that the map then avoids."""
        for ds in self.written.values():
            ds.flush()
        self.written.clear()
        self.dirty = False
        self.refresh_maps()

    def flushed(self) -> None:
        """The whole file was flushed: nothing is held in HDF5's caches any more."""
        self.written.clear()
        self.dirty = False
        self.refresh_maps()

    def refresh_maps(self) -> None:
        for mapped in self.maps.values():
            if mapped is not None:
                mapped.refresh()

    def drop_maps(self) -> None:
        for mapped in self.maps.values():
            if mapped is not None:
                mapped.close()
        self.maps = {}


class _StorageFile:
    """One open h5py root holding rows of `single_instance_space`, one dataset per leaf: the file
    half of HDF5Storage (see hdf5.py; the constructor's arguments are documented there)."""

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
        self.reduce_io = bool(reduce_io)
        self.multiprocessing = multiprocessing
        self._owns_root = owns_root
        self._h5py_kwargs = dict(h5py_kwargs or {})
        self._full_name = full_name
        self._closed = False
        self._root: h5py.Group | h5py.Dataset | None = None
        self._file: h5py.File | None = None
        self._datasets: dict[str, h5py.Dataset] = {}  # by leaf path; a compressed leaf's by "<path>/<part>"
        self._packed: dict[str, PackedColumn] = {}  # compressed leaves, by path
        self._map_keys: dict[str, str] = {}  # leaf path -> its dataset's name in the file (the maps' key)
        self._io = _SharedIO()
        self._stale = False  # an SWMR reader's view of HDF5's metadata may be behind the writer
        self._cursor: int | None = None
        self._writers: weakref.WeakSet[SegmentWriter] = weakref.WeakSet()
        self._staging: Staging | None = None
        self._writer_lock: WriterLock | None = None
        self.segment_buffer_bytes = self.DEFAULT_SEGMENT_BUFFER_BYTES
        #: Memory all segment writers of this storage together may buffer (None: no limit); set
        #: it before the first writer opens.
        self.segment_memory_bytes: int | None = None
        #: Flatten / validate / encode / decode of this storage's rows (the one implementation);
        #: it refuses Box values outside their bounds, and NaN, unless `check_bounds` is set False.
        self.schema = Schema(single_instance_space, check_bounds=True)
        self._leaves = list(self.schema.leaves)
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
        self._packed = {}
        for path, leaf in self._leaves:
            if isinstance(root, h5py.Dataset) or (packed.is_packed(root) and path == DEFAULT_KEY):
                ds = root  # a column view of one leaf
            else:
                try:
                    ds = root[path]
                except KeyError as exc:
                    if "checksum" in str(exc):  # the object is there, but its header is damaged
                        raise StorageError(f"{root.file.filename!r} is damaged: the dataset of field '{path}' cannot "
                                           f"be read ({exc.args[0] if exc.args else exc})") from exc
                    raise SpaceMismatchError(f"the file has no dataset for field '{path}'") from exc
            if packed.is_packed(ds):
                self._attach_packed(path, leaf, ds, check_file)
                continue
            if not isinstance(ds, h5py.Dataset):
                raise SpaceMismatchError(f"'{path}' in the file is a group, but the space has a leaf there")
            if check_file:
                self._check_dataset(path, leaf, ds)
            dcpl = ds.id.get_create_plist()  # a filter HDF5 lacks: hdf5plugin's (an `export --plain` copy's)?
            if any(not h5py.h5z.filter_avail(dcpl.get_filter(i)[0]) for i in range(dcpl.get_nfilters())):
                _layout.register_filters(f"{self.filename!r}: reading dataset '{path}' (an HDF5 filter)")
            if self._uncached_writes and ds is not root:  # a dataset given as the root stays the caller's
                ds = _h5file.for_writing(ds)
            self._datasets[path] = ds
        # Asked once: Dataset.name is an HDF5 call, too dear for every read.
        self._map_keys = {path: ds.name for path, ds in self._datasets.items()}
        self._io.drop_maps()

    def _attach_packed(self, path: str, leaf: LeafSpace, group: h5py.Group, check_file: bool) -> None:
        """Hold a compressed leaf: its datasets under "<path>/<part>" keys, read like any other."""
        where = f"{self.filename!r}: compressed leaf '{path}'"
        if isinstance(leaf, TextSpace) or leaf.storage_dtype.kind == "O":
            raise SpaceMismatchError(f"{where}: text leaves cannot be compressed")
        for part in packed.PARTS:
            ds = group.get(part)
            if not isinstance(ds, h5py.Dataset):
                raise StorageError(f"{where} is damaged: it has no '{part}' dataset")
            self._datasets[f"{path}/{part}"] = _h5file.for_writing(ds) if self._uncached_writes else ds
        if check_file:
            cap = self._datasets[f"{path}/slots"].shape[0]
            if self.capacity is None or cap != self.capacity or self._datasets[f"{path}/meta"].shape[0] != cap:
                raise SpaceMismatchError(f"{where} holds {cap} rows but the capacity is {self.capacity}")
            if self._datasets[f"{path}/spill"].shape[1] != max(1, leaf.row_bytes):
                raise SpaceMismatchError(f"{where} has spill rows of {self._datasets[f'{path}/spill'].shape[1]} bytes, "
                                         f"but a row of the space has {leaf.row_bytes}")
        self._packed[path] = PackedColumn(path, group, self._datasets, leaf.storage_dtype, leaf.shape, self._gather)

    def _gather(self, key: str, flat: np.ndarray) -> np.ndarray:
        raise NotImplementedError  # HDF5Storage reads rows

    @property
    def _uncached_writes(self) -> bool:
        """Whether this storage's unfiltered chunked datasets are held without HDF5's chunk cache
        (see _h5file.for_writing): when it writes, unless h5py options chose a cache."""
        return self.is_mutable and "rdcc_nbytes" not in self._h5py_kwargs

    def _check_dataset(self, path: str, leaf: LeafSpace, ds: h5py.Dataset) -> None:
        where = f"{self.filename!r}: dataset '{path}'"
        if ds.shape[1:] != leaf.shape:
            raise SpaceMismatchError(f"{where} has rows of shape {ds.shape[1:]} but the space expects {leaf.shape}")
        if isinstance(leaf, TextSpace):
            if ds.dtype.kind not in "SO":
                raise SpaceMismatchError(f"{where} has dtype {ds.dtype} but text needs strings")
            if ds.dtype.kind == "S" and ds.dtype.itemsize < leaf.max_length:
                raise SpaceMismatchError(f"{where} holds {ds.dtype.itemsize} bytes, less than max_length {leaf.max_length}")
        elif ds.dtype != leaf.storage_dtype:
            raise SpaceMismatchError(f"{where} has dtype {ds.dtype} but the space expects {leaf.storage_dtype}")
        if self.capacity is not None and ds.maxshape[0] != self.capacity and ds.shape[0] != self.capacity:
            raise SpaceMismatchError(f"{where} holds {ds.shape[0]} rows but the capacity is {self.capacity}")

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
        f, swmr, kwargs = _h5file.open_file(
            self.filename, writable=False, multiprocessing=self.multiprocessing, h5kw=self._h5py_kwargs
        )
        self.multiprocessing, self._h5py_kwargs = swmr or self.multiprocessing, kwargs
        root = f if self._full_name is None else f[self._full_name]
        self._owns_root = True
        self._attach(root, check_file=False)
        self._len = self._read_length()

    @property
    def root(self) -> h5py.Group | h5py.Dataset:
        """The h5py root (opened lazily after unpickling)."""
        self._ensure_open()
        return typing.cast("h5py.Group | h5py.Dataset", self._root)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Flush (when writable) and close the file, when this storage owns it. Safe to call twice;
        open segment writers die.

        Raises:
            StorageError: the final flush failed. The file is closed anyway; what was not flushed
                may be lost (a ReplayBuffer reopens at its last published state).
        """
        if self._closed:
            return
        for writer in list(self._writers):
            writer._invalidate("its storage was closed")
        self._cursor = None
        root, self._root = self._root, None
        self._file = None
        self._datasets = {}
        self._closed = True
        failure: BaseException | None = None
        try:
            if root is not None and self._owns_root:
                self._io.drop_maps()
                try:
                    with h5_errors(f"flushing {self.filename} before closing it"):
                        if self.is_mutable:
                            root.file.flush()
                except StorageError as exc:
                    failure = exc
                with contextlib.suppress(Exception):
                    root.file.close()
        finally:
            if self._writer_lock is not None:
                self._writer_lock.release()
        if failure is not None:
            raise failure

    def __enter__(self: _S) -> _S:
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
    def file(self) -> h5py.File:
        """The h5py File (kept: h5py builds a new File object on every `.file` access)."""
        if self._file is None:
            self._file = self.root.file
        return self._file

    def file_identity(self) -> tuple[int, int]:
        """(st_dev, st_ino) of the file this storage holds open, through HDF5's own descriptor:
        which file it is, whatever name leads to it now (a file moved over its path is another).

        Raises:
            StorageError: HDF5 does not say its descriptor, or it cannot be looked at.
        """
        with h5_errors(f"looking at the file descriptor of {self.filename}"):
            handle = self.file.id.get_vfd_handle()
        try:
            st = os.fstat(int(handle))
        except (OSError, TypeError, ValueError) as exc:
            raise StorageError(f"cannot look at the open file {self.filename!r}: {exc}") from exc
        return st.st_dev, st.st_ino

    @property
    def leaves(self) -> list[tuple[str, LeafSpace]]:
        """(dataset path, leaf space) for every leaf, in storage order."""
        return list(self._leaves)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row, every leaf included."""
        return self.schema.row_bytes

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
        cls: type[_S],
        single_instance_space: Space,
        capacity: int | None,
        cache_path: str | os.PathLike[str] | None = None,
        multiprocessing: bool = False,
        initial_capacity: int | None = None,
        compression: Mapping[str, Any] | str | None = None,
        compression_level: Mapping[str, Any] | int | None = None,
        chunks: Mapping[str, Any] | bool | tuple[int, ...] | None = None,
        reduce_io: bool = True,
        *,
        compression_slot: Mapping[str, Any] | float | int | None = None,
        overwrite: bool = False,
        segment_buffer_bytes: int | None = None,
        prepare: Prepare | None = None,
        open_timeout: float | None = DEFAULT_OPEN_TIMEOUT,
        **kwargs: Any,
    ) -> _S:
        """Create a new file at `cache_path` and return a writable storage over it.

        The file is built under a temporary name in the same directory, renamed into place and
        reopened by its final name, so a crash never leaves a half-made file at `cache_path`. With
        `multiprocessing=True` the file is then held in SWMR write mode: other processes may open it
        with `load_from(path, space, read_only=True, multiprocessing=True)` while this one writes.

        Args:
            compression: per leaf (a mapping by path, "*" for the rest) or for all: "zstd" or "lz4"
                (a fixed capacity only: rows stored as h5replay's records, bounded under SWMR, see
                storage/packed.py), or an HDF5 filter "gzip", "lzf" (not for an SWMR ring).
            compression_level: the codec's level, per leaf as `compression`.
            compression_slot: the slot of a zstd/lz4 row, as a fraction of a raw row (default
                1/8) or in bytes; a record that does not fit goes to the leaf's spill area.
            overwrite: replace an existing file.
            segment_buffer_bytes: memory a segment writer buffers before spilling to the file.
            prepare: given the new file before SWMR starts, to add datasets of its own (the
                replay buffer's journal): SWMR forbids creating objects later.
            kwargs: anything else goes to `h5py.File`.

        Raises:
            ConfigError: a missing path, an existing file without overwrite, or invalid options.
        """
        if cache_path is None:
            raise ConfigError("HDF5Storage.create needs cache_path: the file to create")
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
        leaves = list(Schema(single_instance_space).leaves)
        if not leaves:
            raise ConfigError("the space has no leaves; an empty DictSpace cannot be stored")
        layouts = {
            p: _layout.dataset_kwargs(
                p, leaf.shape, leaf.row_bytes, capacity, initial_rows,
                compression=compression, compression_level=compression_level,
                chunks=chunks, multiprocessing=multiprocessing, compression_slot=compression_slot,
            )
            for p, leaf in leaves
        }
        for p, leaf in leaves:
            if "packed" in layouts[p] and isinstance(leaf, TextSpace):
                raise ConfigError(f"compression {layouts[p]['packed'].codec.name!r} for '{p}': text leaves are stored "
                                  "as fixed bytes and cannot be compressed as records; leave them uncompressed")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        # Replacing a file: no writer may have it open (whatever name it opened it by).
        old = WriterLock(path).acquire() if overwrite and os.path.exists(path) else None
        try:
            lock = _h5file.create_file(path, single_instance_space, capacity, layouts, leaves, prepare, kwargs,
                                       overwrite=overwrite)
        finally:
            if old is not None:
                old.release()
        try:
            return cls._open_locked(
                path, single_instance_space, capacity, lock, multiprocessing=multiprocessing,
                reduce_io=reduce_io, segment_buffer_bytes=segment_buffer_bytes, prepare=None, h5kw=kwargs,
                known_space=True,
            )
        except BaseException:
            if lock.same_file(path):
                with contextlib.suppress(OSError):
                    os.unlink(path)  # ours, just made, never used: leave nothing behind
            lock.release()
            raise

    @classmethod
    def load_from(
        cls: type[_S],
        path: str | os.PathLike[str],
        single_instance_space: Space | None,
        *,
        capacity: int | None = None,
        read_only: bool = True,
        multiprocessing: bool = False,
        reduce_io: bool = True,
        segment_buffer_bytes: int | None = None,
        prepare: Prepare | None = None,
        verify: Verify | None = None,
        open_timeout: float | None = DEFAULT_OPEN_TIMEOUT,
        **kwargs: Any,
    ) -> _S:
        """Open an existing file. The space and capacity are read from the file when it has them.

        `read_only=False, multiprocessing=True` reopens the file as the SWMR writer;
        `read_only=True, multiprocessing=True` opens it as an SWMR reader that sees rows the
        writer flushed (call `refresh()` to pick up new ones). A writer takes the file's writer
        lock and recovers a file whose writer was killed. `prepare` is given the file before SWMR
        starts when it is opened for writing (to upgrade what the caller keeps in it); `verify`,
        before that, when the file was found shorter than its superblock says (default: every
        leaf row must lie within what is on disk).

        Blocks until the file is open, at most `open_timeout` seconds (None: no limit); SIGTERM
        and SIGINT stop the wait (in the main thread).

        Raises:
            FileNotFoundError: no file at `path`.
            FormatVersionError: the file was written by an unknown h5replay format.
            SpaceMismatchError: the file does not hold `single_instance_space`.
            ConfigError: `capacity` differs from the file's, or a layout SWMR cannot write.
            StorageError: HDF5 cannot open the file (damaged, or it did not open within the timeout),
                another process writes it, or it lost published rows (cut short).
        """
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no HDF5 file at {path!r}")
        with _h5file.opening(path, open_timeout):
            if read_only:
                return cls._open_locked(
                    path, single_instance_space, capacity, None, multiprocessing=multiprocessing,
                    reduce_io=reduce_io, segment_buffer_bytes=segment_buffer_bytes, prepare=None, h5kw=kwargs,
                )
            lock = WriterLock(path).acquire()
            cleared, short = 0, None
            try:
                cleared, short = _h5file.recover(path, lock)
                if cleared:
                    log.warning("%s was not closed cleanly (its writer died); cleared its status flags and reopening "
                                "it at its last published state", path)
                return cls._open_locked(
                    path, single_instance_space, capacity, lock, multiprocessing=multiprocessing,
                    reduce_io=reduce_io, segment_buffer_bytes=segment_buffer_bytes, prepare=prepare, h5kw=kwargs,
                    verify=(verify or _h5file.verify_all_within) if short is not None else None, short=short,
                )
            except BaseException:
                # Refused: the file stays as it was found (zeros never stand in for published rows).
                _h5file.unrecover(path, cleared, short)
                lock.release()
                raise

    @classmethod
    def _open_locked(
        cls: type[_S], path: str, expected_space: Space | None, expected_capacity: int | None, lock: WriterLock | None, *,
        multiprocessing: bool, reduce_io: bool, segment_buffer_bytes: int | None, prepare: Prepare | None,
        h5kw: dict[str, Any], known_space: bool = False, verify: Verify | None = None, short: int | None = None,
    ) -> _S:
        """Open `path` (writable when `lock` is held), check it, start SWMR writing if asked.
        `known_space`: the file was just made from `expected_space` (use it as it is). `verify` is
        called with the length `short` the file had before recovery lengthened it."""
        writable = lock is not None
        try:
            f, swmr_reader, h5kw = _h5file.open_file(path, writable=writable, multiprocessing=multiprocessing, h5kw=h5kw)
        except StorageError as exc:
            if short is not None:  # its metadata was in the part that is missing
                raise _h5file.published_beyond(path, short, short + _h5file.missing_bytes(path, short)) from exc
            raise
        try:
            if verify is not None and short is not None:
                try:
                    verify(f, short)
                except StorageError as exc:
                    if getattr(exc, "cut_short", False):
                        raise
                    raise _h5file.published_beyond(path, short, short + _h5file.missing_bytes(path, short)) from exc
                log.warning("%s was %d bytes shorter than its superblock records (a write that failed, on a full "
                            "disk perhaps): only rows never published were missing; reopening it at its last "
                            "published state", path, _h5file.missing_bytes(path, short))
            space, capacity = _h5file.read_header(f)
            if space is None:
                _, capacity, space = infer_space(f)
            if known_space and expected_space is not None:
                space = expected_space
            elif expected_space is not None and expected_space != space:
                raise SpaceMismatchError(f"{path!r} holds {space!r}, not the requested {expected_space!r}")
            if expected_capacity is not None and capacity is not None and expected_capacity != capacity:
                raise ConfigError(f"{path!r} has capacity {capacity}, not {expected_capacity}")
            storage = cls(
                space, f, capacity=capacity, reduce_io=reduce_io, check_file=True, is_mutable=writable,
                multiprocessing=multiprocessing or swmr_reader, h5py_kwargs=h5kw,
            )
            if segment_buffer_bytes is not None:
                storage.segment_buffer_bytes = int(segment_buffer_bytes)
            if writable:
                if multiprocessing:
                    storage._check_swmr_writable()
                if prepare is not None:
                    with h5_errors(f"preparing {path}"):
                        prepare(f)
                if multiprocessing:
                    _h5file.start_swmr(f)
        except BaseException:
            f.close()
            raise
        storage._writer_lock = lock
        return storage

    def _check_swmr_writable(self) -> None:
        """Refuse a layout that SWMR writing would damage: a compressed fixed-capacity ring."""
        if self.capacity is None:
            return
        for path, ds in self._datasets.items():
            if ds.compression is not None:
                raise ConfigError(f"{self.filename!r}: " + _layout.swmr_compressed_ring(path, ds.compression))

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
        self._io.flushed()

    def refresh(self) -> None:
        """Reader side: pick up rows and lengths another process flushed (SWMR readers)."""
        self._ensure_open()
        if self.multiprocessing and not self.is_mutable:
            with h5_errors("refreshing"):
                for ds in self._datasets.values():
                    ds.refresh()
            self._len = self._read_length()
        self._stale = False
        self._io.refresh_maps()

    def mark_stale(self) -> None:
        """Reader side: the writer published; refresh HDF5's view of the datasets before the next
        read that needs it (cheap now, paid only by reads that go through HDF5 or meet new chunks)."""
        self._stale = True

    def _refresh_if_stale(self) -> None:
        if self._stale:
            self.refresh()

    def invalidate_maps(self) -> None:
        """Forget every memory map and chunk address: the file's space was freed and reallocated
        (a shrink or clear by the writer); the next read maps afresh."""
        self._io.drop_maps()

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
            with h5_errors(f"writing a copy to {target}"), h5py.File(tmp, "w", libver=_h5file.libver()) as out:
                root = self.root
                if isinstance(root, h5py.Dataset):
                    root.file.copy(root, out, name=DEFAULT_KEY)
                else:
                    for name in root:
                        if name != INTERNAL_GROUP:
                            root.copy(root[name], out, name=name)
                    _h5file.create_staging(out, self._leaves)
                _h5file.write_header(out, self.single_instance_space, self.capacity)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
