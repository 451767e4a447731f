"""Rows drawn from the server's file itself, by a learner on the file's host.

When a server's hello names a file this process reaches (`hosts.same_file`: the same kernel, a
path that leads to the same device and inode), the learner draws from its own SWMR view of that
file, with the server's own sampling code over the state the writer published: no request, no
batch copied through a socket. What the service promises holds: the tables' samplers and the
priorities are the file's (a learner's own updates are published before their reply, so its next
draw sees them); a draw is one consistent read (a row the ring overwrote mid-read is never
returned); the view is never older than one this client has seen. Draws that change the
server's state (queues, rate limits, rows removed as sampled) go to the server as before: only
its writer may make them.

A server restarted on another file would leave the view behind: at most every
`CONFIRM_INTERVAL` seconds the learner asks the server which file it serves (its info: device and
inode, and the server process), and the view is given up when that is not the file it holds. A
view never spans two writers of the file either (a reader opened under one writer reads stale
metadata under the next, after its recovery): before a draw, every `WRITER_CHECK_INTERVAL` at
most, the learner looks at which process holds the file's writer lock (/proc/locks), and when it
is no longer the one the server confirmed, the server is asked again before the next draw; a
restarted server's file is then opened afresh. A writer that cannot be seen from here (another
pid namespace) leaves the draws to the server. A view that does not open,
holds another replay, shows an older publish than the client has seen, or fails a read is given
up too, and the learner draws over the socket from then on.

Every learner of a process reads a file through one view (HDF5 opens a file once per process, and
a dataset refreshed through one handle goes stale through another: storage/_readers.py). The view
is not opened where the process already holds another reader or the writer of the file, and
gives way (closes, and draws travel again) when the caller opens one.

h5py and the storage load here only when a learner first draws locally: nothing at module level,
so actors and DataLoader workers that import the client stay light.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import numpy as np

from h5replay import protocol as P
from h5replay.client._reads import View
from h5replay.codecs import DamagedRecordError
from h5replay.errors import ConfigError, H5ReplayError, NotEnoughDataError
from h5replay.hosts import flock_holder, same_file

__all__ = ["CONFIRM_INTERVAL", "LocalRows"]

log = logging.getLogger("h5replay.client")
_OPEN_TIMEOUT = 5.0  # seconds the view may take to open; a slower file is drawn from over the socket
CONFIRM_INTERVAL = 1.0  # seconds between two questions to the server: is this still the file it serves?
WRITER_CHECK_INTERVAL = 0.005  # seconds between two looks at who holds the file's writer lock


class _View:
    """One SWMR view of a file, shared by every learner of this process that reads it: opened at
    the first read, closed when its last learner closes (or it gives way to another reader)."""

    def __init__(self, path: str, replay_id: str) -> None:
        self.path, self.replay_id = path, replay_id
        self.lock = threading.RLock()  # one read at a time: the view's state is not shared safely
        self.buffer: Any = None  # the ReplayBuffer reader, once open
        self.users = 0
        self.given_up: str | None = None  # why it is not used (None: it is, or will be)
        self.pid = os.getpid()  # a child (fork) never uses its parent's view: it opens none of its own
        # Given up because the server restarted: opened under another writer, it is reopened.
        self.restarted = False

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
            log.info("draws from %s travel over the socket from now on: %s", self.path, why)
        buffer, self.buffer = self.buffer, None
        if buffer is not None:
            buffer.close()


_views: dict[tuple[str, str], _View] = {}
_views_lock = threading.Lock()


def _take(path: str, replay_id: str) -> _View:
    with _views_lock:
        view = _views.get((path, replay_id))
        if view is None or view.given_up is not None or view.pid != os.getpid():
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
        instance_id: the server process the hello came from.
    """

    def __init__(self, path: str, replay_id: str, instance_id: str = "") -> None:
        self.path = path
        self.replay_id = replay_id
        self._instance = instance_id
        self._view: _View | None = None
        self._closed = False
        self._confirmed_at: float | None = None  # when the server last said it serves this file
        self._file: tuple[int, int] | None = None  # (device, inode) of the file the view holds
        self._writer: int | None = None  # the pid holding the file's writer lock, when confirmed
        self._writer_seen = 0.0  # when it was last seen holding it
        #: Draws made from the file.
        self.num_draws = 0

    @classmethod
    def of(cls, hello: P.HelloReply, enabled: bool) -> LocalRows | None:
        """The view of the file `hello` names, when `enabled` and this process reaches that very file."""
        if not enabled:
            return None
        path = same_file(hello.local_file)
        return None if path is None else cls(path, hello.replay_id, hello.instance_id)

    @property
    def given_up(self) -> str | None:
        """Why draws are not made here (None: they are, or will be after the next confirmation)."""
        if self._closed:
            return "closed"
        if self._view is None or self._view.restarted:
            return None
        return self._view.given_up

    @property
    def usable(self) -> bool:
        return self.given_up is None

    def due(self, now: float) -> bool:
        """Whether the server must be asked which file it serves before the next draw."""
        return (self._confirmed_at is None or now - self._confirmed_at >= CONFIRM_INTERVAL
                or (self._view is not None and self._view.restarted))

    def confirm(self, stats: dict[str, Any], now: float) -> None:
        """The server's info `stats` name the file it serves and the server process: the view is
        reopened when that process is another (it was opened under another writer), given up
        unless the file is the view's and a writer of it is visible from here."""
        if self._closed:
            return
        instance = stats.get("instance_id")
        if self._view is not None and (self._view.restarted or instance != self._instance):
            self._reopen()
        view = self._take()
        with view.lock:
            buffer = view.open()
            if buffer is None:
                return
            try:
                held = buffer.file_storage.file_identity()
            except H5ReplayError as exc:
                view.give_up(f"it cannot be looked at: {exc}")
                return
            served = (stats.get("file_device"), stats.get("file_inode"))
            if served != held or stats.get("replay_id", self.replay_id) != self.replay_id:
                view.give_up(f"the server now serves another file (device {served[0]}, inode {served[1]})")
                return
            writer = flock_holder(*held)
            if writer is None:  # its writer cannot be watched from here (another pid namespace)
                view.give_up("no writer of the file is visible from this process")
                return
        self._instance, self._file, self._writer = str(instance), held, writer
        self._confirmed_at, self._writer_seen = now, time.monotonic()

    def _reopen(self) -> None:
        """The server restarted: the view, opened under the writer before, closes (for every
        learner of the process) and a fresh one is taken."""
        old, self._view = self._view, None
        if old is None:
            return
        with old.lock:
            old.give_up("the server restarted: a view opened under its writer before is opened again")
            old.restarted = True
        _let_go(old)

    def _writer_unchanged(self) -> bool:
        """Whether the process that held the file's writer lock at the confirmation still does
        (looked at every WRITER_CHECK_INTERVAL at most). A writer that died, and the next one, are
        noticed before the next one can change the file: a view must not span two writers."""
        now = time.monotonic()
        if now - self._writer_seen < WRITER_CHECK_INTERVAL:
            return True
        if self._file is None or flock_holder(*self._file) != self._writer:
            self._confirmed_at = None  # ask the server again before the next draw from here
            return False
        self._writer_seen = now
        return True

    def draw(self, method: str, min_seq: int, *args: Any, with_info: bool = True,
             **kwargs: Any) -> tuple[dict[str, np.ndarray], Any, View] | None:
        """(rows in wire form: stored dtypes, compressed leaves decoded; their SampleInfo, or None
        without `with_info`; the view they were drawn in) of `ReplayBuffer.<method>(*args,
        decode=False, **kwargs)` on this view, in a state no older than `min_seq`; None when this
        view is given up (the caller draws over the socket).

        Raises:
            NotEnoughDataError, ConfigError, DamagedRecordError: as the server's draw would.
        """
        if self._closed or self._confirmed_at is None or not self._writer_unchanged():
            return None
        view = self._take()
        with view.lock:
            buffer = view.open()
            if buffer is None:
                return None
            try:
                drawn = getattr(buffer, method)(*args, with_info=with_info, decode=False, **kwargs)
            except (NotEnoughDataError, ConfigError, DamagedRecordError):
                if buffer.view.seq < min_seq:
                    view.give_up(f"the file shows publish {buffer.view.seq}, older than {min_seq} this client has seen")
                    return None
                raise
            except (H5ReplayError, IndexError, OSError, ValueError, TypeError) as exc:
                view.give_up(f"a draw from it failed: {exc}")
                return None
            state = buffer.last_view
            if state.seq < min_seq:  # this client saw a newer publish: not the file served
                view.give_up(f"the file shows publish {state.seq}, older than {min_seq} this client has seen")
                return None
            arrays, info = drawn if with_info else (drawn, None)
            self.num_draws += 1
            return dict(arrays), info, View(state.seq, state.generation, state.begin, state.end)

    def _take(self) -> _View:
        if self._view is None:
            self._view = _take(self.path, self.replay_id)
        return self._view

    def close(self) -> None:
        """No draw is made here afterwards; the view closes with its last learner. Safe twice."""
        if self._closed:
            return
        self._closed = True
        view, self._view = self._view, None
        if view is not None:
            _let_go(view)
