"""export / compact: a copy holds the same rows and episodes, with the layout asked for."""

from __future__ import annotations

import numpy as np
import pytest

from h5replay.cli import main
from h5replay.errors import ConfigError
from h5replay.storage import BoxSpace, DictSpace, ReplayBuffer, TextSpace
from h5replay.storage.export import compact_file, export_buffer, export_file

SPACE = DictSpace({"x": BoxSpace(0, 1e9, (), np.int64), "t": TextSpace(4)})


def _buffer(path):
    rb = ReplayBuffer.create(SPACE, 20, path)
    for e in range(6):  # 30 rows into 20: the first episodes are overwritten, one partly
        w = rb.open_segment_writer()
        w.extend({"x": np.arange(5) + 100 * e, "t": ["é" * (e % 4)] * 5})
        rb.commit_segment(w)
    rb.extend({"x": np.array([7, 8]), "t": ["z", "z"]})  # an open episode at the tail
    return rb


def test_export_keeps_rows_episodes_and_the_open_episode(tmp_path):
    rb = _buffer(tmp_path / "a.h5")
    seen = []
    export_buffer(rb, tmp_path / "b.h5", compression="gzip", capacity=40, progress=lambda done, total: seen.append((done, total)))
    copy = ReplayBuffer.load_from(tmp_path / "b.h5", read_only=False)
    assert copy.capacity == 40 and copy.storage.dataset("x").compression == "gzip"
    np.testing.assert_array_equal(copy.get_at(slice(None))["x"], rb.get_at(slice(None))["x"])
    assert list(copy.get_at(slice(None))["t"]) == list(rb.get_at(slice(None))["t"])
    assert copy.get_segments() == rb.get_segments() == [(3, 5), (8, 5), (13, 5)]
    copy.end_episode()  # the open episode came along, still open
    assert copy.get_segments()[-1] == (18, 2)
    assert seen[-1] == (20, 20)
    copy.close()
    with pytest.raises(ConfigError, match="already exists"):
        export_buffer(rb, tmp_path / "b.h5")
    with pytest.raises(ConfigError, match="cannot hold"):
        export_buffer(rb, tmp_path / "c.h5", capacity=10)
    rb.close()


def test_compact_rewrites_in_place_and_keeps_out_other_writers(tmp_path):
    path = tmp_path / "a.h5"
    rb = _buffer(path)
    expected = rb.get_at(slice(None))["x"]
    from h5replay.errors import StorageError

    with pytest.raises(StorageError, match="already open for writing"):
        compact_file(path)  # rb still holds the writer lock
    rb.close()
    compact_file(path, compression="lzf")
    again = ReplayBuffer.load_from(path)
    np.testing.assert_array_equal(again.get_at(slice(None))["x"], expected)
    assert again.storage.dataset("x").compression == "lzf"
    again.close()


def test_cli_export_and_compact(tmp_path, capsys):
    _buffer(tmp_path / "a.h5").close()
    assert main(["export", str(tmp_path / "a.h5"), str(tmp_path / "b.h5"), "--compression", "gzip", "--level", "3"]) == 0
    assert main(["compact", str(tmp_path / "b.h5"), "--capacity", "unbounded"]) == 0
    assert main(["info", str(tmp_path / "b.h5")]) == 0
    out = capsys.readouterr().out
    assert "unbounded" in out and "episodes  3 complete" in out
    assert main(["export", str(tmp_path / "a.h5"), str(tmp_path / "c.h5"), "--level", "3"]) == 2
    assert main(["export", str(tmp_path / "missing.h5"), str(tmp_path / "d.h5")]) == 1
    export_file(tmp_path / "a.h5", tmp_path / "e.h5", chunks=(4,))
    assert ReplayBuffer.load_from(tmp_path / "e.h5").storage.dataset("x").chunks == (4,)


def test_export_copies_values_a_buffer_holds_outside_its_bounds(tmp_path):
    """A file served with --no-check-bounds holds NaN and values past its bounds: an export keeps them."""
    space = BoxSpace(-1.0, 1.0, (2,), np.float32)
    rows = np.array([[np.nan, 5.0], [0.5, -3.0]], np.float32)
    with ReplayBuffer.create(space, 10, tmp_path / "a.h5", check_bounds=False) as buffer:
        buffer.extend(rows)
        buffer.end_episode()
    export_file(tmp_path / "a.h5", tmp_path / "b.h5")
    with ReplayBuffer.load_from(tmp_path / "b.h5") as copy:
        np.testing.assert_array_equal(copy.get_at(np.arange(2)), rows)


def test_export_and_compact_keep_the_idempotency_keys_and_their_window(tmp_path):
    """A commit retried after its file was compacted (or exported) is answered with its original
    receipt, not stored a second time: the copy keeps the keys of the episodes it holds, and the
    key window. Keys of episodes the ring overwrote are not carried over."""
    path = tmp_path / "a.h5"
    rb = ReplayBuffer.create(SPACE, 20, path, idempotency_window=4)
    keys, receipts = [], []
    for e in range(6):  # 30 rows into 20: the first two episodes and their keys go
        w = rb.open_segment_writer()
        w.extend({"x": np.arange(5) + 100 * e, "t": ["k"] * 5})
        keys.append(bytes([e]) * 16)
        receipts.append(rb.commit_segment(w, idempotency_key=keys[-1] if e != 4 else None))  # episode 4: no key
    rb.close()
    export_file(path, tmp_path / "copy.h5")  # from a read-only open
    compact_file(path)  # from the writer
    for target in (path, tmp_path / "copy.h5"):
        again = ReplayBuffer.load_from(target, read_only=False)
        assert [again.receipt_for(k) for k in keys] == [None, None, receipts[2], receipts[3], None, receipts[5]]
        assert again.idempotency_window == 4
        held = again.episodes()
        w = again.open_segment_writer()  # the retry of episode 5's commit
        w.extend({"x": np.arange(5) + 500, "t": ["k"] * 5})
        assert again.commit_segment(w, idempotency_key=keys[5]) == receipts[5]
        assert again.episodes() == held and held[-1].episode_id == 5  # nothing stored twice
        again.close()


def test_a_copy_is_the_same_replay_with_its_counters_and_sample_counts(tmp_path):
    from h5replay.sampling import Uniform

    rb = ReplayBuffer.create(SPACE, 100, tmp_path / "a.h5", sampler=Uniform(), max_times_sampled=1)
    for e in range(4):
        rb.extend({"x": np.arange(10) + 100 * e, "t": ["a"] * 10})
        rb.end_episode()
    rng = np.random.default_rng(0)
    removed = set(rb.sample(15, rng, with_info=True)[1].row_ids.tolist())  # uniform: holes in the middle
    rb.flush()
    source = rb.info()
    export_buffer(rb, tmp_path / "b.h5")
    rb.close()
    with ReplayBuffer.load_from(tmp_path / "b.h5", read_only=False) as copy:
        info = copy.info()
        assert info["replay_id"] == source["replay_id"], "a copy is the same replay"
        assert info["seq"] > source["seq"] and info["generation"] == source["generation"]
        assert info["sampleable"] == source["sampleable"] == 25, "removed rows came back"
        drawn = copy.sample(25, np.random.default_rng(1), with_info=True)[1].row_ids.tolist()
        assert sorted(drawn) == sorted(set(range(40)) - removed)
    export_file(tmp_path / "b.h5", tmp_path / "c.h5", new_replay=True)
    with ReplayBuffer.load_from(tmp_path / "c.h5") as other:
        assert other.replay_id != source["replay_id"] and other.info()["seq"] <= 2  # counted from 0


def test_compact_keeps_the_replay_id_and_publish_count(tmp_path):
    path = tmp_path / "a.h5"
    rb = _buffer(path)
    before = rb.info()
    rb.close()
    compact_file(path)
    with ReplayBuffer.load_from(path) as again:
        assert again.replay_id == before["replay_id"] and again.info()["seq"] > before["seq"]


def test_a_copy_of_a_served_file_keeps_its_chunks_and_stays_servable(tmp_path):
    # A served (SWMR) file has chunked leaves where a plain one would be contiguous; a contiguous
    # copy could not be served again (its SWMR readers fail on it once it grows).
    rb = ReplayBuffer.create(SPACE, 1000, tmp_path / "a.h5", multiprocessing=True)
    rb.extend({"x": np.arange(10), "t": ["a"] * 10})
    rb.end_episode()
    chunks = {path: rb.storage.dataset(path).chunks for path, _ in rb.storage.leaves}
    rb.close()
    compact_file(tmp_path / "a.h5")
    export_file(tmp_path / "a.h5", tmp_path / "b.h5", capacity=500)
    with ReplayBuffer.load_from(tmp_path / "a.h5") as again, ReplayBuffer.load_from(tmp_path / "b.h5") as smaller:
        assert {path: again.storage.dataset(path).chunks for path, _ in again.storage.leaves} == chunks
        assert all(smaller.storage.dataset(path).chunks is not None for path, _ in smaller.storage.leaves)
    plain = _buffer(tmp_path / "p.h5")
    plain.close()
    compact_file(tmp_path / "p.h5")  # a plain file stays plain (contiguous)
    with ReplayBuffer.load_from(tmp_path / "p.h5") as again:
        assert again.storage.dataset("x").chunks is None
