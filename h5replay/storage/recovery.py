"""Writer lock and crash recovery for one HDF5 file.

A writer (server or local) holds an exclusive `flock` on the HDF5 file itself, on a descriptor of
its own, for as long as the file is open for writing. The lock belongs to the file (its inode),
not to a name: a second writer reaching the same file by a symlink, a hard link or another mount
path meets the same lock. HDF5's own lock cannot serve: an SWMR writer drops it right after
opening, so the writer opens the file with HDF5's locking off and relies on this one. When we
hold the lock no other h5replay writer is alive, and status flags left in the superblock by a
writer that was killed are stale: `clear_status_flags` clears them, as `h5clear -s` would,
without needing the HDF5 command-line tools. The kernel drops the lock when its holder dies.

The superblock (format versions 2 and 3, which SWMR files use) is: signature (8 bytes), version,
size of offsets, size of lengths, status flags, four addresses, then a Jenkins lookup3 checksum
of everything before it. Pure Python, stdlib only.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from typing import IO

from h5replay.errors import StorageError
from h5replay.hosts import flock_holder

__all__ = [
    "WriterLock", "clear_status_flags", "restore_status_flags", "status_flags", "superblock_end", "lock_holder", "lookup3",
]

_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_MASK = 0xFFFFFFFF
_MAX_USERBLOCK = 1 << 30


def _rot(x: int, k: int) -> int:
    return ((x << k) | (x >> (32 - k))) & _MASK


def lookup3(data: bytes, initval: int = 0) -> int:
    """Bob Jenkins' lookup3 `hashlittle`, as HDF5 checksums its metadata (H5_checksum_lookup3)."""
    length = len(data)
    a = b = c = (0xDEADBEEF + length + initval) & _MASK
    i = 0
    while length > 12:
        a = (a + int.from_bytes(data[i : i + 4], "little")) & _MASK
        b = (b + int.from_bytes(data[i + 4 : i + 8], "little")) & _MASK
        c = (c + int.from_bytes(data[i + 8 : i + 12], "little")) & _MASK
        a = ((a - c) & _MASK) ^ _rot(c, 4); c = (c + b) & _MASK  # noqa: E702 - lookup3's mix, as written
        b = ((b - a) & _MASK) ^ _rot(a, 6); a = (a + c) & _MASK  # noqa: E702
        c = ((c - b) & _MASK) ^ _rot(b, 8); b = (b + a) & _MASK  # noqa: E702
        a = ((a - c) & _MASK) ^ _rot(c, 16); c = (c + b) & _MASK  # noqa: E702
        b = ((b - a) & _MASK) ^ _rot(a, 19); a = (a + c) & _MASK  # noqa: E702
        c = ((c - b) & _MASK) ^ _rot(b, 4); b = (b + a) & _MASK  # noqa: E702
        length -= 12
        i += 12
    if length == 0:
        return c
    tail = data[i:] + bytes(12 - length)
    a = (a + int.from_bytes(tail[0:4], "little")) & _MASK
    b = (b + int.from_bytes(tail[4:8], "little")) & _MASK
    c = (c + int.from_bytes(tail[8:12], "little")) & _MASK
    c ^= b; c = (c - _rot(b, 14)) & _MASK  # noqa: E702 - lookup3's final, as written
    a ^= c; a = (a - _rot(c, 11)) & _MASK  # noqa: E702
    b ^= a; b = (b - _rot(a, 25)) & _MASK  # noqa: E702
    c ^= b; c = (c - _rot(b, 16)) & _MASK  # noqa: E702
    a ^= c; a = (a - _rot(c, 4)) & _MASK  # noqa: E702
    b ^= a; b = (b - _rot(a, 14)) & _MASK  # noqa: E702
    c ^= b; c = (c - _rot(b, 24)) & _MASK  # noqa: E702
    return c


def _find_superblock(f: IO[bytes]) -> int:
    """The superblock's offset: 0, or after a user block of 512, 1024, 2048, ... bytes."""
    size = os.fstat(f.fileno()).st_size
    offset = 0
    while offset < min(size, _MAX_USERBLOCK):
        f.seek(offset)
        if f.read(8) == _SIGNATURE:
            return offset
        offset = 512 if offset == 0 else offset * 2
    raise StorageError(f"{f.name!r} is not an HDF5 file (no superblock signature)")


def _read_superblock(f: IO[bytes]) -> tuple[int, bytearray, int]:
    """(offset, superblock bytes without checksum, stored checksum) for a v2/v3 superblock."""
    offset = _find_superblock(f)
    f.seek(offset)
    head = f.read(12)
    version, size_of_offsets = head[8], head[9]
    if version < 2:
        return offset, bytearray(head), -1  # v0/v1 superblocks have no status flags to clear
    body = bytearray(head + f.read(4 * size_of_offsets))
    stored = int.from_bytes(f.read(4), "little")
    return offset, body, stored


def status_flags(path: str | os.PathLike[str]) -> int:
    """The superblock's file status flags (bit 0: open for write, bit 2: open for SWMR write)."""
    with open(path, "rb") as f:
        _, body, stored = _read_superblock(f)
    return 0 if stored < 0 else body[11]


def superblock_end(path: str | os.PathLike[str]) -> tuple[int, int]:
    """(end of file the superblock records, actual length of the file) for a v2/v3 superblock;
    (-1, length) for older superblocks, which record no checked end.

    The recorded end is the file's whole length, a user block before the superblock included
    (HDF5 compares it with the file's size as it is, not with the size past the base address)."""
    with open(path, "rb") as f:
        _, body, stored = _read_superblock(f)
        size = os.fstat(f.fileno()).st_size
    if stored < 0:
        return -1, size
    size_of_offsets = body[9]
    end_field = 12 + 2 * size_of_offsets  # after the base address and the superblock extension's
    return int.from_bytes(body[end_field : end_field + size_of_offsets], "little"), size


def clear_status_flags(path: str | os.PathLike[str]) -> int:
    """Clear the status flags a killed writer left (like `h5clear -s`); returns the flags that
    were set (0: none, nothing written).

    Only call this while holding the file's WriterLock: clearing the flags of a live writer's
    file would let a second writer in. The file's length is not touched (a file shorter than its
    superblock says is the caller's business: see `_h5file.recover`).

    Raises:
        StorageError: the superblock's checksum does not match (the file is damaged).
    """
    return _write_status_flags(path, 0)


def restore_status_flags(path: str | os.PathLike[str], flags: int) -> None:
    """Put back flags `clear_status_flags` cleared (a file that is then refused stays as found)."""
    if flags:
        _write_status_flags(path, flags)


def _write_status_flags(path: str | os.PathLike[str], flags: int) -> int:
    with open(path, "r+b") as f:
        offset, body, stored = _read_superblock(f)
        if stored < 0 or body[11] == flags:
            return 0  # no flags in a v0/v1 superblock, or nothing to change
        if lookup3(bytes(body)) != stored:
            raise StorageError(f"{os.fspath(path)!r} has a damaged superblock (checksum mismatch); it cannot be recovered here")
        old = int(body[11])
        body[11] = flags
        f.seek(offset)
        f.write(bytes(body) + lookup3(bytes(body)).to_bytes(4, "little"))
        f.flush()
        os.fsync(f.fileno())
    return old


def lock_holder(fd: int) -> str:
    """The pid holding a flock on the file open as `fd` (from /proc/locks), or 'unknown'."""
    st = os.fstat(fd)
    holder = flock_holder(st.st_dev, st.st_ino)
    return "unknown" if holder is None else str(holder)


class WriterLock:
    """An exclusive flock on the HDF5 file itself, held while one process writes it.

    The lock is taken on a descriptor of its own, so it follows the file, whatever name reaches
    it. The kernel drops it when the holder dies, so a crashed writer never blocks the next one.
    HDF5 must open the file with its own locking off (`locking=False`): an HDF5 lock taken on
    another descriptor of the same file would collide with this one.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._fd: int | None = None

    def acquire(self) -> WriterLock:
        """Take the lock now or raise StorageError naming the holder.

        Raises:
            FileNotFoundError: there is no file at the path.
            StorageError: another process holds the lock.
        """
        return self.adopt(os.open(self.path, os.O_RDONLY | os.O_CLOEXEC))

    def adopt(self, fd: int) -> WriterLock:
        """Take the lock through `fd`, an open descriptor of the file, which the lock then owns
        (closed on failure). Used for a file just made under a temporary name: the lock follows
        it through the rename."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = lock_holder(fd)
            os.close(fd)
            raise StorageError(
                f"{self.path!r} is already open for writing by another process (pid {holder}); "
                "stop it first, or open the file read-only"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock. Safe to call twice."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def same_file(self, path: str | os.PathLike[str]) -> bool:
        """Whether `path` names the file this lock holds (a rename may have replaced it)."""
        if self._fd is None:
            return False
        try:
            return os.path.samestat(os.fstat(self._fd), os.stat(path))
        except OSError:
            return False
