"""The recovery paths on their own, without servers: the superblock's checksum and status flags,
the writer lock, the check of a file cut short, and an SWMR reader following the journal.

These are what `make mutation` exercises first; each test pins a behaviour a mutant of
storage/recovery.py or storage/_journal.py would change.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from h5replay.errors import StorageError
from h5replay.sampling import Prioritized
from h5replay.spaces import BoxSpace
from h5replay.storage import ReplayBuffer
from h5replay.storage._h5file import _hdf5_library, missing_bytes, recover
from h5replay.storage.recovery import (
    WriterLock,
    clear_status_flags,
    lock_holder,
    lookup3,
    restore_status_flags,
    status_flags,
    superblock_end,
)

SPACE = BoxSpace(-1, 1, (64,))
SWMR_WRITER = 0x05  # superblock status flags of a file open for (SWMR) writing


# ------------------------------------------------------------------------------ lookup3


def test_lookup3_gives_the_published_values() -> None:
    """Bob Jenkins' own test values for hashlittle (lookup3.c, driver5)."""
    assert lookup3(b"") == 0xDEADBEEF
    assert lookup3(b"", 0xDEADBEEF) == 0xBD5B7DDE
    assert lookup3(b"Four score and seven years ago") == 0x17770551
    assert lookup3(b"Four score and seven years ago", 1) == 0xCD628161


def test_lookup3_agrees_with_hdf5s_own_for_every_length() -> None:
    lib = _hdf5_library()
    reference = getattr(lib, "H5_checksum_lookup3", None)
    if reference is None:
        pytest.skip("this HDF5 library does not export H5_checksum_lookup3")
    reference.restype, reference.argtypes = ctypes.c_uint32, [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint32]
    data = bytes(np.random.default_rng(3).integers(0, 256, 80, dtype=np.uint8))
    for n in range(len(data) + 1):
        for initval in (0, 1, 0xDEADBEEF, 0xFFFFFFFF):
            assert lookup3(data[:n], initval) == reference(data[:n], n, initval), (n, initval)


# ------------------------------------------------------------------------------ status flags

_KILLED_WRITER = "import os, sys, h5py; f = h5py.File(sys.argv[1], 'r+', libver='latest'); f.swmr_mode = True; os._exit(0)"


def _killed_writer_file(path: Path, **create: object) -> Path:
    """A file whose SWMR writer died without closing it: its status flags stay set."""
    with h5py.File(path, "w", libver="latest", **create) as f:  # type: ignore[arg-type]
        f.create_dataset("x", data=np.arange(10))
    subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(path)], check=True, timeout=60)
    return path


@pytest.mark.parametrize("userblock", [0, 512, 4096])
def test_the_flags_of_a_killed_writer_are_cleared_and_restored(tmp_path: Path, userblock: int) -> None:
    path = _killed_writer_file(tmp_path / "killed.h5", **({"userblock_size": userblock} if userblock else {}))
    assert status_flags(path) == SWMR_WRITER
    with pytest.raises(OSError):
        h5py.File(path, "r", locking=False).close()  # HDF5 refuses it while they are set
    size = os.path.getsize(path)
    lock = WriterLock(path).acquire()
    try:  # recovery clears the flags and leaves the length alone: a user block is no missing part
        assert recover(str(path), lock) == (SWMR_WRITER, None) and os.path.getsize(path) == size
    finally:
        lock.release()
    restore_status_flags(path, SWMR_WRITER)
    assert clear_status_flags(path) == SWMR_WRITER
    assert status_flags(path) == 0 and clear_status_flags(path) == 0
    with h5py.File(path, "r", locking=False) as f:  # the rewritten superblock's checksum is right
        assert f["x"][...].tolist() == list(range(10))
    end, size = superblock_end(path)
    assert end == size == os.path.getsize(path)
    restore_status_flags(path, SWMR_WRITER)
    assert status_flags(path) == SWMR_WRITER
    restore_status_flags(path, 0)  # nothing to put back: nothing written
    assert status_flags(path) == SWMR_WRITER


def test_a_damaged_superblock_is_not_rewritten(tmp_path: Path) -> None:
    path = _killed_writer_file(tmp_path / "killed.h5")
    with open(path, "r+b") as fh:
        fh.seek(12)  # the base address, covered by the checksum
        fh.write(b"\x01")
    before = path.read_bytes()
    with pytest.raises(StorageError, match="damaged superblock"):
        clear_status_flags(path)
    assert path.read_bytes() == before


def test_files_without_flags_or_not_hdf5(tmp_path: Path) -> None:
    old = tmp_path / "v0.h5"
    with h5py.File(old, "w", libver="earliest") as f:  # a version 0 superblock: no flags, no checked end
        f["x"] = 1
    assert status_flags(old) == 0 and clear_status_flags(old) == 0
    assert superblock_end(old) == (-1, os.path.getsize(old))
    text = tmp_path / "text.h5"
    text.write_bytes(b"not an HDF5 file" * 100)
    with pytest.raises(StorageError, match="not an HDF5 file"):
        status_flags(text)


# ------------------------------------------------------------------------------ the writer lock


def test_the_writer_lock_follows_the_file(tmp_path: Path) -> None:
    path = tmp_path / "a.h5"
    path.write_bytes(b"x")
    lock = WriterLock(path).acquire()
    assert lock.held and lock.same_file(path) and lock.same_file(tmp_path / "." / "a.h5")
    with pytest.raises(StorageError, match=f"pid {os.getpid()}"):
        WriterLock(path).acquire()
    fd = os.open(path, os.O_RDONLY)
    try:
        assert lock_holder(fd) == str(os.getpid())
    finally:
        os.close(fd)
    other = tmp_path / "b.h5"
    other.write_bytes(b"y")
    os.replace(other, path)  # another file now has the name
    assert not lock.same_file(path) and not lock.same_file(tmp_path / "missing.h5")
    lock.release()
    lock.release()
    assert not lock.held and not lock.same_file(path)
    WriterLock(path).acquire().release()  # free again
    with pytest.raises(FileNotFoundError):
        WriterLock(tmp_path / "missing.h5").acquire()


# ------------------------------------------------------------------------------ a file cut short


def _committed(path: Path, episodes: int, staged: int = 0) -> ReplayBuffer:
    rb = ReplayBuffer.create(SPACE, 5000, path, multiprocessing=True, chunks=True, segment_buffer_bytes=4096)
    for e in range(episodes):
        writer = rb.open_segment_writer()
        writer.extend(np.full((50, 64), e / 100, np.float32))
        rb.commit_segment(writer)
    if staged:
        rb.open_segment_writer().extend(np.full((staged, 64), 0.5, np.float32))  # spilled, never committed
        rb.flush()
    return rb


def test_a_file_cut_short_in_its_published_rows_is_refused_as_found(tmp_path: Path) -> None:
    path = tmp_path / "cut.h5"
    _committed(path, 40).close()
    length = os.path.getsize(path) - 65536
    os.truncate(path, length)
    with pytest.raises(StorageError, match="65536 bytes shorter .* rows it published lie in the missing part"):
        ReplayBuffer.load_from(path, read_only=False)
    assert os.path.getsize(path) == length and missing_bytes(str(path), length) == 65536


def test_a_file_cut_short_only_in_unpublished_rows_reopens_at_its_last_publish(tmp_path: Path) -> None:
    path = tmp_path / "staged.h5"
    _committed(path, 10, staged=500).close()
    os.truncate(path, os.path.getsize(path) - 4096)  # the last staging block, never published
    with ReplayBuffer.load_from(path, read_only=False) as rb:
        assert rb.num_episodes == 10 and len(rb) == 500
        expected = np.repeat(np.arange(10, dtype=np.float32) / np.float32(100), 50)
        np.testing.assert_array_equal(rb.get_at(slice(None)), np.repeat(expected[:, None], 64, axis=1))


# ------------------------------------------------------------------------------ a reader following


@pytest.mark.parametrize("capacity", [16, None])
def test_a_reader_follows_the_writer_reading_only_what_changed(tmp_path: Path, capacity: int | None) -> None:
    path = tmp_path / "rb.h5"
    writer = ReplayBuffer.create(BoxSpace(-1, 1, (3,)), capacity, path, multiprocessing=True,
                                 sampler=Prioritized(1.0, 1.0))
    with ReplayBuffer.load_from(path, read_only=True, multiprocessing=True) as reader:
        assert len(reader) == 0
        for step in range(8):  # 3 episodes a step: the ring wraps, then a clear, then more
            for n in (2, 3, 1):
                w = writer.open_segment_writer()
                w.extend(np.full((n, 3), step / 10, np.float32), priorities=np.full(n, 1.0 + step))
                writer.commit_segment(w)
            writer.update_priorities(np.array([writer.view.end - 1]), np.array([9.0]))
            if step == 5:
                writer.clear()
            writer.flush()
            assert reader.episodes() == writer.episodes()
            assert len(reader) == len(writer) and reader.view == writer.published
            held = np.arange(writer.view.begin, writer.view.end)
            assert reader.priorities(held).tolist() == writer.priorities(held).tolist()
            assert reader._sampling.tree.total == pytest.approx(writer._sampling.tree.total)
    writer.close()
