"""Whether a client runs on the host of the server's file, and which file that is.

A server's hello names its file (`local_file`): its path, the device and inode of the file it
holds open, and the host, as the kernel's boot id. A learner whose kernel has the same boot id,
and whose path leads to the same device and inode, draws from its own view of that file
(client/_local.py) instead of asking the server. The boot id, not the host name: containers of one
machine share a kernel (and its page cache) but not a name, and two machines may share a name.
The inode check settles the rest (another mount, another file at the same path). Which process
writes a file is the holder of its flock (storage/recovery.py's WriterLock), as /proc/locks
shows it. Pure: the standard library only.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["boot_id", "describe_file", "flock_holder", "same_file"]

_BOOT_ID = "/proc/sys/kernel/random/boot_id"  # Linux: a UUID drawn at each boot


def boot_id() -> str | None:
    """This kernel's boot id (None where the system does not say: then no file is shared)."""
    try:
        with open(_BOOT_ID, encoding="ascii") as f:
            value = f.read(64).strip()
    except (OSError, UnicodeDecodeError):
        return None
    return value or None


def describe_file(path: str, device: int, inode: int) -> dict[str, Any] | None:
    """What a server's hello says of its file (None when this host cannot be told apart)."""
    host = boot_id()
    if host is None:
        return None
    return {"path": os.path.abspath(path), "device": int(device), "inode": int(inode), "host": host}


def same_file(described: Any) -> str | None:
    """The path of the file `described` (a hello's `local_file`) when it is on this host and the
    path leads to that very file now; None otherwise (another host, another file, no file, a
    description that is not one)."""
    if not isinstance(described, dict):
        return None
    path, device, inode, host = (described.get(k) for k in ("path", "device", "inode", "host"))
    if not (isinstance(path, str) and os.path.isabs(path) and isinstance(host, str)
            and type(device) is int and type(inode) is int):
        return None
    if host != boot_id():
        return None
    try:
        st = os.stat(path)
    except (OSError, ValueError):  # ValueError: a path with a NUL byte
        return None
    return path if (st.st_dev, st.st_ino) == (device, inode) else None


def flock_holder(device: int, inode: int) -> int | None:
    """The pid (as this process sees it) holding a flock on the file (device, inode), from
    /proc/locks; None when no process does, the system does not say, or the holder is in a pid
    namespace this process cannot see (shown as pid 0)."""
    where = f"{os.major(device):02x}:{os.minor(device):02x}:{inode}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as locks:
            for line in locks:
                fields = line.split()
                # "1: FLOCK  ADVISORY  WRITE 12345 fe:00:2146868 0 EOF" (a "->" marks a waiter)
                if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == where and fields[4].isdigit():
                    pid = int(fields[4])
                    return pid or None
    except OSError:
        pass
    return None
