"""Ids that never move, and the local defects of issue 8 (one regression test each).

Each test names the case it pins; each failed on the code before the identity work.
"""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

from h5replay.errors import ConfigError, EvictedError, StorageError
from h5replay.records import NO_EPISODE, Episode, Receipt
from h5replay.storage import BoxSpace, DictSpace, HDF5Storage, ReplayBuffer, SampleInfo
from h5replay.storage._h5file import h5_errors
from h5replay.storage.fastread import MappedRows
from h5replay.storage.segment import SegmentWriter

SCALAR = BoxSpace(0, 10**9, (), np.int64)
PAIR = DictSpace({"a": BoxSpace(0, 10**9, (), np.int64), "b": BoxSpace(-1, 1, (3,), np.float32)})


def commit(rb: ReplayBuffer, values: range | list[int]) -> Receipt:
    w = rb.open_segment_writer()
    w.extend(np.array(list(values), np.int64))
    return rb.commit_segment(w)


# ------------------------------------------------------------------------------------------ ids


def test_ids_survive_wrap_around_clear_and_restarts(tmp_path):
    path = tmp_path / "rb.h5"
    rb = ReplayBuffer.create(SCALAR, 10, path)
    assert commit(rb, range(4)) == Receipt(0, 0, 4)
    assert commit(rb, range(4, 10)) == Receipt(1, 4, 6)
    assert commit(rb, range(10, 13)) == Receipt(2, 10, 3)  # overwrites rows 0..2: episode 0 leaves
    assert rb.episodes() == [Episode(1, 4, 6), Episode(2, 10, 3)]
    np.testing.assert_array_equal(rb.get_rows([12, 4, 9]), [12, 4, 9])
    with pytest.raises(EvictedError, match="row id 2 is no longer held"):
        rb.get_rows([5, 2, 1])
    with pytest.raises(IndexError, match="row id 13 was never committed"):
        rb.get_rows([13])
    rb.clear()  # ids go on: nothing held, nothing reused
    assert len(rb) == 0 and rb.episodes() == [] and rb.view.generation == 1
    with pytest.raises(EvictedError):
        rb.get_rows([12])
    assert commit(rb, [100, 101]) == Receipt(3, 13, 2)
    rb.close()
    again = ReplayBuffer.load_from(path, read_only=False)
    assert again.episodes() == [Episode(3, 13, 2)] and again.view.generation == 1
    assert commit(again, [102]) == Receipt(4, 15, 1)
    np.testing.assert_array_equal(again.get_rows([15, 13]), [102, 100])
    replay_id = again.replay_id
    again.close()
    assert len(replay_id) == 32 and ReplayBuffer.load_from(path).replay_id == replay_id


def test_unbounded_buffer_keeps_ids_across_clear(tmp_path):
    rb = ReplayBuffer.create(SCALAR, None, tmp_path / "rb.h5")
    commit(rb, range(5))
    rb.clear()
    assert len(rb.storage) == 0  # the space is given back
    assert commit(rb, [7, 8, 9]) == Receipt(1, 5, 3)
    np.testing.assert_array_equal(rb.get_at(slice(None)), [7, 8, 9])
    np.testing.assert_array_equal(rb.get_rows([7, 5]), [9, 7])
    batch, info = rb.sample(20, np.random.default_rng(0), with_info=True)
    np.testing.assert_array_equal(batch, info.row_ids.astype(np.int64) + 2)
    assert set(info.episode_ids.tolist()) == {1}
    rb.close()


def test_sample_info_says_what_was_drawn(tmp_path):
    rb = ReplayBuffer.create(SCALAR, None, tmp_path / "rb.h5")
    commit(rb, range(3))
    rb.extend(np.array([50, 51]))  # the open episode: rows without an episode yet
    batch, info = rb.sample(200, np.random.default_rng(1), with_info=True)
    assert isinstance(info, SampleInfo) and len(info) == 200
    assert info.row_ids.dtype == np.uint64 and info.episode_ids.dtype == np.uint64
    np.testing.assert_array_equal(np.where(info.row_ids < 3, info.row_ids, info.row_ids + 47), batch)
    np.testing.assert_array_equal(info.episode_ids, np.where(info.row_ids < 3, 0, NO_EPISODE))
    np.testing.assert_allclose(info.probabilities, 1 / 5)
    np.testing.assert_allclose(info.importance_weights(0.4), 1.0)
    windows, winfo = rb.sample_sequences(10, 2, np.random.default_rng(2), with_info=True)
    np.testing.assert_array_equal(windows[:, 0], winfo.row_ids.astype(np.int64))
    np.testing.assert_allclose(winfo.probabilities, 1 / 2)  # two windows of 2 in the one episode of 3
    rb.close()


def test_an_empty_commit_gives_no_ids(tmp_path):
    rb = ReplayBuffer.create(SCALAR, 10, tmp_path / "rb.h5")
    commit(rb, [1])
    assert commit(rb, []) == Receipt(-1, -1, 0)
    assert commit(rb, [2]) == Receipt(1, 1, 1)  # the empty one took no id
    rb.close()


def test_export_keeps_ids(tmp_path):
    from h5replay.storage import export_file

    rb = ReplayBuffer.create(SCALAR, 10, tmp_path / "a.h5")
    for e in range(5):
        commit(rb, range(10 * e, 10 * e + 3))  # 15 rows through a ring of 10
    episodes, rows = rb.episodes(), rb.get_at(slice(None))
    rb.close()
    export_file(tmp_path / "a.h5", tmp_path / "b.h5", capacity=None)
    copy = ReplayBuffer.load_from(tmp_path / "b.h5")
    assert copy.episodes() == episodes
    np.testing.assert_array_equal(copy.get_at(slice(None)), rows)
    np.testing.assert_array_equal(copy.get_rows([e.first_row_id for e in episodes]), [10, 20, 30, 40][-len(episodes):])
    with ReplayBuffer.load_from(tmp_path / "a.h5") as source:
        assert copy.replay_id == source.replay_id  # the same replay: clients of the source go on with it
        export_file(tmp_path / "a.h5", tmp_path / "c.h5", new_replay=True)
        with ReplayBuffer.load_from(tmp_path / "c.h5") as other:
            assert other.replay_id != source.replay_id and other.episodes() == episodes
    copy.close()


# --------------------------------------------------------------------------- numbered defects


def test_case5_a_failed_commit_after_an_eviction_leaves_the_episode_table_exact(tmp_path, monkeypatch):
    """Case 5: the eviction published before the failed row write; the rollback used to restore a
    stale episode range, and the next publish wrote a range wider than the table."""
    path = tmp_path / "rb.h5"
    rb = ReplayBuffer.create(SCALAR, 64, path)
    for e in range(64):
        commit(rb, [e])  # full, one row an episode: the next commit evicts first
    before = rb.get_segments()
    writer = rb.open_segment_writer()
    writer.extend(np.arange(1000, 1004))

    def refuse(self: SegmentWriter, start: int) -> None:
        raise StorageError("injected: the disk refused the rows")

    monkeypatch.setattr(SegmentWriter, "commit", refuse)
    with pytest.raises(StorageError, match="injected"):
        rb.commit_segment(writer)
    monkeypatch.undo()
    begin = rb.view.begin  # the eviction (and one row ahead) was published
    assert begin == 5 and rb.published.begin == 5
    assert rb.get_segments() == [(s - begin, n) for s, n in before if s >= begin]
    for e in range(10):
        commit(rb, [2000 + e])
    expected_segments, expected_rows = rb.get_segments(), rb.get_at(slice(None))
    total = rb.info()["total_episodes"]
    rb.close()
    again = ReplayBuffer.load_from(path)
    assert again.get_segments() == expected_segments
    starts = [s for s, _ in again.get_segments()]
    assert starts == sorted(set(starts)), "an episode shows twice or out of order"
    np.testing.assert_array_equal(again.get_at(slice(None)), expected_rows)
    assert again.info()["total_episodes"] == total == 74
    again.close()


def test_case7_the_creating_process_reads_through_the_memory_map(tmp_path):
    """Case 7: a created file used to keep its temporary name, so the fast read path was off."""
    path = tmp_path / "rb.h5"
    rb = ReplayBuffer.create(PAIR, 100, path)
    rb.extend({"a": np.arange(50), "b": np.zeros((50, 3), np.float32)})
    rb.flush()
    assert os.path.samefile(rb.storage.file.filename, path)
    assert MappedRows.open(rb.storage.dataset("a")) is not None
    np.testing.assert_array_equal(rb.get_at(np.array([3, 1, 4]))["a"], [3, 1, 4])
    rb.close()


def test_case8_uint64_indices_never_wrap(tmp_path):
    storage = HDF5Storage.create(SCALAR, 5, tmp_path / "s.h5")
    storage.set(slice(None), np.arange(5))
    with pytest.raises(IndexError, match=str(2**64 - 1)):
        storage.get(np.array([2**64 - 1], np.uint64))
    with pytest.raises(IndexError):
        storage.get(np.array([0, 2**63], np.uint64))
    np.testing.assert_array_equal(storage.get(np.array([4, 0], np.uint64)), [4, 0])
    storage.close()


def test_case8_writes_through_a_column_view_are_seen_by_the_parent(tmp_path):
    """Case 8: the parent read through its memory map and missed what the view had not flushed."""
    HDF5Storage.create(PAIR, 10, tmp_path / "s.h5", chunks=True).close()  # writes wait in the chunk cache
    storage = HDF5Storage.load_from(tmp_path / "s.h5", None, read_only=False)
    storage.set(slice(None), {"a": np.arange(10), "b": np.zeros((10, 3), np.float32)})
    storage.flush()
    np.testing.assert_array_equal(storage.get(np.array([2, 3]))["a"], [2, 3])  # mapped, flushed
    column = storage.get_column("a")
    column.set(np.array([2, 3]), np.array([20, 30]))
    np.testing.assert_array_equal(storage.get(np.array([2, 3]))["a"], [20, 30])
    storage.flush()
    np.testing.assert_array_equal(storage.get(np.array([3, 2]))["a"], [30, 20])
    storage.close()


def test_case8_our_own_key_and_runtime_errors_are_not_storage_errors():
    """Case 8: h5_errors used to turn any KeyError or RuntimeError (a bug) into a StorageError,
    which put the server into read-only mode."""
    with pytest.raises(KeyError, match="mine"), h5_errors("doing something"):
        {}["mine"]
    with pytest.raises(RuntimeError, match="a bug"), h5_errors("doing something"):
        raise RuntimeError("a bug")


def test_case8_hdf5_failures_still_are_storage_errors(tmp_path):
    with h5py.File(tmp_path / "f.h5", "w") as f:
        ds = f.create_dataset("x", (4,), dtype=np.int64)
    with pytest.raises(StorageError, match="HDF5 failed while reading"), h5_errors("reading"):
        _ = ds.shape  # a closed file: h5py raises on our behalf
    (tmp_path / "junk.h5").write_bytes(b"not an HDF5 file" * 100)
    with pytest.raises(StorageError, match="HDF5 failed while opening"), h5_errors("opening"):
        h5py.File(tmp_path / "junk.h5", "r")


def test_case8_close_reports_a_failed_final_flush(tmp_path, monkeypatch):
    storage = HDF5Storage.create(SCALAR, 5, tmp_path / "s.h5")
    storage.set(0, 1)

    def refuse(self: h5py.File) -> None:
        raise OSError("injected: no space left on device")

    monkeypatch.setattr(h5py.File, "flush", refuse)
    with pytest.raises(StorageError, match="no space left"):
        storage.close()
    monkeypatch.undo()
    storage.close()  # closed anyway: a second close is a no-op
    HDF5Storage.load_from(tmp_path / "s.h5", None, read_only=False).close()  # and its writer lock released


def test_case8_fsync_makes_rows_durable_before_the_state_names_them(tmp_path, monkeypatch):
    """Case 8: --fsync used to fsync once, after the state row was written: a power loss could
    leave a state pointing at rows that never reached the disk."""
    from h5replay.storage.replay import journal as _journal

    rb = ReplayBuffer.create(SCALAR, 100, tmp_path / "rb.h5")
    rb.extend(np.arange(10))
    events: list[str] = []
    real_fsync, real_write = os.fsync, _journal.write_rows
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])

    def write(ds, start, value, num_rows=None):  # noqa: ANN001, ANN202
        events.append("state" if ds.name.endswith("journal") else "rows")
        return real_write(ds, start, value, num_rows)

    monkeypatch.setattr(_journal, "write_rows", write)
    rb.flush(fsync=True)
    assert events == ["fsync", "state", "fsync"]
    monkeypatch.undo()
    rb.close()


@pytest.mark.parametrize("how", ["create", "reopen"])
def test_case9_a_compressed_ring_is_not_written_in_swmr_mode(tmp_path, how):
    """Case 9: HDF5 never reuses file space under SWMR, so each rewrite of a compressed chunk of a
    ring took new space: the file grew without bound."""
    path = tmp_path / "rb.h5"
    if how == "create":
        with pytest.raises(ConfigError, match="compressed .* fixed capacity.*without bound"):
            ReplayBuffer.create(SCALAR, 100, path, multiprocessing=True, compression="gzip")
        assert not os.path.exists(path)
        return
    ReplayBuffer.create(SCALAR, 100, path, compression="gzip").close()
    with pytest.raises(ConfigError, match="h5replay compact"):
        ReplayBuffer.load_from(path, read_only=False, multiprocessing=True)
    ReplayBuffer.load_from(path, read_only=False).close()  # without SWMR it is fine
    ReplayBuffer.create(SCALAR, None, tmp_path / "u.h5", multiprocessing=True, compression="gzip").close()


def test_case8_figures_can_be_taken_while_sessions_come_and_go(tmp_path):
    """Case 8: a metrics scrape iterated the loop's sessions while the loop changed them and failed
    with "dictionary changed size during iteration". The scrape now asks the loop for the figures;
    and the figures themselves no longer walk the sessions."""
    import sys
    import threading

    from h5replay import protocol as P
    from h5replay.server.handlers import Service

    rb = ReplayBuffer.create(SCALAR, 100, tmp_path / "rb.h5")
    service = Service(rb, P.Limits(max_clients=10_000), "tcp://127.0.0.1:1")
    for i in range(2000):
        service.session(b"c%d" % i)
    failures: list[str] = []
    stop = threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            try:
                service.snapshot()
            except RuntimeError as exc:
                failures.append(str(exc))
                return

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=scrape)
    thread.start()
    try:
        for i in range(2000, 12000):
            service.session(b"c%d" % i)
            service.drop_session(b"c%d" % (i - 2000))
    finally:
        stop.set()
        thread.join(10)
        sys.setswitchinterval(interval)
        rb.close()
    assert failures == []


def test_windows_longer_than_the_buffer_are_refused_before_any_arithmetic(tmp_path):
    """A window of 2**64 - 1 rows (a fuzzed request) once overflowed numpy inside the server."""
    from h5replay.errors import NotEnoughDataError

    rb = ReplayBuffer.create(SCALAR, 10, tmp_path / "rb.h5")
    commit(rb, range(5))
    for steps in (6, 2**63, 2**64 - 1):
        with pytest.raises(NotEnoughDataError, match="no window"):
            rb.sample_sequences(1, steps)
    rb.close()


def test_serve_sets_the_key_window_of_a_new_file_and_an_existing_file_keeps_its_own(tmp_path):
    """`serve --idempotency-window N` (ServerConfig.idempotency_window): the window of a new file;
    an existing file with another one is refused, as another capacity is; None serves it as is."""
    from h5replay.config import ServerConfig
    from h5replay.server.writer import open_buffer

    path = str(tmp_path / "w.h5")
    space = BoxSpace(0, 1, (), np.float32)
    rb = open_buffer(ServerConfig(path=path, space=space, capacity=10, idempotency_window=8))
    assert rb.idempotency_window == 8
    rb.close()
    for window in (None, 8):
        rb = open_buffer(ServerConfig(path=path, idempotency_window=window))
        assert rb.idempotency_window == 8
        rb.close()
    with pytest.raises(ConfigError, match="idempotency window of 8 episodes, not the 9"):
        open_buffer(ServerConfig(path=path, idempotency_window=9))
    for bad in (0, -1, 2.5, "8"):
        with pytest.raises(ConfigError, match="idempotency_window must be an int >= 1"):
            ServerConfig(path=path, idempotency_window=bad)
