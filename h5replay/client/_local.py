"""Rows read from the server's file itself, by a learner on the file's host.

When a server's hello names a file this process reaches (`hosts.same_file`: the same kernel, a
path that leads to the same device and inode), the learner asks for draws alone (ids,
episodes, probabilities: `Sample(with_rows=False)`) and reads the rows from its own SWMR view of
the file: no batch is copied through a socket. The draw keeps every guarantee of the service
(the server's sampler and priorities, a view no older than the client has seen); only the copy
of the rows moves here. Draws that change the server's state (queues, rate limits) still carry
their rows: a row such a draw hands out cannot be drawn again, so it must not be lost to an
eviction between the draw and the read.

No row evicted or cleared between the draw and the read is returned: the view's own consistent
read (`ReplayBuffer.get_rows`: every id held, re-read when the writer overwrote what was read)
runs in a state of the draw's generation and no older than it, or the read gives up (`None`) and
the caller makes the draw again with its rows. A view that cannot be opened, or turns out not to
be the server's file, is given up for good, and the rows travel as before.

Every learner of a process reads a file through one view (HDF5 opens a file once per process, and
a dataset refreshed through one handle goes stale through another: storage/_readers.py). The view
is not opened where the process already holds another SWMR reader of the file, and gives way
(closes, and the rows travel again) when the caller opens one.

h5py and the storage load here only when a learner first reads locally: nothing at module level,
so actors and DataLoader workers that import the client stay light.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

from h5replay import protocol as P
from h5replay.codecs import DamagedRecordError
from h5replay.errors import EvictedError, H5ReplayError
from h5replay.hosts import same_file

__all__ = ["LocalRows"]

log = logging.getLogger("h5replay.client")
_OPEN_TIMEOUT = 5.0  # seconds the view may take to open; a slower file is read over the socket


class _View:
    """One SWMR view of a file, shared by every learner of this process that reads it: opened at
    the first read, closed when its last learner closes (or it gives way to another reader)."""

    def __init__(self, path: str, replay_id: str) -> None:
        self.path, self.replay_id = path, replay_id
        self.lock = threading.RLock()  # one read at a time: the view's state is not shared safely
        self.buffer: Any = None  # the ReplayBuffer reader, once open
        self.users = 0
        self.given_up: str | None = None  # why it is not used (None: it is, or will be)

    def open(self) -> Any:
        """The reader (opened now if need be), or None when it cannot be used."""
        if self.buffer is not None or self.given_up is not None:
            return self.buffer
        from h5replay.storage._own_reader import open_own_reader  # h5py loads here, not with the client

        try:
            buffer = open_own_reader(self.path, self._give_way, open_timeout=_OPEN_TIMEOUT)
        except (H5ReplayError, OSError, ValueError) as exc:
            self.give_up(f"it did not open: {exc}")
            return None
        if buffer is None:
            self.give_up("this process holds another reader of the file (HDF5 opens a file once per process)")
        elif buffer.replay_id != self.replay_id:
            buffer.close()
            self.give_up(f"it holds replay {buffer.replay_id}, not the server's {self.replay_id}")
        else:
            self.buffer = buffer
        return self.buffer

    def _give_way(self) -> None:
        with self.lock:  # after the read in progress, if any
            self.give_up("another reader of the file opened in this process")

    def give_up(self, why: str) -> None:
        if self.given_up is None:
            self.given_up = why
            log.info("rows of %s travel over the socket from now on: %s", self.path, why)
        buffer, self.buffer = self.buffer, None
        if buffer is not None:
            buffer.close()


_views: dict[tuple[str, str], _View] = {}
_views_lock = threading.Lock()


def _take(path: str, replay_id: str) -> _View:
    with _views_lock:
        view = _views.get((path, replay_id))
        if view is None or view.given_up is not None:
            view = _views[(path, replay_id)] = _View(path, replay_id)
        view.users += 1
        return view


def _let_go(view: _View) -> None:
    with _views_lock:
        view.users -= 1
        if view.users > 0:
            return
        if _views.get((view.path, view.replay_id)) is view:
            del _views[(view.path, view.replay_id)]
    with view.lock:
        view.give_up("closed")


class LocalRows:
    """A learner's use of the view of its server's file (see the module doc).

    Args:
        path: the file, as this process reaches it.
        replay_id: the replay the server serves; a file holding another is not used.
    """

    def __init__(self, path: str, replay_id: str) -> None:
        self.path = path
        self.replay_id = replay_id
        self._view: _View | None = None
        self._closed = False
        #: Draws whose rows were read here, and those made again with their rows (evicted meanwhile).
        self.num_read = 0
        self.num_missed = 0

    @classmethod
    def of(cls, hello: P.HelloReply, enabled: bool) -> LocalRows | None:
        """The view of the file `hello` names, when `enabled` and this process reaches that very file."""
        if not enabled:
            return None
        path = same_file(hello.local_file)
        return None if path is None else cls(path, hello.replay_id)

    @property
    def given_up(self) -> str | None:
        """Why rows are not read here (None: they are, or will be at the first read)."""
        if self._closed:
            return "closed"
        return None if self._view is None else self._view.given_up

    @property
    def usable(self) -> bool:
        return self.given_up is None

    def read(self, reply: P.SampleReply) -> dict[str, np.ndarray] | None:
        """The rows (wire form: stored dtypes, compressed leaves decoded) of a draw made without
        them, from a state of the draw's generation and no older than it; None when they cannot
        be read so (evicted or cleared since the draw, or this view given up): draw again.

        Raises:
            DamagedRecordError: a stored record does not decode (never returned as data).
        """
        if self._closed:
            return None
        if self._view is None:
            self._view = _take(self.path, self.replay_id)
        view = self._view
        with view.lock:
            buffer = view.open()
            if buffer is None:
                return None
            try:
                arrays = buffer.get_rows(np.asarray(reply.row_ids).astype(np.int64), decode=False)
            except DamagedRecordError:
                raise
            except EvictedError:
                self.num_missed += 1
                return None
            except (H5ReplayError, IndexError, OSError, ValueError, TypeError) as exc:
                view.give_up(f"reading rows failed: {exc}")  # not the file the server draws from
                return None
            state = buffer.last_view
            if state.generation != reply.generation or state.seq < reply.seq:
                if state.seq < reply.seq:  # the server published more than this file shows: another file
                    view.give_up(f"the file shows publish {state.seq}, older than the server's {reply.seq}")
                self.num_missed += 1
                return None
            self.num_read += 1
            return dict(arrays)

    def close(self) -> None:
        """No read is made here afterwards; the view closes with its last learner. Safe twice."""
        if self._closed:
            return
        self._closed = True
        view, self._view = self._view, None
        if view is not None:
            _let_go(view)
