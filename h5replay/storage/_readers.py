"""The SWMR readers of each file open in this process.

HDF5 opens a file once per process: a second `h5py.File` of the same file shares the first one's
state, and a dataset refreshed through one handle goes stale through the other (reads then fail
with "can't insert duplicate key", or return rows of another moment; growing datasets and
compressed records meet it at once). So a reader that the library opens for its own use (a
learner's view of its server's file, client/_local.py) opens only where no other reader of the
file is open in the process, and gives way (closes) when one opens: `yields` registers it so.
Readers the caller opens are counted (`open_readers`) and left as they are.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable

import h5py

__all__ = ["before_open", "opened", "open_readers", "yields"]

log = logging.getLogger("h5replay.storage")

_Key = tuple[int, int]  # (device, inode)
# Each file's readers: the h5py.File (weakly), and what closes it when another reader opens (None:
# the caller's own reader, never closed here).
_readers: dict[_Key, list[tuple[weakref.ref[h5py.File], Callable[[], None] | None]]] = {}
_lock = threading.Lock()


def _key(path: str) -> _Key | None:
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def _alive(key: _Key) -> list[tuple[weakref.ref[h5py.File], Callable[[], None] | None]]:
    """The entries of `key` whose file is still open (the others dropped)."""
    entries = []
    for ref, release in _readers.get(key, []):
        f = ref()
        if f is not None and f.id.valid:
            entries.append((ref, release))
    if entries:
        _readers[key] = entries
    else:
        _readers.pop(key, None)
    return entries


def open_readers(path: str) -> int:
    """How many SWMR readers of the file at `path` (and writers of it) are open in this process."""
    key = _key(path)
    if key is None:
        return 0
    with _lock:
        return len(_alive(key))


def before_open(path: str) -> None:
    """A reader of `path` is about to open: the library's own readers of that file give way."""
    key = _key(path)
    if key is None:
        return
    with _lock:
        releases = [release for _, release in _alive(key) if release is not None]
    for release in releases:  # outside the lock: a release may wait for a read to finish
        try:
            release()
        except Exception as exc:  # giving way must not stop the caller's open
            log.warning("a reader of %s did not close to give way to another: %s", path, exc)


def opened(path: str, f: h5py.File, *, reader: bool = True) -> None:
    """`f`, an SWMR reader of `path` (or, not `reader`, its writer), is open: the caller's, until
    `yields` says otherwise. The library's own readers never open a file this process writes."""
    key = _key(path)
    if key is None:
        return
    with _lock:
        others = len(_alive(key))
        _readers.setdefault(key, []).append((weakref.ref(f), None))
    if others and reader:
        log.warning("%s is open %d times as an SWMR reader in this process: HDF5 shares one file per process, "
                    "so a reader refreshed through one handle goes stale through the other (reads of growing or "
                    "compressed datasets fail); share one reader", path, others + 1)


def yields(path: str, release: Callable[[], None]) -> bool:
    """The only reader of `path` open in this process is one the library opened for itself:
    `release` closes it when another reader of that file opens. False (nothing registered) when
    another reader opened meanwhile: the caller closes its own."""
    key = _key(path)
    if key is None:
        return False
    with _lock:
        entries = _alive(key)
        if len(entries) != 1:
            return False
        _readers[key] = [(entries[0][0], release)]
        return True
