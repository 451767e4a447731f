"""ReplayBuffer: ring semantics, episodes, sampling, persistence in the file."""

from __future__ import annotations

import numpy as np
import pytest

from h5replay.errors import ConfigError, NotEnoughDataError, ReadOnlyError, SegmentStateError
from h5replay.storage import BoxSpace, DictSpace, ReplayBuffer, TextSpace

SCALAR = BoxSpace(0, 1e9, (), np.int64)


def commit(rb: ReplayBuffer, values) -> object:
    w = rb.open_segment_writer()
    w.extend(np.asarray(values, dtype=np.int64))
    return rb.commit_segment(w)


@pytest.mark.parametrize("capacity", [10, 50])
@pytest.mark.parametrize("seed", [0, 1024, 2048])
def test_reference_scenario(tmp_path, capacity, seed):
    """The upstream test, rewritten: fills, wrap, clear, read back, dump and reload."""
    space = BoxSpace(0, 100, (3, 5, 2), np.float32)
    rng = np.random.default_rng(seed)
    rb = ReplayBuffer.create(space, capacity, tmp_path / "rb.h5")
    rows = [space.sample(rng) for _ in range(capacity + 3)]
    for row in rows[: capacity - 1]:
        rb.append(row)
    rb.append(rows[capacity - 1])
    assert len(rb) == capacity
    for k in range(1, capacity + 1):
        np.testing.assert_array_equal(rb.get_at(-k), rows[capacity - k])
        np.testing.assert_array_equal(rb.get_at(len(rb) - k), rows[capacity - k])
    rb.clear()
    assert len(rb) == 0
    rb.extend(np.stack(rows[: capacity - 2]))
    rb.extend(np.stack(rows[capacity - 2 : capacity + 3]))
    assert len(rb) == capacity
    expected = np.stack(rows[3 : capacity + 3])
    np.testing.assert_array_equal(rb.get_at(slice(None)), expected)
    for k in range(1, 4):
        np.testing.assert_array_equal(rb.get_at(slice(-k, None)), expected[-k:])
    rb.close()
    again = ReplayBuffer.load_from(tmp_path / "rb.h5")
    assert len(again) == capacity and again.capacity == capacity and again.space == space
    np.testing.assert_array_equal(again.get_at(slice(None)), expected)
    again.close()


def test_commit_order_decides_placement_and_segments(tmp_path):
    rb = ReplayBuffer.create(SCALAR, 10, tmp_path / "rb.h5")
    w1, w2 = rb.open_segment_writer(), rb.open_segment_writer()
    w1.extend(np.array([1, 1, 1]))
    w2.extend(np.array([2, 2]))
    info2 = rb.commit_segment(w2)
    info1 = rb.commit_segment(w1)
    assert (info2.first_row_id, info2.length, info1.first_row_id, info1.length) == (0, 2, 2, 3)
    assert (info2.episode_id, info1.episode_id) == (0, 1)
    assert rb.get_segments() == [(0, 2), (2, 3)]
    np.testing.assert_array_equal(rb.get_at(slice(None)), [2, 2, 1, 1, 1])
    rb.close()


def test_overwritten_episodes_leave_segments(tmp_path):
    rb = ReplayBuffer.create(SCALAR, 10, tmp_path / "rb.h5")
    commit(rb, range(0, 4))  # episode A: 4 rows
    commit(rb, range(10, 15))  # episode B: 5 rows
    commit(rb, range(20, 23))  # episode C: 3 rows -> overwrites 2 rows of A
    assert len(rb) == 10
    assert rb.get_segments() == [(2, 5), (7, 3)]  # A lost 2 rows, so it left
    np.testing.assert_array_equal(rb.get_at(slice(None)), [2, 3, 10, 11, 12, 13, 14, 20, 21, 22])
    rb.close()
    again = ReplayBuffer.load_from(tmp_path / "rb.h5")
    assert again.get_segments() == [(2, 5), (7, 3)]
    np.testing.assert_array_equal(again.get_at(slice(None)), [2, 3, 10, 11, 12, 13, 14, 20, 21, 22])
    again.close()


def test_sample_sequences_stay_inside_episodes(tmp_path):
    rb = ReplayBuffer.create(SCALAR, 100, tmp_path / "rb.h5")
    for e in range(8):
        commit(rb, [1000 * e + s for s in range(3 + 2 * e)])
    rng = np.random.default_rng(0)
    seqs = rb.sample_sequences(200, 5, rng)
    assert seqs.shape == (200, 5)
    assert np.all(np.diff(seqs, axis=1) == 1)  # consecutive steps of one episode
    assert np.all(seqs // 1000 >= 1)  # episode 0 (3 steps) is too short
    assert rb.sample_sequences(4, 17, rng).tolist() == [[7000 + s for s in range(17)]] * 4
    with pytest.raises(NotEnoughDataError, match="18"):
        rb.sample_sequences(1, 18, rng)
    batch = rb.sample(64, rng)
    assert batch.shape == (64,) and set(batch % 1000) <= set(range(17))
    rb.close()


def test_sampling_an_empty_buffer_is_a_clear_error(tmp_path):
    rb = ReplayBuffer.create(SCALAR, 10, tmp_path / "rb.h5")
    with pytest.raises(NotEnoughDataError):
        rb.sample(4)
    with pytest.raises(ConfigError):
        rb.sample(0)
    rb.close()


def test_segment_longer_than_capacity_is_refused_and_aborted(tmp_path):
    rb = ReplayBuffer.create(SCALAR, 5, tmp_path / "rb.h5")
    w = rb.open_segment_writer()
    w.extend(np.arange(6))
    with pytest.raises(SegmentStateError, match="capacity 5"):
        rb.commit_segment(w)
    assert w.state == "aborted" and len(rb) == 0
    rb.close()


def test_commit_episodes_refuses_bad_keys_and_lengths_and_leaves_the_writer_and_buffer_as_they_were(tmp_path):
    rb = ReplayBuffer.create(SCALAR, 20, tmp_path / "rb.h5")
    first = commit(rb, [1, 2])
    w = rb.open_segment_writer()
    w.extend(np.arange(10, 16))
    key = bytes(16)
    other = ReplayBuffer.create(SCALAR, 20, tmp_path / "other.h5")
    refusals = [
        (ConfigError, "same idempotency key", lambda: rb.commit_episodes(w, [3, 3], [key, key])),
        (ConfigError, "16 bytes", lambda: rb.commit_episodes(w, [3, 3], [b"short", None])),
        (SegmentStateError, "2 idempotency keys for 3", lambda: rb.commit_episodes(w, [2, 2, 2], [key, None])),
        (SegmentStateError, "add up", lambda: rb.commit_episodes(w, [3, 2])),
        (SegmentStateError, "must each be >= 1", lambda: rb.commit_episodes(w, [])),
        (SegmentStateError, "another storage", lambda: other.commit_episodes(w, [6])),
    ]
    for error, words, call in refusals:
        with pytest.raises(error, match=words):
            call()
        assert w.state == "open" and len(w) == 6 and len(rb) == 2 and rb.num_episodes == 1
    with_key = rb.open_segment_writer()
    with_key.extend(np.arange(3))
    keyed = rb.commit_segment(with_key, idempotency_key=key)
    with pytest.raises(SegmentStateError, match="already an episode's"):
        rb.commit_episodes(w, [3, 3], [key, None])  # a key an episode already has
    assert w.state == "open"
    receipts = rb.commit_episodes(w, [4, 2], [None, bytes([1] * 16)])
    assert [(r.first_row_id, r.length) for r in receipts] == [(5, 4), (9, 2)]
    assert rb.receipt_for(bytes([1] * 16)) == receipts[1] and rb.receipt_for(key) == keyed
    assert first.episode_id == 0 and rb.get_at(slice(None)).tolist() == [1, 2, 0, 1, 2, 10, 11, 12, 13, 14, 15]
    other.close()
    rb.close()


def test_read_only_buffer_refuses_writes(tmp_path):
    rb = ReplayBuffer.create(DictSpace({"t": TextSpace(4)}), 5, tmp_path / "rb.h5")
    rb.append({"t": "abc"})
    rb.end_episode()
    rb.close()
    ro = ReplayBuffer.load_from(tmp_path / "rb.h5")
    assert ro.get_at(0) == {"t": "abc"}
    assert ro.get_segments() == [(0, 1)]
    with pytest.raises(ReadOnlyError):
        ro.append({"t": "x"})
    ro.close()


def test_appended_rows_form_an_episode_when_ended(tmp_path):
    rb = ReplayBuffer.create(SCALAR, 10, tmp_path / "rb.h5")
    rb.extend(np.array([1, 2, 3]))
    assert rb.get_segments() == []
    rb.end_episode()
    assert rb.get_segments() == [(0, 3)]
    rb.append(np.int64(4))
    commit(rb, [5, 6])  # ends the open episode first
    assert rb.get_segments() == [(0, 3), (3, 1), (4, 2)]
    rb.close()


def test_unbounded_buffer(tmp_path):
    rb = ReplayBuffer.create(SCALAR, None, tmp_path / "rb.h5")
    commit(rb, range(7))
    commit(rb, range(100, 103))
    assert len(rb) == 10 and rb.capacity is None
    np.testing.assert_array_equal(rb.get_at([9, 0]), [102, 0])
    rb.close()
    again = ReplayBuffer.load_from(tmp_path / "rb.h5", read_only=False)
    commit(again, [7])
    assert again.get_segments() == [(0, 7), (7, 3), (10, 1)]
    again.close()


@pytest.mark.parametrize("layout", [{}, {"chunks": True}])
def test_rows_written_since_the_last_flush_are_read_through_the_map(tmp_path, layout):
    """A sample right after a write reads the memory map (the written chunks are flushed to the
    file first, data only) and returns the new values, also where a ring slot's old bytes are
    still the ones in the file."""
    space = BoxSpace(-1e9, 1e9, (3,), np.float32)
    with ReplayBuffer.create(space, 8, tmp_path / "ring.h5", **layout) as rb:
        rb.extend(np.zeros((8, 3), np.float32))
        rb.flush()  # the file holds zeros in every slot
        rb.extend(np.arange(15, dtype=np.float32).reshape(5, 3) + 1)  # overwrites 5 slots, unflushed
        io = rb.storage._io
        assert io.dirty
        rows, ids = rb.get_at_with_ids(np.arange(8, dtype=np.int64)[::-1])
        assert not io.dirty, "the read went through the map, after writing the cached chunks out"
        expected = np.concatenate([np.zeros((3, 3), np.float32), np.arange(15, dtype=np.float32).reshape(5, 3) + 1])
        np.testing.assert_array_equal(rows, expected[::-1])
        np.testing.assert_array_equal(ids, np.arange(5, 13)[::-1])
    with ReplayBuffer.load_from(tmp_path / "ring.h5") as again:  # and close() still made it all durable
        np.testing.assert_array_equal(again.get_at(slice(None)), expected)
