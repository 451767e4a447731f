"""The writer's free-space reserve: new rows are refused while the disk holding the file would be
left with less than `min_free_bytes` free.

Nothing is written then, so no write fails and the server does not go read-only; writes resume by
themselves once space is freed. Reads the disk's figures only (os.statvfs), never the file.
"""

from __future__ import annotations

import os
import time

from h5replay.errors import DiskFullError

__all__ = ["DiskReserve"]


class DiskReserve:
    """The free space of the disk holding `path`, as last read, against a reserve of
    `min_free_bytes` (0: no reserve)."""

    def __init__(self, path: str | None, min_free_bytes: int) -> None:
        self.path = path
        self.min_free_bytes = min_free_bytes
        self._disk = os.path.dirname(os.path.abspath(path)) if path else None
        self._free = 0
        self._free_read = -1.0

    def room(self, incoming: int, what: str) -> None:
        """Refuse `incoming` bytes of new rows while the disk would be left with less than the
        reserve. The free space is read again every 50 ms (or when it looks short), so writes
        resume by themselves once space is freed.

        Raises:
            DiskFullError: the disk is below the reserve; nothing was written.
        """
        if self.min_free_bytes <= 0 or self._disk is None:
            return
        now = time.monotonic()
        if now - self._free_read > 0.05 or self._free - incoming < self.min_free_bytes:
            try:
                st = os.statvfs(self._disk)
            except OSError:
                return
            self._free, self._free_read = st.f_bavail * st.f_frsize, now
        if self._free - incoming < self.min_free_bytes:
            raise DiskFullError(
                f"refused to {what}: the disk holding {self.path} has {self._free} bytes free and this "
                f"server keeps {self.min_free_bytes} free (--min-free-bytes); free some space and try again (writes "
                "resume by themselves), or lower the reserve. Reads go on."
            )
        self._free -= incoming
