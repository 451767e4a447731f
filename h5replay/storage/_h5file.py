"""The HDF5 file itself: creating it atomically, opening it (plain, SWMR writer, SWMR reader),
recovering it after a killed writer, its attributes, and the one place h5py errors are translated.

Every HDF5 object a file will ever hold is created here, before SWMR starts (SWMR forbids creating
objects later): the leaves' datasets, the hidden staging datasets of segment writers, and whatever
the caller's `prepare` adds (the replay journal). A new file is built under a temporary name,
renamed into place, then reopened by its final name: a crash never leaves a half-made file at the
path, and everything downstream (the memory-mapped read path included) sees the real name.

Opening is bounded: an SWMR reader retries a metadata block whose checksum fails (it may be
half-written by the writer), and HDF5's default of 100 attempts with a doubling back-off never
ends on a damaged file. Readers here make at most `METADATA_READ_ATTEMPTS` (under a second per
block), and `opening()` gives up after a deadline, or at SIGTERM / SIGINT, with a clear error.

This module owns no rows and no bookkeeping; it hands open `h5py.File`s to `_storage_file.py`
(HDF5Storage's file half).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import tempfile
import threading
import traceback
import typing
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import h5py
import numpy as np

from h5replay.errors import ConfigError, FormatVersionError, StorageError
from h5replay.spaces import LeafSpace, Space, TextSpace, space_from_json
from h5replay.storage import _layout, _readers, packed
from h5replay.storage.recovery import (
    WriterLock,
    clear_status_flags,
    restore_status_flags,
    status_flags,
    superblock_end,
)

__all__ = [
    "FORMAT_VERSION", "ATTR_FORMAT", "ATTR_SPACE", "ATTR_CAPACITY", "ATTR_REPLAY_ID", "INTERNAL_GROUP",
    "STAGING_GROUP", "h5_errors", "h5_dtype", "libver", "read_header", "create_file", "open_file", "Prepare",
    "for_writing",
    "Verify", "opening", "recover", "DEFAULT_OPEN_TIMEOUT", "METADATA_READ_ATTEMPTS", "MAX_ID", "check_dataset", "shown",
]

log = logging.getLogger("h5replay.storage")

#: Version 2 added the replay id and the journal's fixed state row (version 1 files are upgraded
#: in place the first time they are opened for writing, and read as they are otherwise).
FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)
ATTR_FORMAT = "h5replay_format_version"
ATTR_SPACE = "h5replay_space"
ATTR_CAPACITY = "h5replay_capacity"
ATTR_REPLAY_ID = "h5replay_replay_id"
INTERNAL_GROUP = "_h5replay"
#: Every id, count and capacity a file records stays below this (2**62): an id plus a capacity,
#: or plus the rows of any commit, then never overflows int64. A file that records more is
#: refused when opened; a commit that would pass it is refused before anything is written.
MAX_ID = 1 << 62
STAGING_GROUP = f"{INTERNAL_GROUP}/staging"
_SWMR_WRITE_FLAG = 0x04  # superblock status flag: open for SWMR writing
# HDF5 format bounds: v110 structures are what SWMR needs; capping at v114 keeps files readable by
# HDF5 1.14 tools even when h5py is built on HDF5 2.x.
_LIBVER = ("v110", "v114")

#: Adds objects to a file before SWMR starts (a new file, or an old one being upgraded).
Prepare = Callable[[h5py.File], None]
#: Checks, before anything is written, that whatever the file published lies below the given
#: byte length (a file found shorter than its superblock says); raises StorageError otherwise.
Verify = Callable[[h5py.File, int], None]

#: Seconds an open may take before it gives up (a damaged file can keep HDF5 retrying for hours).
DEFAULT_OPEN_TIMEOUT = 30.0
#: Metadata read attempts of an SWMR reader (HDF5's default is 100, with a back-off that doubles
#: from 1 ns: 100 attempts never end, 28 take about 0.27 s). A block the writer is rewriting is
#: whole again within microseconds; one still failing after this is damaged.
METADATA_READ_ATTEMPTS = 28


def _raised_by_h5py(exc: BaseException) -> bool:
    """True when the innermost frame of `exc`'s traceback is h5py's own code (an HDF5 failure),
    not ours: a KeyError or RuntimeError of our own making is a bug, not a storage problem."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return False
    where = frames[-1].filename  # h5py's Python files sit in .../h5py/; its Cython ones say "h5py/x.pyx"
    return f"{os.sep}h5py{os.sep}" in where or where.startswith("h5py/")


@contextlib.contextmanager
def h5_errors(what: str) -> Iterator[None]:
    """Turn HDF5 failures into StorageError naming what was being done (the one place).

    OSError is HDF5's I/O and file family; RuntimeError and KeyError count only when h5py raised
    them. Programming errors pass through unchanged, so they are never mistaken for a broken file.
    """
    try:
        yield
    except (FileNotFoundError, IndexError):
        raise
    except OSError as exc:
        raise StorageError(f"HDF5 failed while {what}: {exc}") from exc
    except (RuntimeError, KeyError) as exc:
        if not _raised_by_h5py(exc):
            raise
        raise StorageError(f"HDF5 failed while {what}: {exc}") from exc


def libver() -> tuple[str, str]:
    # h5py learnt the 'v114' bound in 3.6; older ones only know 'latest' as the upper bound.
    from h5py._hl import files as _files

    return _LIBVER if "v114" in getattr(_files, "libver_dict", {}) else ("v110", "latest")


def for_writing(ds: h5py.Dataset) -> h5py.Dataset:
    """`ds` as a writer should hold it: an unfiltered chunked dataset reopened without HDF5's
    chunk cache (anything else unchanged).

    Through the cache (8 MiB a dataset by default with HDF5 2.0) every written byte is copied
    into a cached chunk first, and each flush writes the dirty chunks out: writing 100-row image
    episodes in 64 KiB chunks spent as long in File.flush as in the write. Without it HDF5 writes the
    selection of an unfiltered chunk straight to the chunk's place in the file, whole or part;
    reads likewise (the SWMR readers already open files without it). Filtered chunks keep the
    cache: a partial write would otherwise decompress and recompress its chunk each time."""
    plist = ds.id.get_create_plist()
    if plist.get_layout() != h5py.h5d.CHUNKED or plist.get_nfilters():
        return ds
    access = ds.id.get_access_plist()
    slots, _, w0 = access.get_chunk_cache()
    access.set_chunk_cache(slots, 0, w0)
    file_id, name = ds.file.id, ds.name.encode()
    # Handles of one open dataset share its state, chunk cache included: close this one first
    # so the reopen builds it anew with the access list above.
    ds.id.close()
    return h5py.Dataset(h5py.h5d.open(file_id, name, access))


def h5_dtype(leaf: LeafSpace) -> Any:
    """The HDF5 type of a leaf's dataset: fixed-length UTF-8 for text (SWMR cannot write vlen)."""
    if isinstance(leaf, TextSpace):
        return h5py.string_dtype("utf-8", length=leaf.storage_dtype.itemsize)
    return leaf.storage_dtype


# ---------------------------------------------------------------------------------- attributes


def read_header(group: h5py.Group) -> tuple[Space | None, int | None]:
    """(space, capacity) from h5replay's attributes, or (None, None) for a raw file.

    Raises:
        FormatVersionError: a format version this code does not read (or not a number).
        StorageError: the space or capacity attribute is not one h5replay writes (a damaged or
            crafted file); nothing is allocated for it first.
    """
    attrs = group.attrs
    if ATTR_SPACE not in attrs:
        return None, None
    where = repr(group.file.filename)
    raw_version = attrs.get(ATTR_FORMAT, 0)
    version = _integer(raw_version)
    if version not in _READABLE_VERSIONS:
        raise FormatVersionError(
            f"{where} has h5replay format version {shown(raw_version)}; this h5replay reads versions "
            f"{_READABLE_VERSIONS}. Upgrade h5replay, or export the file with the version that wrote it."
        )
    raw = attrs[ATTR_SPACE]
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
        space = space_from_json(json.loads(text))
    except (ValueError, TypeError, RecursionError) as exc:  # RecursionError: JSON nested too deep to parse
        problem = "JSON nested too deep to read" if isinstance(exc, RecursionError) else str(exc)
        raise StorageError(f"{where} has an unreadable space description (attribute {ATTR_SPACE!r}): {problem}") from exc
    raw_capacity = attrs.get(ATTR_CAPACITY, -1)
    capacity = _integer(raw_capacity)
    if capacity is None or not (capacity == -1 or 1 <= capacity <= MAX_ID):
        raise StorageError(f"{where} has attribute {ATTR_CAPACITY!r} = {shown(raw_capacity)}: a capacity is an integer "
                           f"from 1 to 2**62, or -1 for an unbounded buffer")
    return space, (None if capacity < 0 else capacity)


def shown(value: Any) -> str:
    """An attribute's value for a message: numpy scalars as plain numbers, at most 80 characters."""
    return f"{value.item() if isinstance(value, np.generic) else value!r:.80}"


def _integer(value: Any) -> int | None:
    """`value` (an attribute) as an int, or None when it is not an integer scalar (a string,
    a float, NaN, an array, a bool)."""
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value[()]
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        return None
    return int(value)


def check_dataset(ds: Any, where: str, dtype: Any, shape: tuple[int | None, ...],
                  maxshape: tuple[int | None, ...] | None = None) -> h5py.Dataset:
    """`ds`, one of h5replay's own datasets, when it has the dtype and shape h5replay gives it
    (`shape`: None for an axis of any length; `maxshape`: exact, None to leave it unchecked).
    Checked before anything is read from it, so a damaged or crafted file cannot make a reader
    allocate for a table of 2**40 rows or read floats as ids.

    Raises:
        StorageError: `ds` is not a dataset, or of another dtype or shape (names what it is and
            what was expected).
    """
    expected = f"{np.dtype(dtype)} of shape {tuple('n' if n is None else n for n in shape)}"
    if maxshape is not None:
        expected += f" (at most {tuple('unlimited' if n is None else n for n in maxshape)})"
    if not isinstance(ds, h5py.Dataset):
        raise StorageError(f"{where} holds {type(ds).__name__} where h5replay keeps a dataset of {expected}: the file "
                           "is damaged or was not written by h5replay")
    if (ds.dtype != np.dtype(dtype) or len(ds.shape) != len(shape)
            or any(want is not None and have != want for have, want in zip(ds.shape, shape))
            or (maxshape is not None and tuple(ds.maxshape) != tuple(maxshape))):
        raise StorageError(f"{where}: dataset {ds.name!r} is {ds.dtype} of shape {ds.shape} (at most {ds.maxshape}), "
                           f"not {expected}: the file is damaged or was not written by h5replay")
    return ds


def write_header(f: h5py.File, space: Space, capacity: int | None) -> None:
    """Format version, space, capacity and a new replay id (a UUID that names this file for good)."""
    f.attrs[ATTR_FORMAT] = FORMAT_VERSION
    f.attrs[ATTR_SPACE] = json.dumps(space.to_json())
    f.attrs[ATTR_CAPACITY] = -1 if capacity is None else int(capacity)
    f.attrs[ATTR_REPLAY_ID] = uuid.uuid4().hex


def replay_id(f: h5py.File) -> str:
    """The file's replay id ('' for a file made before ids existed and never opened for writing)."""
    raw = f.attrs.get(ATTR_REPLAY_ID, "")
    return raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)


def upgrade_header(f: h5py.File) -> None:
    """Bring a version 1 file's attributes to this version (before SWMR starts)."""
    if ATTR_REPLAY_ID not in f.attrs:
        f.attrs[ATTR_REPLAY_ID] = uuid.uuid4().hex
    f.attrs[ATTR_FORMAT] = FORMAT_VERSION


DEFAULT_FILENAME = "storage.hdf5"


def file_path(cache_path: str | os.PathLike[str]) -> str:
    """An existing directory means `<dir>/storage.hdf5` (as the reference did); else the file."""
    path = os.fspath(cache_path)
    return os.path.join(path, DEFAULT_FILENAME) if os.path.isdir(path) else path


def create_staging(f: h5py.File, leaves: list[tuple[str, LeafSpace]]) -> None:
    """The empty, growable staging dataset of every leaf (segment writers' hidden rows)."""
    group = f.require_group(STAGING_GROUP)
    for path, leaf in leaves:
        chunk_rows = _layout.whole_row_chunk_rows(leaf.row_bytes, None)
        group.create_dataset(
            path, shape=(0, *leaf.shape), maxshape=(None, *leaf.shape), chunks=(chunk_rows, *leaf.shape),
            dtype=h5_dtype(leaf),
        )


# ----------------------------------------------------------------------------- create and open


def create_file(
    path: str, space: Space, capacity: int | None, layouts: dict[str, dict[str, Any]],
    leaves: list[tuple[str, LeafSpace]], prepare: Prepare | None, h5kw: dict[str, Any], *, overwrite: bool = False,
) -> WriterLock:
    """Build a complete new file under a temporary name next to `path`, then move it into place.
    Returns the writer lock of the new file, taken before the file had a name anyone else knew.

    Without `overwrite` the file is linked into place, which fails if `path` appeared meanwhile;
    with it, the file replaces `path` (the caller holds the old file's lock).

    Raises:
        ConfigError: an h5py.File option is invalid, or `path` exists (without overwrite).
        StorageError: HDF5 failed; nothing is left at `path`.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".h5replay-", suffix=".tmp", dir=directory)
    lock = WriterLock(path).adopt(fd)
    try:
        try:
            f = h5py.File(tmp, "w", libver=libver(), **{**h5kw, "locking": False})
        except TypeError as exc:
            raise ConfigError(f"invalid h5py.File option: {exc}") from exc
        try:
            with h5_errors(f"creating {path}"):
                for p, leaf in leaves:
                    if "packed" in layouts[p]:
                        packed.create(f, p, leaf.row_bytes, typing.cast(int, capacity), layouts[p]["packed"])
                    else:
                        f.create_dataset(p, dtype=h5_dtype(leaf), **layouts[p])
                write_header(f, space, capacity)
                create_staging(f, leaves)
                if prepare is not None:
                    prepare(f)
        finally:
            f.close()
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise ConfigError(f"{path!r} already exists; open it with load_from, or pass overwrite=True") from None
            os.unlink(tmp)
    except BaseException:
        lock.release()
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return lock


def _hdf5_library() -> Any:
    """The HDF5 library h5py runs on, as a ctypes handle (None when it cannot be found)."""
    names = []
    with contextlib.suppress(OSError):
        with open("/proc/self/maps") as maps:
            names = sorted({line.split()[-1] for line in maps if "/libhdf5" in line and "_hl" not in line.split("/")[-1]})
    for name in names:
        with contextlib.suppress(OSError, AttributeError):
            lib = ctypes.CDLL(name)
            lib.H5Pset_metadata_read_attempts.argtypes = [ctypes.c_int64, ctypes.c_uint]
            return lib
    return None


_HDF5: list[Any] = []


@contextlib.contextmanager
def _bounded_metadata_reads() -> Iterator[None]:
    """Files opened inside this block make at most METADATA_READ_ATTEMPTS metadata read attempts
    (an SWMR reader's setting; h5py has no keyword for it, so its file access property list is
    amended as h5py makes it). Without the HDF5 symbol this does nothing."""
    from h5py._hl import files as _files

    if not _HDF5:
        _HDF5.append(_hdf5_library())
    lib, make_fapl = _HDF5[0], getattr(_files, "make_fapl", None)
    if lib is None or make_fapl is None:
        yield
        return

    def bounded(*args: Any, **kwargs: Any) -> Any:
        plist = make_fapl(*args, **kwargs)
        lib.H5Pset_metadata_read_attempts(plist.id, METADATA_READ_ATTEMPTS)
        return plist

    _files.make_fapl = bounded
    try:
        yield
    finally:
        _files.make_fapl = make_fapl


class _Interrupted(BaseException):
    """Raised by opening()'s signal handlers; turned into StorageError at its exit."""


_opening = threading.local()


@contextlib.contextmanager
def opening(path: str, timeout: float | None) -> Iterator[None]:
    """Give up opening `path` after `timeout` seconds, or at SIGTERM / SIGINT, with a
    StorageError saying so (the previous handlers run too). Only the main thread can take
    signals; elsewhere, and inside another opening() block, this does nothing more.

    HDF5 runs to the end of its current call first; with bounded metadata reads that is at most
    about a second.
    """
    if threading.current_thread() is not threading.main_thread() or getattr(
            _opening, "active", False):
        yield
        return
    previous: dict[int, Any] = {int(sig): signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM)}

    def interrupt(signum: int, frame: Any) -> None:
        handler = previous.get(signum)
        if callable(handler) and signum != signal.SIGALRM and handler is not signal.default_int_handler:
            handler(signum, frame)  # e.g. the server's: it remembers that it must stop
        raise _Interrupted(signum)

    _opening.active = True
    old_timer = signal.getitimer(signal.ITIMER_REAL)
    try:
        for sig in previous:
            signal.signal(sig, interrupt)
        if timeout is not None:
            signal.setitimer(signal.ITIMER_REAL, max(1e-3, float(timeout)))
        yield
    except _Interrupted as exc:
        signum = int(exc.args[0])
        if signum == signal.SIGALRM:
            raise StorageError(
                f"opening {path!r} took more than {timeout} s, and HDF5 was still retrying: its metadata is damaged "
                "(a checksum that never matches), or the disk does not answer. Copy out what is readable with "
                f"`h5replay export {path} OUT.h5`, or allow more time (--open-timeout)") from None
        raise StorageError(f"opening {path!r} was interrupted by {signal.Signals(signum).name}; nothing was changed") from None
    finally:
        if timeout is not None:
            signal.setitimer(signal.ITIMER_REAL, *old_timer)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _opening.active = False


def open_file(
    path: str, *, writable: bool, multiprocessing: bool, h5kw: dict[str, Any],
) -> tuple[h5py.File, bool, dict[str, Any]]:
    """Open `path`; returns (file, whether it is an SWMR reader, the h5py options used).

    A writer must hold the file's WriterLock (HDF5's own locking is off for it: see WriterLock):
    then status flags left by a killed writer are stale and are cleared first (as `h5clear -s`
    would). A plain reader refused because a live or killed SWMR writer marked the file is
    reopened as an SWMR reader, which sees exactly what the writer published. SWMR readers make
    at most METADATA_READ_ATTEMPTS attempts at a metadata block.

    Raises:
        ConfigError: an h5py.File option is invalid.
        StorageError: HDF5 cannot open the file.
    """
    kwargs = dict(h5kw)
    if writable:
        kwargs.setdefault("libver", libver())  # SWMR writing needs the v110 format bounds
        kwargs["locking"] = False  # our WriterLock holds the file; an HDF5 lock would collide with it
    elif multiprocessing:
        kwargs["swmr"] = True
    # Readers too: HDF5 refuses to open a file twice in one process with other locking flags, and
    # the superblock's consistency flags already keep plain readers off a file being written.
    kwargs.setdefault("locking", False)
    mode = "r+" if writable else "r"
    _readers.before_open(path)  # the library's own readers of the file give way (see _readers.py)
    with h5_errors(f"opening {path}"), _bounded_metadata_reads():
        try:
            f = h5py.File(path, mode, **kwargs)
        except TypeError as exc:
            raise ConfigError(f"invalid h5py.File option: {exc}") from exc
        except OSError:
            if writable or multiprocessing or not status_flags(path) & _SWMR_WRITE_FLAG:
                raise
        else:
            if multiprocessing or writable:
                _readers.opened(path, f, reader=not writable)
            return f, multiprocessing and not writable, kwargs
        kwargs.update(swmr=True, locking=False)
        f = h5py.File(path, mode, **kwargs)
        _readers.opened(path, f)
        return f, True, kwargs


def recover(path: str, lock: WriterLock) -> tuple[int, int | None]:
    """Make a file whose writer died openable again; needs `lock` held. Returns (the status flags
    that were cleared, 0 for none; the file's length when it was found shorter than its
    superblock says, else None). `unrecover` puts the file back as it was found.

    A file cut short (a write that failed on a full disk, or a copy or disk that lost its end) is
    lengthened back to its recorded end, so that HDF5 opens it; the caller must then check with
    a `Verify` hook that nothing published lay in the missing part, and `unrecover` it if so.
    Zeros may only ever stand in for bytes that were never published.

    Raises:
        StorageError: the lock is not held, or the superblock is damaged.
    """
    if not lock.held:
        raise StorageError(f"recovering {path!r} needs its writer lock")
    cleared = clear_status_flags(path)
    end, size = superblock_end(path)
    if end <= size:
        return cleared, None
    with open(path, "r+b") as f:
        os.ftruncate(f.fileno(), end)
    return cleared, size


def unrecover(path: str, cleared: int, length: int | None) -> None:
    """Undo `recover` on a file that is then refused: its length and status flags as found."""
    with contextlib.suppress(OSError, StorageError):
        if length is not None:
            with open(path, "r+b") as f:
                os.ftruncate(f.fileno(), length)
        restore_status_flags(path, cleared)


def missing_bytes(path: str, length: int) -> int:
    """How many bytes a file of `length` bytes lacks to reach the end its superblock records."""
    end, _ = superblock_end(path)
    return max(0, end - length)


def data_end(ds: h5py.Dataset, first: int, stop: int) -> int:
    """The byte after the last byte of the file that rows [first, stop) of `ds` occupy (0: none
    allocated). Contiguous data sits at one offset; chunked data chunk by chunk."""
    if stop <= first:
        return 0
    with h5_errors(f"locating the data of {ds.name}"):
        if ds.chunks is None:
            offset = ds.id.get_offset()
            if offset is None:
                return 0
            row_bytes = ds.dtype.itemsize * int(max(1, _prod(ds.shape[1:])))
            return int(offset) + stop * int(row_bytes)
        rows = ds.chunks[0]
        end = 0
        zeros = (0,) * (len(ds.shape) - 1)
        for chunk in range(first // rows, (stop - 1) // rows + 1):
            if chunk * rows >= ds.shape[0]:
                break
            info = ds.id.get_chunk_info_by_coord((chunk * rows, *zeros))
            if info.byte_offset is not None:
                end = max(end, int(info.byte_offset) + int(info.size))
        return end


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= int(n)
    return out


def verify_all_within(f: h5py.File, length: int) -> None:
    """The `Verify` of a file without a journal: every row of every leaf counts as published."""
    for name, obj in _walk(f):
        if isinstance(obj, h5py.Dataset) and not name.startswith(INTERNAL_GROUP) and obj.shape:
            end = data_end(obj, 0, obj.shape[0])
            if end > length:
                raise published_beyond(f.filename, length, end)


def _walk(f: h5py.File) -> list[tuple[str, Any]]:
    found: list[tuple[str, Any]] = []
    f.visititems(lambda name, obj: found.append((name, obj)))
    return found


def published_beyond(path: str, length: int, end: int) -> StorageError:
    """The error for a file that lost published data: it is refused, and nothing is zero-filled."""
    missing = missing_bytes(path, length) or max(0, end - length)
    error = StorageError(
        f"{path!r} is {missing} bytes shorter than its HDF5 superblock records ({length} bytes on disk), and rows it "
        f"published lie in the missing part (up to byte {end}): serving it would hand out zeros as data, so it is "
        f"refused. The file was cut (a copy or a disk that lost its end); copy out what is readable with "
        f"`h5replay export {path} OUT.h5` and serve the copy")
    error.cut_short = True  # type: ignore[attr-defined]  # tells it from other failures of a Verify hook
    return error


def start_swmr(f: h5py.File) -> None:
    with h5_errors("starting SWMR write mode"):
        f.swmr_mode = True
