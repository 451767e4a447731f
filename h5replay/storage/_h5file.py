"""The HDF5 file itself: creating it atomically, opening it (plain, SWMR writer, SWMR reader),
recovering it after a killed writer, its attributes, and the one place h5py errors are translated.

Every HDF5 object a file will ever hold is created here, before SWMR starts (SWMR forbids creating
objects later): the leaves' datasets, the hidden staging datasets of segment writers, and whatever
the caller's `prepare` adds (the replay journal). A new file is built under a temporary name,
renamed into place, then reopened by its final name: a crash never leaves a half-made file at the
path, and everything downstream (the memory-mapped read path included) sees the real name.

This module owns no rows and no bookkeeping; it hands open `h5py.File`s to `hdf5.py`.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import traceback
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import h5py

from h5replay.errors import ConfigError, FormatVersionError, StorageError
from h5replay.spaces import LeafSpace, Space, TextSpace, space_from_json
from h5replay.storage import _layout
from h5replay.storage.recovery import WriterLock, clear_status_flags, status_flags

__all__ = [
    "FORMAT_VERSION", "ATTR_FORMAT", "ATTR_SPACE", "ATTR_CAPACITY", "ATTR_REPLAY_ID", "INTERNAL_GROUP",
    "STAGING_GROUP", "h5_errors", "h5_dtype", "libver", "read_header", "create_file", "open_file", "Prepare",
]

#: Version 2 added the replay id and the journal's fixed state row (version 1 files are upgraded
#: in place the first time they are opened for writing, and read as they are otherwise).
FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)
ATTR_FORMAT = "h5replay_format_version"
ATTR_SPACE = "h5replay_space"
ATTR_CAPACITY = "h5replay_capacity"
ATTR_REPLAY_ID = "h5replay_replay_id"
INTERNAL_GROUP = "_h5replay"
STAGING_GROUP = f"{INTERNAL_GROUP}/staging"
_SWMR_WRITE_FLAG = 0x04  # superblock status flag: open for SWMR writing
# HDF5 format bounds: v110 structures are what SWMR needs; capping at v114 keeps files readable by
# HDF5 1.14 tools even when h5py is built on HDF5 2.x.
_LIBVER = ("v110", "v114")

#: Adds objects to a file before SWMR starts (a new file, or an old one being upgraded).
Prepare = Callable[[h5py.File], None]


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


def h5_dtype(leaf: LeafSpace) -> Any:
    """The HDF5 type of a leaf's dataset: fixed-length UTF-8 for text (SWMR cannot write vlen)."""
    if isinstance(leaf, TextSpace):
        return h5py.string_dtype("utf-8", length=leaf.storage_dtype.itemsize)
    return leaf.storage_dtype


# ---------------------------------------------------------------------------------- attributes


def read_header(group: h5py.Group) -> tuple[Space | None, int | None]:
    """(space, capacity) from h5replay's attributes, or (None, None) for a raw file."""
    attrs = group.attrs
    if ATTR_SPACE not in attrs:
        return None, None
    version = int(attrs.get(ATTR_FORMAT, 0))
    if version not in _READABLE_VERSIONS:
        raise FormatVersionError(
            f"{group.file.filename!r} has h5replay format version {version}; this h5replay reads versions "
            f"{_READABLE_VERSIONS}. Upgrade h5replay, or export the file with the version that wrote it."
        )
    raw = attrs[ATTR_SPACE]
    text = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
    try:
        space = space_from_json(json.loads(text))
    except (ValueError, TypeError) as exc:
        raise StorageError(f"{group.file.filename!r} has an unreadable space description: {exc}") from exc
    capacity = int(attrs.get(ATTR_CAPACITY, -1))
    return space, (None if capacity < 0 else capacity)


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
    leaves: list[tuple[str, LeafSpace]], prepare: Prepare | None, h5kw: dict[str, Any],
) -> None:
    """Build a complete new file under a temporary name next to `path`, then rename it into place.

    The caller holds the file's WriterLock and reopens the file by its final name.

    Raises:
        ConfigError: an h5py.File option is invalid.
        StorageError: HDF5 failed; nothing is left at `path`.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".h5replay-", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        try:
            f = h5py.File(tmp, "w", libver=libver(), **h5kw)
        except TypeError as exc:
            raise ConfigError(f"invalid h5py.File option: {exc}") from exc
        try:
            with h5_errors(f"creating {path}"):
                for p, leaf in leaves:
                    f.create_dataset(p, dtype=h5_dtype(leaf), **layouts[p])
                write_header(f, space, capacity)
                create_staging(f, leaves)
                if prepare is not None:
                    prepare(f)
        finally:
            f.close()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def open_file(
    path: str, *, writable: bool, multiprocessing: bool, h5kw: dict[str, Any],
) -> tuple[h5py.File, bool, dict[str, Any]]:
    """Open `path`; returns (file, whether it is an SWMR reader, the h5py options used).

    A writer must hold the file's WriterLock: then status flags left by a killed writer are
    stale and are cleared first (as `h5clear -s` would). A plain reader refused because a live or
    killed SWMR writer marked the file is reopened as an SWMR reader, which sees exactly what the
    writer published.

    Raises:
        ConfigError: an h5py.File option is invalid.
        StorageError: HDF5 cannot open the file.
    """
    kwargs = dict(h5kw)
    if writable:
        kwargs.setdefault("libver", libver())  # SWMR writing needs the v110 format bounds
    elif multiprocessing:
        kwargs["swmr"] = True
        kwargs.setdefault("locking", False)
    mode = "r+" if writable else "r"
    with h5_errors(f"opening {path}"):
        try:
            return h5py.File(path, mode, **kwargs), multiprocessing and not writable, kwargs
        except TypeError as exc:
            raise ConfigError(f"invalid h5py.File option: {exc}") from exc
        except OSError:
            if writable or multiprocessing or not status_flags(path) & _SWMR_WRITE_FLAG:
                raise
        kwargs.update(swmr=True, locking=False)
        return h5py.File(path, mode, **kwargs), True, kwargs


def recover(path: str, lock: WriterLock) -> bool:
    """Clear the status flags a killed writer left; True when there were any. Needs `lock` held."""
    if not lock.held:
        raise StorageError(f"recovering {path!r} needs its writer lock")
    return clear_status_flags(path)


def start_swmr(f: h5py.File) -> None:
    with h5_errors("starting SWMR write mode"):
        f.swmr_mode = True
