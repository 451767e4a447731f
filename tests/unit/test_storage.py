"""HDF5Storage behaviour: file format, index kinds, errors, segment writers, pickling."""

from __future__ import annotations

import json
import pickle

import h5py
import numpy as np
import pytest

from h5replay.errors import (
    ClosedError,
    ConfigError,
    FormatVersionError,
    ReadOnlyError,
    SegmentStateError,
    SpaceMismatchError,
)
from h5replay.storage import BinarySpace, BoxSpace, DictSpace, HDF5Storage, TextSpace

SPACE = DictSpace(
    {
        "obs": {"image": BoxSpace(0, 255, (4, 4, 3), np.uint8), "vec": BoxSpace(-1, 1, (3,))},
        "done": BinarySpace(),
        "note": TextSpace(8),
    }
)


def batch(n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "obs": {
            "image": rng.integers(0, 255, (n, 4, 4, 3), dtype=np.uint8),
            "vec": rng.uniform(-1, 1, (n, 3)).astype(np.float32),
        },
        "done": rng.integers(0, 2, n).astype(bool),
        "note": np.array([f"r{i}é" for i in range(n)], dtype=object),
    }


def assert_batch_equal(a: dict, b: dict) -> None:
    np.testing.assert_array_equal(a["obs"]["image"], b["obs"]["image"])
    np.testing.assert_array_equal(a["obs"]["vec"], b["obs"]["vec"])
    np.testing.assert_array_equal(a["done"], b["done"])
    assert np.asarray(a["note"]).tolist() == np.asarray(b["note"]).tolist()


def take(b: dict, idx) -> dict:
    return {
        "obs": {"image": b["obs"]["image"][idx], "vec": b["obs"]["vec"][idx]},
        "done": b["done"][idx],
        "note": b["note"][idx],
    }


@pytest.fixture
def storage(tmp_path):
    s = HDF5Storage.create(SPACE, 10, tmp_path / "s.h5")
    s.set(slice(None), batch(10))
    yield s
    s.close()


def test_file_records_space_capacity_and_version(tmp_path):
    s = HDF5Storage.create(SPACE, 10, tmp_path / "s.h5")
    s.close()
    with h5py.File(tmp_path / "s.h5", "r") as f:
        assert json.loads(f.attrs["h5replay_space"]) == SPACE.to_json()
        assert f.attrs["h5replay_capacity"] == 10
        assert f.attrs["h5replay_format_version"] == 2
        assert len(f.attrs["h5replay_replay_id"]) == 32
        assert set(f["obs"]) == {"image", "vec"}
        assert f["note"].dtype.kind == "S" and f["note"].dtype.itemsize == 32
        assert h5py.check_string_dtype(f["note"].dtype).encoding == "utf-8"
    length, capacity, space = HDF5Storage.build_space_from_hdf5_file(h5py.File(tmp_path / "s.h5", "r"))
    assert (length, capacity, space) == (10, 10, SPACE)
    reopened = HDF5Storage.load_from(tmp_path / "s.h5", None)
    assert reopened.single_instance_space == SPACE and len(reopened) == 10 and not reopened.is_mutable
    reopened.close()


def test_every_index_kind_returns_rows_in_the_order_asked(storage):
    data = batch(10)
    for idx in ([3, 1, 3, 9, 0], np.array([-1, 2, 2]), np.array([[1, 2], [9, 0]]), slice(1, 9, 3), slice(None, None, -2)):
        got = storage.get(idx)
        ref_idx = np.arange(10)[idx] if isinstance(idx, slice) else np.asarray(idx) % 10
        assert_batch_equal(got, take(data, ref_idx))
    mask = np.zeros(10, bool)
    mask[[2, 5]] = True
    assert_batch_equal(storage.get(mask), take(data, [2, 5]))
    one = storage.get(-3)
    np.testing.assert_array_equal(one["obs"]["image"], data["obs"]["image"][7])
    assert one["note"] == "r7é" and isinstance(one["note"], str)
    assert isinstance(storage.get(np.int64(4))["done"], np.bool_)
    empty = storage.get(np.array([], dtype=np.int64))
    assert empty["obs"]["image"].shape == (0, 4, 4, 3)
    assert_batch_equal(storage.get(...), data)


def test_set_with_duplicates_keeps_the_last_value(storage):
    new = batch(3, seed=5)
    storage.set([4, 4, 6], new)
    got = storage.get([4, 6])
    assert_batch_equal(got, take(new, [1, 2]))


@pytest.mark.parametrize(
    "index, error",
    [(10, IndexError), (-11, IndexError), ([0, 10], IndexError), (np.array([-11]), IndexError),
     (1.5, TypeError), (True, TypeError), (np.array([0.5]), TypeError), (np.ones(3, bool), IndexError)],
)
def test_bad_index_is_refused(storage, index, error):
    with pytest.raises(error):
        storage.get(index)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda b: b.pop("done"), "missing 'done'"),
        (lambda b: b.update(extra=1), "unexpected 'extra'"),
        (lambda b: b["obs"].update(vec=np.zeros((2, 4), np.float32)), "obs/vec"),
        (lambda b: b["obs"].update(image=np.zeros((2, 4, 4, 3), np.float32)), "obs/image"),
        (lambda b: b.update(note=np.array(["x" * 9, "y"], dtype=object)), "note"),
        (lambda b: b.update(done=np.array([2, 0])), "done"),
    ],
)
def test_rejected_write_changes_nothing(storage, mutate, match):
    before = storage.get(slice(None))
    bad = batch(2, seed=9)
    mutate(bad)
    with pytest.raises(SpaceMismatchError, match=match):
        storage.set([0, 1], bad)
    assert_batch_equal(storage.get(slice(None)), before)


def test_read_only_storage_refuses_writes(storage, tmp_path):
    storage.close()
    ro = HDF5Storage.load_from(tmp_path / "s.h5", SPACE)
    with pytest.raises(ReadOnlyError):
        ro.set(0, take(batch(1), 0))
    with pytest.raises(ReadOnlyError):
        ro.open_segment_writer()
    ro.close()
    ro.close()  # safe twice
    with pytest.raises(ClosedError):
        ro.get(0)


def test_create_refuses_existing_file_and_bad_options(tmp_path, storage):
    with pytest.raises(ConfigError, match="already exists"):
        HDF5Storage.create(SPACE, 10, tmp_path / "s.h5")
    with pytest.raises(ConfigError):
        HDF5Storage.create(SPACE, 0, tmp_path / "zero.h5")
    with pytest.raises(ConfigError):
        HDF5Storage.create(SPACE, 10, None)
    with pytest.raises(ConfigError, match="compression_level"):
        HDF5Storage.create(SPACE, 10, tmp_path / "lvl.h5", compression_level=3)
    assert not (tmp_path / "lvl.h5").exists()
    with pytest.raises(ConfigError):
        HDF5Storage.create(DictSpace({}), 10, tmp_path / "empty.h5")


def test_unknown_format_version_is_refused(storage, tmp_path):
    storage.close()
    with h5py.File(tmp_path / "s.h5", "r+") as f:
        f.attrs["h5replay_format_version"] = 99
    with pytest.raises(FormatVersionError, match="99"):
        HDF5Storage.load_from(tmp_path / "s.h5", None)


def test_space_mismatch_on_load(storage, tmp_path):
    storage.close()
    with pytest.raises(SpaceMismatchError):
        HDF5Storage.load_from(tmp_path / "s.h5", DictSpace({"x": BinarySpace()}))
    with pytest.raises(FileNotFoundError):
        HDF5Storage.load_from(tmp_path / "missing.h5", None)


def test_segment_writers_stream_and_publish_only_on_commit(tmp_path):
    s = HDF5Storage.create(SPACE, 50, tmp_path / "s.h5", segment_buffer_bytes=4 * 100)  # spills every ~4 rows
    s.set(slice(None), batch(50, seed=1))
    before = s.get(slice(None))
    a, b = s.open_segment_writer(), s.open_segment_writer()
    data_a, data_b = batch(23, seed=2), batch(7, seed=3)
    for i in range(23):
        a.append(take(data_a, i))
    b.extend(data_b)
    assert len(a) == 23 and len(b) == 7
    assert_batch_equal(s.get(slice(None)), before)  # nothing visible yet
    b.commit(45)  # wraps: rows 45..49 and 0..1
    a.commit(5)
    expected = take(before, np.arange(50))
    ring = np.array([45, 46, 47, 48, 49, 0, 1])
    for key in ("image", "vec"):
        expected["obs"][key] = expected["obs"][key].copy()
        expected["obs"][key][ring] = data_b["obs"][key]
        expected["obs"][key][5:28] = data_a["obs"][key]
    expected["done"] = expected["done"].copy()
    expected["done"][ring] = data_b["done"]
    expected["done"][5:28] = data_a["done"]
    expected["note"] = expected["note"].copy()
    expected["note"][ring] = data_b["note"]
    expected["note"][5:28] = data_a["note"]
    assert_batch_equal(s.get(slice(None)), expected)
    with pytest.raises(SegmentStateError):
        a.append(take(data_a, 0))
    with pytest.raises(SegmentStateError):
        a.commit(0)
    s.close()


def test_aborted_writer_leaves_data_untouched_and_refuses_use(storage):
    before = storage.get(slice(None))
    w = storage.open_segment_writer()
    w.extend(batch(4, seed=7))
    w.abort()
    w.abort()  # idempotent
    with pytest.raises(SegmentStateError):
        w.commit(0)
    with pytest.raises(SegmentStateError):
        w.append(take(batch(1), 0))
    with pytest.raises(SpaceMismatchError):
        storage.open_segment_writer().append({"done": True})
    assert_batch_equal(storage.get(slice(None)), before)


def test_segment_longer_than_capacity_keeps_the_newest_rows(tmp_path):
    space = BoxSpace(0, 1000, (), np.int64)
    s = HDF5Storage.create(space, 5, tmp_path / "s.h5")
    w = s.open_segment_writer()
    w.extend(np.arange(300, 307))
    w.commit(0)
    # rows k go to (0 + k) % 5 for k = 2..6
    np.testing.assert_array_equal(s.get(slice(None)), [305, 306, 302, 303, 304])
    s.close()


def test_unbounded_storage_grows_and_shrinks(tmp_path):
    space = BoxSpace(-1, 1, (2,))
    s = HDF5Storage.create(space, None, tmp_path / "u.h5")
    assert len(s) == 0
    s.clear()  # no-op on an empty storage
    w = s.open_segment_writer()
    w.extend(np.ones((3, 2), np.float32))
    w.commit(0)
    assert len(s) == 3
    s.extend_length(2)
    assert len(s) == 5
    s.shrink_length(4)
    assert len(s) == 1
    with pytest.raises(ConfigError):
        s.shrink_length(2)
    w2 = s.open_segment_writer()
    w2.append(np.zeros(2, np.float32))
    with pytest.raises(IndexError):
        w2.commit(5)
    s.close()


def test_pickled_storage_reopens_read_only(storage):
    storage.flush()
    clone = pickle.loads(pickle.dumps(storage))
    assert not clone.is_mutable
    assert_batch_equal(clone.get(slice(None)), storage.get(slice(None)))
    with pytest.raises(ReadOnlyError):
        clone.set(0, take(batch(1), 0))
    clone.close()


def test_get_column_shares_the_file(storage):
    col = storage.get_column("obs/vec")
    assert col.single_instance_space == SPACE["obs"]["vec"]
    col.set(0, np.zeros(3, np.float32))
    np.testing.assert_array_equal(storage.get(0)["obs"]["vec"], np.zeros(3))
    with pytest.raises(KeyError):
        storage.get_column("obs/nope")


def test_dumps_writes_a_loadable_copy(storage, tmp_path):
    storage.dumps(tmp_path / "copy.h5")
    copy = HDF5Storage.load_from(tmp_path / "copy.h5", SPACE)
    assert_batch_equal(copy.get(slice(None)), storage.get(slice(None)))
    copy.close()


def test_raw_h5py_file_opens_as_a_replay_buffer(tmp_path):
    path = tmp_path / "raw.h5"
    with h5py.File(path, "w") as f:
        f["obs/pos"] = np.arange(12, dtype=np.float32).reshape(6, 2)
        f["reward"] = np.arange(6, dtype=np.float64)
        f.create_dataset("text", data=["a", "bb", "", "d", "é", "f"], dtype=h5py.string_dtype())
    rb = HDF5Storage.load_replay_buffer_from_raw_hdf5(path)
    assert len(rb) == 6
    got = rb.get_at([5, 0])
    np.testing.assert_array_equal(got["obs"]["pos"], [[10, 11], [0, 1]])
    assert list(got["text"]) == ["f", "a"]
    rb.close()


def test_call_function_helpers_skip_internal_datasets(storage):
    seen = []
    HDF5Storage.call_function_on_every_dataset(storage.root, lambda ds: seen.append(ds.name))
    assert sorted(seen) == ["/done", "/note", "/obs/image", "/obs/vec"]
    assert HDF5Storage.call_function_on_first_dataset(storage.root, lambda ds: ds.name) == "/done"


def test_static_get_from_and_set_to(storage):
    root = storage.root
    HDF5Storage.set_to(root, SPACE, [2], batch(1, seed=4))
    got = HDF5Storage.get_from(root, SPACE, np.array([2]))
    assert_batch_equal(got, batch(1, seed=4))


# ------------------------------------------------------------------------- the append cursor


def test_the_append_cursor_writes_at_the_ring_position_and_wraps(tmp_path):
    """The design document's single cursor: mark_segment_start / append / mark_segment_end."""
    space = BoxSpace(0, 100, (), np.int64)
    storage = HDF5Storage.create(space, 4, tmp_path / "c.h5")
    storage.set(slice(None), np.zeros(4, np.int64))
    assert not storage.has_open_segment
    with pytest.raises(ConfigError, match="mark_segment_start"):
        storage.append(np.int64(1))
    storage.mark_segment_start(6)  # modulo the capacity: slot 2
    assert storage.has_open_segment
    with pytest.raises(ConfigError, match="already open"):
        storage.mark_segment_start(0)
    for value in (1, 2, 3):
        storage.append(np.int64(value))  # slots 2, 3, then 0: visible at once
    with pytest.raises(SpaceMismatchError):
        storage.append(np.zeros(2, np.int64))  # a wrong shape: nothing written, the cursor stays
    np.testing.assert_array_equal(storage.get(slice(None)), [3, 0, 1, 2])
    storage.mark_segment_end()
    assert not storage.has_open_segment
    storage.close()


def test_the_append_cursor_of_an_unbounded_storage_grows_it_and_refuses_gaps(tmp_path):
    space = BoxSpace(0, 100, (), np.int64)
    storage = HDF5Storage.create(space, None, tmp_path / "u.h5")
    with pytest.raises(IndexError, match="out of range"):
        storage.mark_segment_start(1)  # would leave a gap
    storage.mark_segment_start(0)
    for value in (5, 6):
        storage.append(np.int64(value))
    storage.abort_segment()  # rows it wrote stay
    np.testing.assert_array_equal(storage.get(slice(None)), [5, 6])
    storage.close()


def _steps(n: int) -> list[dict]:
    return [{"obs": np.full(3, i / 100, np.float32), "act": np.array(i % 4)} for i in range(n)]


BOUNDED = DictSpace({"obs": BoxSpace(-1.0, 1.0, (3,), np.float32), "act": BoxSpace(0, 3, (), np.int64)})


@pytest.mark.parametrize("form", ["exact arrays", "lists"])
def test_a_segment_writer_checks_values_per_block_and_keeps_the_rows_before_a_bad_one(tmp_path, form):
    """Keys, dtypes and shapes are checked at each append; Box bounds per block of rows, here at
    the commit: the bad row is named, the writer keeps the rows before it and stays open."""
    s = HDF5Storage.create(BOUNDED, 100, tmp_path / "s.h5")
    steps = _steps(10)
    bad = {"obs": np.array([0.0, 2.5, 0.0], np.float32), "act": np.array(1)}
    w = s.open_segment_writer()
    for i, step in enumerate(steps):
        step = bad if i == 6 else step
        w.append(step if form == "exact arrays" else {k: v.tolist() for k, v in step.items()})
    assert len(w) == 10
    with pytest.raises(SpaceMismatchError, match=r"field 'obs', row 6 index \(1,\) is 2\.5, outside the space's "
                       r"bounds .* this commit found it: the segment writer keeps its first 6 rows and dropped the 4"):
        w.commit(0)
    assert len(w) == 6 and w.state == "open"
    with pytest.raises(SpaceMismatchError, match="'act'"):
        w.append({"obs": np.zeros(3, np.float32)})  # a missing key: refused at once, nothing kept
    with pytest.raises(SpaceMismatchError, match="shape"):
        w.append({"obs": np.zeros(4, np.float32), "act": np.array(1)})
    for step in steps[6:]:
        w.append(step)
    w.commit(0)
    got = s.get(slice(0, 10))
    assert np.array_equal(got["obs"], np.stack([st["obs"] for st in steps]))
    assert np.array_equal(got["act"], np.array([st["act"] for st in steps]))
    s.close()


def test_a_bad_value_is_found_when_its_block_fills_or_at_an_extend_and_never_reaches_the_file(tmp_path):
    s = HDF5Storage.create(BOUNDED, 100, tmp_path / "s.h5", segment_buffer_bytes=4 * 20)  # blocks of 4 rows
    steps = _steps(12)
    w = s.open_segment_writer()
    for step in steps[:2]:
        w.append(step)
    w.append({"obs": np.array([0.0, 0.0, np.nan], np.float32), "act": np.array(1)})
    w.append(steps[3])  # the block (4 rows) is full now; the next append finds the NaN
    with pytest.raises(SpaceMismatchError, match=r"row 2 index \(2,\) is NaN.* this append found it: .* keeps its "
                       r"first 2 rows and dropped the 2"):
        w.append(steps[4])
    assert len(w) == 2
    w.append({"obs": np.zeros(3, np.float32), "act": np.array(7)})  # out of [0, 3]
    with pytest.raises(SpaceMismatchError, match=r"field 'act', row 2 is 7.* this extend found it"):
        w.extend({"obs": np.zeros((2, 3), np.float32), "act": np.zeros(2, np.int64)})
    assert len(w) == 2
    for step in steps[2:]:
        w.append(step)  # spills blocks of 4 to the staging area, each checked first
    w.commit(0)
    assert np.array_equal(s.get(slice(0, 12))["act"], np.array([st["act"] for st in steps]))
    s.close()


def test_a_writer_on_a_storage_that_does_not_check_bounds_keeps_any_value(tmp_path):
    s = HDF5Storage.create(BOUNDED, 10, tmp_path / "s.h5")
    s.check_bounds = False
    w = s.open_segment_writer()
    w.append({"obs": np.array([5.0, np.nan, -9.0], np.float32), "act": np.array(9)})
    w.commit(0)
    assert s.get(0)["act"] == 9
    s.close()


def test_a_writer_may_borrow_the_rows_of_a_whole_episode_until_its_commit(tmp_path):
    """extend_stored(borrow=True) on an empty writer keeps the arrays uncopied (the server's push
    path: received frames straight into the file); rows added after them are copied in order."""
    s = HDF5Storage.create(BOUNDED, 20, tmp_path / "s.h5", segment_buffer_bytes=4 * 20)  # blocks of 4 rows
    rows = {"obs": np.linspace(-1, 1, 15, dtype=np.float32).reshape(5, 3), "act": np.arange(5) % 4}
    w = s.open_segment_writer()
    w.extend_stored(rows, 5, np.arange(5, dtype=np.float64), borrow=True)
    assert len(w) == 5 and w._borrowed is not None and w._borrowed["obs"] is rows["obs"]  # not copied
    w.commit(2)
    assert np.array_equal(s.get(slice(2, 7))["obs"], rows["obs"]) and np.array_equal(s.get(slice(2, 7))["act"], rows["act"])

    more = s.open_segment_writer()
    more.extend_stored(rows, 5, np.arange(5, dtype=np.float64), borrow=True)
    more.append({"obs": np.zeros(3, np.float32), "act": np.array(3)}, priority=9.0)  # copies the borrowed rows first
    more.extend_stored(rows, 5, borrow=True)  # not empty: copied, not borrowed
    assert more._borrowed is None and len(more) == 11
    rows["obs"][:] = 0.5  # the writer holds copies now
    more.commit(8)
    got = s.get(slice(8, 19))
    assert np.allclose(got["obs"][:5], np.linspace(-1, 1, 15).reshape(5, 3)) and np.all(got["obs"][5] == 0)
    assert np.allclose(got["obs"][6:], np.linspace(-1, 1, 15).reshape(5, 3))
    assert np.array_equal(more.priorities[None][:6], [0, 1, 2, 3, 4, 9])

    dropped = s.open_segment_writer()
    dropped.extend_stored(rows, 5, borrow=True)
    dropped.abort()
    assert dropped._borrowed is None and np.allclose(s.get(slice(8, 13))["obs"], np.linspace(-1, 1, 15).reshape(5, 3))
    s.close()
