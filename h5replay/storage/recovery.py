"""Writer lock and crash recovery for one HDF5 file.

A writer (server or local) holds an exclusive `flock` on `<file>.lock` for as long as the file is
open for writing. HDF5's own lock cannot serve: an SWMR writer drops it right after opening. So
when we hold our lock, no other writer is alive, and status flags left in the superblock by a
writer that was killed are stale: `clear_status_flags` clears them, as `h5clear -s` would,
without needing the HDF5 command-line tools.

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

__all__ = ["WriterLock", "clear_status_flags", "status_flags", "lookup3"]

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


def clear_status_flags(path: str | os.PathLike[str]) -> bool:
    """Clear the status flags a killed writer left (like `h5clear -s`). True when there were any.

    Also restores the file's length to the end the superblock records, when a write that failed
    (a full disk, a size limit) left the file shorter: HDF5 refuses such a file as truncated. The
    missing bytes were never published, so zeros stand in for them.

    Only call this while holding the file's WriterLock: clearing the flags of a live writer's
    file would let a second writer in.

    Raises:
        StorageError: the superblock's checksum does not match (the file is damaged).
    """
    with open(path, "r+b") as f:
        offset, body, stored = _read_superblock(f)
        if stored < 0 or body[11] == 0:
            return False
        if lookup3(bytes(body)) != stored:
            raise StorageError(f"{os.fspath(path)!r} has a damaged superblock (checksum mismatch); it cannot be recovered here")
        size_of_offsets = body[9]
        base = int.from_bytes(body[12 : 12 + size_of_offsets], "little")
        end_field = 12 + 2 * size_of_offsets
        end_of_file = base + int.from_bytes(body[end_field : end_field + size_of_offsets], "little")
        if os.fstat(f.fileno()).st_size < end_of_file:
            os.ftruncate(f.fileno(), end_of_file)
        body[11] = 0
        f.seek(offset)
        f.write(bytes(body) + lookup3(bytes(body)).to_bytes(4, "little"))
        f.flush()
        os.fsync(f.fileno())
    return True


class WriterLock:
    """An exclusive lock on `<path>.lock`, held while one process writes the file.

    The kernel drops it when the holder dies, so a crashed writer never blocks the next one.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path) + ".lock"
        self._fd: int | None = None

    def acquire(self) -> WriterLock:
        """Take the lock now or raise StorageError naming the holder."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StorageError(
                f"{self.path[:-5]!r} is already open for writing by another process (pid {holder}); "
                "stop it first, or open the file read-only"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock (the file stays, empty of meaning). Safe to call twice."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None
