"""The storage contract, run against every backend (as zarr's StoreTests are).

`StorageContract` says what any storage under a ReplayBuffer must do: rows by every index kind,
validation before any write, the ring, length management, segment writers. It runs against
HDF5Storage (a real file) and against the in-memory storage of tests/memory_backend.py, which the
server's handler tests then use in place of a file. `BufferContract` does the same for the
ReplayBuffer logic over either backend.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from memory_backend import MemoryJournal, MemoryStorage

from h5replay.errors import ClosedError, ConfigError, EvictedError, SegmentStateError, SpaceMismatchError
from h5replay.records import Episode, Receipt
from h5replay.storage import BoxSpace, DictSpace, HDF5Storage, ReplayBuffer, TextSpace

SPACE = DictSpace({"id": BoxSpace(0, 10**9, (), np.int64), "obs": BoxSpace(-9, 9, (2,), np.float32),
                   "note": TextSpace(3)})


def rows(ids: Any) -> dict[str, Any]:
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    notes = np.empty(ids.size, dtype=object)
    notes[:] = [str(i % 1000) for i in ids]
    return {"id": ids, "obs": np.stack([ids % 9, -(ids % 9)], axis=1).astype(np.float32), "note": notes}


def one(i: int) -> dict[str, Any]:
    return {"id": np.int64(i), "obs": np.array([i % 9, -(i % 9)], np.float32), "note": str(i % 1000)}


Factory = Callable[[int | None], Any]


@pytest.fixture(params=["hdf5", "memory"])
def make(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Factory]:
    made: list[Any] = []

    def factory(capacity: int | None) -> Any:
        if request.param == "hdf5":
            storage = HDF5Storage.create(SPACE, capacity, tmp_path / f"s{len(made)}.h5", segment_buffer_bytes=64)
        else:
            storage = MemoryStorage(SPACE, capacity, segment_buffer_bytes=64)
        made.append(storage)
        return storage

    yield factory
    for storage in made:
        storage.close()


class TestStorageContract:
    def test_every_index_kind_reads_what_was_written(self, make: Factory) -> None:
        s = make(10)
        s.set(slice(None), rows(np.arange(100, 110)))
        model = np.arange(100, 110)
        for index in (3, -1, slice(2, 8), slice(None, None, -3), [4, 4, -2, 0], np.array([[1, 2], [9, 9]]),
                      model % 2 == 0, np.array([], np.int64), Ellipsis):
            got = s.get(index)
            expected = model[index]
            np.testing.assert_array_equal(got["id"], expected)
            np.testing.assert_array_equal(np.asarray(got["obs"])[..., 0], expected % 9)
            assert np.asarray(got["note"]).tolist() == np.vectorize(lambda i: str(i % 1000), otypes=[object])(expected).tolist()

    def test_a_write_names_its_rows_and_the_last_duplicate_wins(self, make: Factory) -> None:
        s = make(6)
        s.set(slice(None), rows(np.zeros(6)))
        s.set([1, 3, 1], rows([7, 8, 9]))
        s.set(np.array([[0, 5]]), {"id": np.array([[50, 55]]), "obs": np.zeros((1, 2, 2), np.float32),
                                   "note": np.array([["a", "b"]], dtype=object)})
        s.set(2, one(22))
        np.testing.assert_array_equal(s.get(slice(None))["id"], [50, 9, 22, 8, 0, 55])

    @pytest.mark.parametrize("bad", ["long_note", "missing", "shape", "rows", "index"])
    def test_a_refused_write_changes_nothing(self, make: Factory, bad: str) -> None:
        s = make(5)
        s.set(slice(None), rows(range(5)))
        value = rows([1, 2])
        index: Any = [0, 1]
        error: type[Exception] = SpaceMismatchError
        if bad == "long_note":
            value["note"][1] = "toolong"
        elif bad == "missing":
            del value["note"]
        elif bad == "shape":
            value["obs"] = np.zeros((2, 3), np.float32)
        elif bad == "rows":
            index = [0, 1, 2]
        else:
            index, error = [0, 5], IndexError
        with pytest.raises(error):
            s.set(index, value)
        np.testing.assert_array_equal(s.get(slice(None))["id"], range(5))

    def test_the_ring_wraps_and_an_unbounded_storage_grows(self, make: Factory) -> None:
        ring = make(4)
        encoded, _ = ring.encode_batch(rows(range(6)))
        ring.write_ring(3, encoded)  # six rows from slot 3 of 4: the last four survive
        np.testing.assert_array_equal(ring.get(slice(None))["id"], [5, 2, 3, 4])  # rows 2..5 in slots 1, 2, 3, 0
        grow = make(None)
        assert len(grow) == 0
        grow.write_ring(0, grow.encode_batch(rows(range(3)))[0])
        grow.write_ring(3, grow.encode_batch(rows(range(3, 5)))[0])
        np.testing.assert_array_equal(grow.get(slice(None))["id"], range(5))

    def test_length_management(self, make: Factory) -> None:
        grow = make(None)
        grow.extend_length(3)
        assert len(grow) == 3
        grow.set(slice(None), rows([1, 2, 3]))
        grow.shrink_length(1)
        np.testing.assert_array_equal(grow.get(slice(None))["id"], [1, 2])
        grow.clear()
        assert len(grow) == 0
        with pytest.raises(ConfigError):
            grow.shrink_length(1)
        fixed = make(3)
        for call in (lambda: fixed.extend_length(1), lambda: fixed.shrink_length(1)):
            with pytest.raises(ConfigError, match="fixed capacity"):
                call()
        fixed.clear()
        assert len(fixed) == 3  # a fixed storage keeps its rows' slots

    def test_segment_writers_commit_in_any_order_and_abort_leaves_nothing(self, make: Factory) -> None:
        s = make(8)
        s.set(slice(None), rows(np.zeros(8)))
        a, b, c = s.open_segment_writer(), s.open_segment_writer(), s.open_segment_writer()
        a.extend(rows([1, 1, 1]))
        for _ in range(5):  # more than a staging block (64 bytes): rows spill
            b.append(one(2))
        c.extend(rows([3, 3]))
        c.abort()
        b.commit(0)
        a.commit(5)
        np.testing.assert_array_equal(s.get(slice(None))["id"], [2, 2, 2, 2, 2, 1, 1, 1])
        assert (a.state, b.state, c.state) == ("committed", "committed", "aborted")
        with pytest.raises(SegmentStateError):
            a.append(one(4))
        with pytest.raises(SegmentStateError):
            c.commit(0)
        long = s.open_segment_writer()
        long.extend(rows(range(20)))  # longer than the ring: its last rows win, as in numpy
        long.commit(0)
        np.testing.assert_array_equal(np.sort(s.get(slice(None))["id"]), range(12, 20))

    def test_a_refused_row_leaves_the_writer_as_it_was(self, make: Factory) -> None:
        s = make(4)
        w = s.open_segment_writer()
        w.extend(rows([1]))
        with pytest.raises(SpaceMismatchError):
            w.append({**one(2), "note": "toolong"})
        assert len(w) == 1
        w.commit(0)
        assert s.get(0)["id"] == 1

    def test_a_closed_storage_refuses_work(self, make: Factory) -> None:
        s = make(2)
        s.close()
        s.close()  # twice is fine
        with pytest.raises(ClosedError):
            s.get(0)


@pytest.fixture(params=["hdf5", "memory"])
def make_buffer(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Callable[[int | None], ReplayBuffer]]:
    made: list[ReplayBuffer] = []

    def factory(capacity: int | None) -> ReplayBuffer:
        if request.param == "hdf5":
            buffer = ReplayBuffer.create(SPACE, capacity, tmp_path / f"b{len(made)}.h5")
        else:
            storage = MemoryStorage(SPACE, capacity)
            buffer = ReplayBuffer(storage, journal=MemoryJournal(storage))  # type: ignore[arg-type]
        made.append(buffer)
        return buffer

    yield factory
    for buffer in made:
        buffer.close()


def commit(buffer: ReplayBuffer, ids: Any) -> Receipt:
    w = buffer.open_segment_writer()
    w.extend(rows(ids))
    return buffer.commit_segment(w)


class TestBufferContract:
    def test_ids_wrap_clear_and_reads(self, make_buffer: Callable[[int | None], ReplayBuffer]) -> None:
        rb = make_buffer(8)
        assert commit(rb, [10, 11, 12]) == Receipt(0, 0, 3)
        assert commit(rb, range(20, 26)) == Receipt(1, 3, 6)  # wraps: episode 0 loses its head
        assert rb.episodes() == [Episode(1, 3, 6)]
        batch, info = rb.sample(30, np.random.default_rng(0), with_info=True)
        np.testing.assert_array_equal(rb.get_rows(info.row_ids)["id"], batch["id"])
        with pytest.raises(EvictedError):
            rb.get_rows([0])
        windows = rb.sample_sequences(5, 6, np.random.default_rng(1))
        np.testing.assert_array_equal(windows["id"], np.tile(np.arange(20, 26), (5, 1)))
        rb.clear()
        assert len(rb) == 0 and rb.view.generation == 1
        assert commit(rb, [7]) == Receipt(2, 9, 1)

    def test_group_commit_publishes_once(self, make_buffer: Callable[[int | None], ReplayBuffer]) -> None:
        rb = make_buffer(None)
        before = rb.published
        for e in range(3):
            w = rb.open_segment_writer()
            w.extend(rows([e]))
            rb.commit_segment(w, publish=False)
        assert rb.published == before and len(rb) == 3  # placed, not yet published
        rb.flush()
        assert rb.published.end == 3 and rb.published.ep_end == 3
