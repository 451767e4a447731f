"""A reader the library opens for its own use: a learner's view of its server's file.

It opens only where no other SWMR reader of the file is open in this process, and gives way when
one opens (HDF5 opens a file once per process: see _readers.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from h5replay.storage import _readers
from h5replay.storage.replay.buffer import ReplayBuffer

__all__ = ["open_own_reader"]


def open_own_reader(path: str | os.PathLike[str], release: Callable[[], None], **storage_kwargs: Any) -> ReplayBuffer | None:
    """An SWMR reader of the replay at `path`, or None when this process holds another reader of
    it. `release` is called (it must close the reader) when another reader of the file opens here.

    Raises:
        StorageError: as `ReplayBuffer.load_from`.
    """
    where = os.fspath(path)
    if _readers.open_readers(where):
        return None
    buffer = ReplayBuffer.load_from(where, read_only=True, multiprocessing=True, **storage_kwargs)
    if not _readers.yields(where, release):
        buffer.close()
        return None
    return buffer
