"""The recovery paths on their own, without servers: the superblock's checksum and status flags,
the writer lock, the check of a file cut short, and an SWMR reader following the journal.

These are what `make mutation` exercises first; each test pins a behaviour a mutant of
storage/recovery.py or storage/replay/journal.py would change.
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


def _committed(path: Path, episodes: int, staged: int = 0, capacity: int | None = 5000) -> ReplayBuffer:
    rb = ReplayBuffer.create(SPACE, capacity, path, multiprocessing=True, chunks=True, segment_buffer_bytes=4096)
    for e in range(episodes):
        writer = rb.open_segment_writer()
        writer.extend(np.full((50, 64), e / 100, np.float32))
        rb.commit_segment(writer)
    if staged:
        rb.open_segment_writer().extend(np.full((staged, 64), 0.5, np.float32))  # spilled, never committed
        rb.flush()
    return rb


@pytest.mark.parametrize("capacity", [5000, 1500, None])  # 2000 rows: 1500 is a ring that wrapped
def test_a_file_cut_short_in_its_published_rows_is_refused_as_found(tmp_path: Path, capacity: int | None) -> None:
    path = tmp_path / "cut.h5"
    _committed(path, 40, capacity=capacity).close()
    length = os.path.getsize(path) - 65536
    os.truncate(path, length)
    with pytest.raises(StorageError, match="65536 bytes shorter .* rows it published lie in the missing part"):
        ReplayBuffer.load_from(path, read_only=False)
    assert os.path.getsize(path) == length and missing_bytes(str(path), length) == 65536


@pytest.mark.parametrize("capacity", [5000, None])
def test_a_file_cut_short_only_in_unpublished_rows_reopens_at_its_last_publish(tmp_path: Path,
                                                                              capacity: int | None) -> None:
    path = tmp_path / "staged.h5"
    _committed(path, 10, staged=500, capacity=capacity).close()
    os.truncate(path, os.path.getsize(path) - 4096)  # the last staging block, never published
    with ReplayBuffer.load_from(path, read_only=False, multiprocessing=True) as rb:
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


# ------------------------------------------------------------------------------ the priority log


@pytest.mark.parametrize(("updates", "per_update"), [(1, 3), (2, 3), (3, 3), (5, 3), (8, 3), (2, 4)])
def test_every_priority_comes_back_from_the_log_ring_after_a_reopen(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, updates: int, per_update: int) -> None:
    """A ring of 8 log entries: updates wrap around it, with checkpoints between; a reopened
    writer and a reader each rebuild exactly the priorities the writer had, 0 included."""
    from h5replay.storage.replay import table_file as _sampling_file

    monkeypatch.setattr(_sampling_file, "LOG_ENTRIES", 8)
    path = tmp_path / "rb.h5"
    rb = ReplayBuffer.create(BoxSpace(-1, 1, (3,)), 16, path, sampler=Prioritized(1.0, 1.0))
    w = rb.open_segment_writer()
    w.extend(np.zeros((12, 3), np.float32), priorities=np.linspace(1.0, 2.1, 12))
    rb.commit_segment(w)
    for k in range(updates):  # 3 log entries a publish: replays cross the ring's end; 2 x 4: the whole ring
        values = np.array([k / 4, k / 4 + 0.1, 0.0, 3.0])[:per_update]
        rb.update_priorities(np.arange(per_update * k, per_update * k + per_update) % 12, values)
        rb.flush()
    expected = rb.priorities(np.arange(12)).tolist()
    published = rb.published
    rb.close()
    assert published.tables[0].plog == per_update * updates
    for how in OPENS:
        with ReplayBuffer.load_from(path, read_only=how != "writer", multiprocessing=how == "swmr_reader") as again:
            assert again.priorities(np.arange(12)).tolist() == expected, how
            assert again._sampling.tree.total == pytest.approx(sum(expected))


OPENS = ("writer", "reader", "swmr_reader")


# ------------------------------------------------------------------------------ keys of a failed publish


def test_a_failed_publish_forgets_the_keys_it_would_have_published(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The key of a commit whose publish failed names an episode that never was: a retry must
    commit it, and the slot's row in the file must not come back after a reopen as the key of
    the episode that takes the slot next."""
    from h5replay.storage.replay.journal import Journal

    path = tmp_path / "rb.h5"
    rb = ReplayBuffer.create(BoxSpace(-1, 1, (3,)), 64, path, idempotency_window=4)
    key = b"k" * 16
    first = rb.open_segment_writer()
    first.extend(np.zeros((2, 3), np.float32))
    rb.commit_segment(first)
    real_publish = Journal.publish

    def fail_after_writing(self: Journal, state: object, fsync: bool = False) -> None:
        self.write_records()  # the episode record and the key row reach the file, the state row not
        raise StorageError("injected: the state row could not be written")

    monkeypatch.setattr(Journal, "publish", fail_after_writing)
    keyed = rb.open_segment_writer()
    keyed.extend(np.zeros((3, 3), np.float32))
    with pytest.raises(StorageError, match="injected"):
        rb.commit_segment(keyed, idempotency_key=key)
    monkeypatch.setattr(Journal, "publish", real_publish)
    assert rb.receipt_for(key) is None
    keyless = rb.open_segment_writer()  # takes the failed episode's id and key slot
    keyless.extend(np.zeros((4, 3), np.float32))
    assert rb.commit_segment(keyless) == (1, 2, 4)
    rb.close()
    with ReplayBuffer.load_from(path, read_only=False) as again:
        assert again.receipt_for(key) is None
        retry = again.open_segment_writer()
        retry.extend(np.zeros((3, 3), np.float32))
        assert again.commit_segment(retry, idempotency_key=key) == (2, 6, 3)


# ------------------------------------------------------------------------------ the episode table


def test_the_episode_table_finds_the_episode_of_every_row_across_the_ring() -> None:
    from h5replay.records import NO_EPISODE
    from h5replay.storage.replay.journal import EpisodeTable

    table = EpisodeTable(4)
    for episode_id, start, length in [(5, 30, 2), (6, 33, 3), (7, 36, 1), (8, 38, 2)]:  # slots 1, 2, 3, 0
        table.put(episode_id, start, length)
    table.set_range(5, 9)
    found = table.find(np.arange(28, 42, dtype=np.uint64))
    expected = [NO_EPISODE] * 2 + [5, 5, NO_EPISODE, 6, 6, 6, 7, NO_EPISODE, 8, 8] + [NO_EPISODE] * 2
    assert found.dtype == np.uint64 and found.tolist() == expected
    assert [a.tolist() for a in table.ordered()] == [[5, 6, 7, 8], [30, 33, 36, 38], [2, 3, 1, 2]]
    table.set_range(6, 8)  # one piece
    assert [a.tolist() for a in table.ordered()] == [[6, 7], [33, 36], [3, 1]]
    table.set_range(8, 8)
    assert [a.tolist() for a in table.ordered()] == [[], [], []]


def test_the_key_table_holds_one_key_a_slot(tmp_path: Path) -> None:
    """Keys of episodes the window has left are dropped from memory too: the writer's key map
    never grows past the window, however many episodes it commits."""
    rb = ReplayBuffer.create(BoxSpace(-1, 1, (3,)), 64, tmp_path / "rb.h5", idempotency_window=4)
    for e in range(20):
        w = rb.open_segment_writer()
        w.extend(np.zeros((1, 3), np.float32))
        rb.commit_segment(w, idempotency_key=bytes([e + 1]) * 16 if e % 5 else None)
        assert len(rb._keys) <= 4
    assert len(rb._keys) == 4 and [rb.receipt_for(bytes([e + 1]) * 16) for e in (14, 15, 16, 19)] == [
        None, None, (16, 16, 1), (19, 19, 1)]
    rb.close()


# ------------------------------------------------------------------------------ a format 1 file


def _format_1_file(path: Path) -> None:
    """A file as h5replay format 1 wrote it: a state row of 8 values (mark, begin, end,
    ep_begin, ep_end, open_start, seq, 0), no replay id, no idempotency key table."""
    rb = ReplayBuffer.create(BoxSpace(-1, 1, (3,)), 16, path)
    for n in (5, 4):
        rb.extend(np.full((n, 3), n / 10, np.float32))
        rb.end_episode()
    rb.extend(np.zeros((2, 3), np.float32))  # an open episode
    rb.close()
    with h5py.File(path, "r+") as f:
        group = f["_h5replay/replay"]
        del group["journal"], group["commit_keys"]
        group.create_dataset("state", data=np.array([0x5245504C, 0, 11, 0, 2, 9, 7, 0], np.int64), maxshape=(8,),
                             chunks=(8,))
        f.attrs["h5replay_format_version"] = 1
        del f.attrs["h5replay_replay_id"]


@pytest.mark.parametrize("how", OPENS)
def test_a_format_1_file_is_read_as_it_is_and_upgraded_by_a_writer(tmp_path: Path, how: str) -> None:
    path = tmp_path / "v1.h5"
    _format_1_file(path)
    with ReplayBuffer.load_from(path, read_only=how != "writer", multiprocessing=how == "swmr_reader") as rb:
        assert rb.get_segments() == [(0, 5), (5, 4)] and len(rb) == 11
        assert (rb.view.seq, rb.view.open_start, rb.view.ep_end) == (7, 9, 2)
        if how == "writer":
            rb.end_episode()
            assert rb.replay_id != "" and rb.get_segments()[-1] == (9, 2)
    with h5py.File(path, "r") as f:
        upgraded = how == "writer"
        assert ("journal" in f["_h5replay/replay"]) == upgraded and ("state" in f["_h5replay/replay"]) != upgraded
        assert int(f.attrs["h5replay_format_version"]) == (2 if upgraded else 1)


def test_a_format_1_file_whose_state_row_is_zero_filled_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "v1.h5"
    _format_1_file(path)
    with h5py.File(path, "r+") as f:
        f["_h5replay/replay/state"][...] = 0
    for how in OPENS:
        with pytest.raises(StorageError, match="damaged replay state row"):
            ReplayBuffer.load_from(path, read_only=how != "writer", multiprocessing=how == "swmr_reader")


# ------------------------------------------------------------------------------ export


def test_export_keeps_settings_rows_outside_episodes_and_survives_leftovers(tmp_path: Path) -> None:
    from h5replay.sampling import Fifo, RateLimit
    from h5replay.storage.export import compact_file, export_file

    path = tmp_path / "rb.h5"
    rb = ReplayBuffer.create(BoxSpace(-1, 1, (3,)), 64, path, sampler=Fifo(), max_times_sampled=2,
                             rate_limit=RateLimit(1, 1.0, 6.0))
    rb.extend(np.full((3, 3), 0.1, np.float32))
    rb.end_episode(record=False)  # rows of no episode
    for n in (2, 2):  # 7 rows inserted, none sampled: as far ahead as the rate limit lets inserts go
        rb.extend(np.full((n, 3), n / 10, np.float32))
        rb.end_episode()
    rb.close()
    (tmp_path / "out.h5.partial").write_bytes(b"left by a crashed export")
    (tmp_path / "rb.h5.compact").write_bytes(b"left by a crashed compact")
    export_file(path, tmp_path / "out.h5")  # copying is no insert: the rate limit lets every row in
    compact_file(path)
    for copy_path in (tmp_path / "out.h5", path):
        with ReplayBuffer.load_from(copy_path) as copy:
            assert copy.sampling.max_times_sampled == 2 and isinstance(copy.sampling.sampler, Fifo)
            assert copy.sampling.rate_limit == RateLimit(1, 1.0, 6.0)
            assert copy.get_segments() == [(3, 2), (5, 2)] and len(copy) == 7
            assert copy.info()["inserted"] == 7
    assert not (tmp_path / "out.h5.partial").exists() and not (tmp_path / "rb.h5.compact").exists()


def test_a_plain_h5py_file_cut_short_in_its_rows_is_refused_as_found(tmp_path: Path) -> None:
    """Without a journal every row counts as published."""
    path = tmp_path / "plain.h5"
    with h5py.File(path, "w", libver="latest") as f:
        f.create_dataset("x", data=np.arange(100_000, dtype=np.float64), chunks=(4096,))
    length = os.path.getsize(path) - 65536
    os.truncate(path, length)
    with pytest.raises(StorageError, match="65536 bytes shorter"):
        ReplayBuffer.load_from(path, read_only=False)
    assert os.path.getsize(path) == length


def test_rows_that_reuse_a_removed_rows_slot_start_unsampled_after_a_reopen(tmp_path: Path) -> None:
    from h5replay.sampling import Fifo

    path = tmp_path / "queue.h5"
    rb = ReplayBuffer.create(BoxSpace(-1, 1, (3,)), 4, path, sampler=Fifo(), max_times_sampled=1)
    rb.extend(np.zeros((4, 3), np.float32))
    rb.end_episode()
    assert rb.sample(4).shape == (4, 3)  # every row taken: sampled once, removed
    rb.extend(np.ones((4, 3), np.float32))  # the same 4 slots, new rows
    rb.end_episode()
    rb.close()
    with ReplayBuffer.load_from(path, read_only=False) as again:
        assert again.info()["sampleable"] == 4
        np.testing.assert_array_equal(again.sample(4), np.ones((4, 3), np.float32))


def test_export_keeps_priorities(tmp_path: Path) -> None:
    from h5replay.storage.export import export_file

    path = tmp_path / "rb.h5"
    rb = ReplayBuffer.create(BoxSpace(-1, 1, (3,)), 16, path, sampler=Prioritized(0.5, 2.0))
    w = rb.open_segment_writer()
    w.extend(np.zeros((6, 3), np.float32), priorities=np.arange(6.0))
    rb.commit_segment(w)
    rb.update_priorities(np.array([1]), np.array([9.0]))
    rb.close()
    export_file(path, tmp_path / "copy.h5")
    with ReplayBuffer.load_from(tmp_path / "copy.h5") as copy:
        assert copy.priorities(np.arange(6)).tolist() == [0.0, 9.0, 2.0, 3.0, 4.0, 5.0]
        assert copy.sampling.sampler == Prioritized(0.5, 2.0)
