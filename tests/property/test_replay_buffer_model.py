"""ReplayBuffer against a plain Python model (hypothesis state machines).

The model follows the module docstring of storage/replay/buffer.py: rows get global ids 0, 1, 2, ...
in the order they are added, never reused (`clear()` moves begin to end); the buffer holds ids
[begin, end) with end - begin <= capacity; logical index 0 is `begin`. Episodes are (episode id,
first row id, length), ids global too; one whose first row was overwritten leaves `episodes()`
and `get_segments()`, but its held rows still report its id. The rows appended since the last episode end form the open
episode, closed by `end_episode()` or by the next `commit_segment`. Before rows overwrite slots
the last published state still shows, the oldest rows are released `capacity // 64` ahead of need
(so with a capacity of 64 or more, len() may stay a little below the capacity); every publish
(flush, commit_segment, clear, close) moves the published begin to the current one.

Every row carries a unique `id`, so a sampled row or window can be traced back to the model:
`sample` may only return held rows, `sample_sequences` only windows inside one complete held
episode, and their SampleInfo must name each row's id, episode id and draw probability. After every step the length, the rows (by slice and by reversed int array), the segments
and the counters must equal the model; close-and-reopen must give exactly the same buffer.

Two machines: fixed capacities 1..15 (the ring wraps often) or 64..66 (rows released early),
and an unbounded buffer.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from h5replay.errors import EvictedError, NotEnoughDataError, SegmentStateError, SpaceMismatchError
from h5replay.records import NO_EPISODE, Episode, Receipt
from h5replay.storage import BoxSpace, DictSpace, ReplayBuffer, TextSpace

SPACE = DictSpace(
    {"id": BoxSpace(0, 2**40, (), np.int64), "obs": BoxSpace(-10, 10, (2,), np.float32), "note": TextSpace(3)}
)
ALPHABET = "aZ éß中🙂"
MAX_OPEN_WRITERS = 4
SEEDS = st.integers(0, 2**32 - 1)
EVICTION_FRACTION = 64  # storage/replay/buffer.py releases capacity // 64 rows ahead of need
# 28 bytes a row as stored: 1 -> one-row staging blocks, 64 -> two rows, 256 -> nine rows.
BUFFER_BYTES = st.sampled_from([1, 64, 256])


@dataclass
class Row:
    id: int
    obs: np.ndarray
    note: str


def as_batch(rows: list[Row]) -> dict[str, Any]:
    notes = np.empty(len(rows), dtype=object)
    notes[:] = [r.note for r in rows]
    return {
        "id": np.array([r.id for r in rows], dtype=np.int64),
        "obs": np.array([r.obs for r in rows], dtype=np.float32).reshape(len(rows), 2),
        "note": notes,
    }


def as_sample(row: Row) -> dict[str, Any]:
    return {"id": np.int64(row.id), "obs": row.obs, "note": row.note}


def assert_batch_equal(got: Any, rows: list[Row], shape: tuple[int, ...], where: str) -> None:
    """`got` holds `rows` laid out in `shape` (the index's shape)."""
    expected = as_batch(rows)
    ids = np.asarray(got["id"])
    assert ids.dtype == np.int64 and ids.shape == shape, f"{where}: id {ids.dtype} {ids.shape}, expected {shape}"
    np.testing.assert_array_equal(ids.reshape(-1), expected["id"], err_msg=f"{where}: id")
    obs = np.asarray(got["obs"])
    assert obs.dtype == np.float32 and obs.shape == (*shape, 2), f"{where}: obs {obs.dtype} {obs.shape}"
    np.testing.assert_array_equal(obs.reshape(-1, 2), expected["obs"], err_msg=f"{where}: obs")
    notes = np.asarray(got["note"])
    assert notes.dtype == object and notes.shape == shape, f"{where}: note {notes.dtype} {notes.shape}"
    assert notes.reshape(-1).tolist() == expected["note"].tolist(), f"{where}: note"


def index_strategy(length: int) -> st.SearchStrategy[Any]:
    """Every kind of logical index valid for `length` rows."""
    bound = st.none() | st.integers(-length - 2, length + 2)
    step = st.none() | st.sampled_from([1, 2, 3, -1, -2, -3])
    kinds: list[st.SearchStrategy[Any]] = [
        st.builds(slice, bound, bound, step),
        st.lists(st.booleans(), min_size=length, max_size=length).map(lambda m: np.array(m, dtype=bool)),
        st.just([]),
        st.just(Ellipsis),
    ]
    if length:
        one = st.integers(-length, length - 1)
        kinds += [
            one,
            one.map(np.int64),
            st.lists(one, max_size=8),
            st.builds(lambda xs, dt: np.array(xs, dtype=dt), st.lists(one, max_size=8), st.sampled_from([np.int64, np.int32])),
            st.builds(
                lambda a, b, xs: np.array(xs[: a * b], dtype=np.int64).reshape(a, b),
                st.integers(1, 3), st.integers(1, 3), st.lists(one, min_size=9, max_size=9),
            ),
        ]
    return st.one_of(kinds)


def as_numpy_index(index: Any) -> Any:
    return np.asarray(index, dtype=np.int64) if isinstance(index, list) else index


@dataclass
class WriterModel:
    writer: Any
    rows: list[Row]
    state: str = "open"  # open | committed | aborted | dead (its buffer was closed)


class ReplayMachine(RuleBasedStateMachine):
    """Rules shared by both machines; subclasses create the buffer in an @initialize rule."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="h5replay-rb-model-")
        self.path = os.path.join(self.dir, "rb.h5")
        self.rb: ReplayBuffer | None = None
        self.capacity: int | None = None
        self.buffer_bytes = 1
        self.multiprocessing = False
        self.next_id = 0
        # The model: row ids [begin, end) held; rows by id; every episode recorded (id, first row, length).
        self.begin = self.end = self.open_start = self.ep_end = 0
        self.published_begin = 0  # `begin` as the file last showed it
        self.rows: dict[int, Row] = {}
        self.recorded: list[tuple[int, int, int]] = []
        self.writers: list[WriterModel] = []

    def create_buffer(self, capacity: int | None, layout: dict[str, Any], buffer_bytes: int) -> None:
        self.capacity = capacity
        self.buffer_bytes = buffer_bytes
        self.multiprocessing = bool(layout.get("multiprocessing", False))
        self.rb = ReplayBuffer.create(SPACE, capacity, self.path, segment_buffer_bytes=buffer_bytes, **layout)

    def teardown(self) -> None:
        try:
            if self.rb is not None:
                self.rb.close()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    @property
    def b(self) -> ReplayBuffer:
        assert self.rb is not None
        return self.rb

    # ------------------------------------------------------------------ model

    def new_rows(self, n: int, seed: int) -> list[Row]:
        rng = np.random.default_rng(seed)
        rows = []
        for _ in range(n):
            note = "".join(rng.choice(list(ALPHABET), size=int(rng.integers(0, 4))))
            rows.append(Row(self.next_id, rng.uniform(-10, 10, 2).astype(np.float32), note))
            self.next_id += 1
        return rows

    def held(self) -> list[Row]:
        return [self.rows[g] for g in range(self.begin, self.end)]

    def model_drop_old(self) -> None:
        for g in [g for g in self.rows if g < self.begin]:
            del self.rows[g]

    @property
    def episodes(self) -> list[tuple[int, int]]:
        """(first row id, length) of the complete episodes held."""
        return [(g0, n) for _, g0, n in self.recorded if g0 >= self.begin]

    def episode_of(self, g: int) -> int:
        return next((e for e, g0, n in self.recorded if g0 <= g < g0 + n), int(NO_EPISODE))

    def model_publish(self) -> None:
        self.published_begin = self.begin

    def model_add(self, rows: list[Row]) -> None:
        if not rows:
            return
        if self.capacity is not None:
            # Slots the published state still shows are released first, a little ahead of need.
            needed = self.end + len(rows) - self.capacity
            if needed > self.published_begin:
                self.begin = max(self.begin, min(needed + self.capacity // EVICTION_FRACTION, self.end))
                self.model_drop_old()
                self.model_publish()
        for row in rows:
            self.rows[self.end] = row
            self.end += 1
        if self.capacity is not None:
            self.begin = max(self.begin, self.end - self.capacity)
        self.model_drop_old()

    def model_end_episode(self) -> None:
        if self.begin <= self.open_start < self.end:
            self.recorded.append((self.ep_end, self.open_start, self.end - self.open_start))
            self.ep_end += 1
        self.open_start = self.end

    def open_writers(self) -> list[WriterModel]:
        return [w for w in self.writers if w.state == "open"]

    def pick_writer(self, data: st.DataObject, writers: list[WriterModel]) -> WriterModel:
        return writers[data.draw(st.integers(0, len(writers) - 1), label="writer")]

    # Hypothesis lists rules by number of arguments (then name) and favours the first: the core
    # rules take one argument, clear / reopen / rejected writes take more, so they come less often.

    # ------------------------------------------------------------------ adding rows

    @rule(data=st.data())
    def add_rows(self, data: st.DataObject) -> None:
        """append, extend (0..2*capacity+3 rows: longer than the ring, too) or end_episode."""
        op = data.draw(st.sampled_from(["append", "extend", "end_episode"]), label="op")
        if op == "end_episode":
            self.b.end_episode()
            self.model_end_episode()
            return
        seed = data.draw(SEEDS, label="seed")
        if op == "append":
            (row,) = self.new_rows(1, seed)
            self.b.append(as_sample(row))
            self.model_add([row])
            return
        top = 2 * self.capacity + 3 if self.capacity is not None else 20
        rows = self.new_rows(data.draw(st.integers(0, top), label="rows"), seed)
        self.b.extend(as_batch(rows))
        self.model_add(rows)

    @rule(seed=SEEDS, how=st.sampled_from(["long_note", "obs_shape", "missing", "obs_text", "id_float"]),
          batched=st.booleans())
    def rejected_add_changes_nothing(self, seed: int, how: str, batched: bool) -> None:
        rows = self.new_rows(3, seed)
        value = as_batch(rows) if batched else as_sample(rows[0])
        if how == "long_note":
            value["note"] = np.array(["ok", "toolong", "x"], dtype=object) if batched else "toolong"
        elif how == "obs_shape":
            value["obs"] = np.zeros((3, 3) if batched else (3,), np.float32)
        elif how == "missing":
            del value["id"]
        elif how == "obs_text":
            value["obs"] = np.array([["a", "b"]] * 3) if batched else np.array(["a", "b"])
        else:
            value["id"] = np.ones(3 if batched else (), np.float64)
        with pytest.raises(SpaceMismatchError):
            (self.b.extend if batched else self.b.append)(value)

    # ------------------------------------------------------------------ segment writers

    @precondition(lambda self: len(self.open_writers()) < MAX_OPEN_WRITERS)
    @rule()
    def open_writer(self) -> None:
        self.writers.append(WriterModel(self.b.open_segment_writer(), []))
        if len(self.writers) > 12:  # forget the oldest used-up writer
            self.writers.remove(next(w for w in self.writers if w.state != "open"))

    @rule(data=st.data())
    def writer_add(self, data: st.DataObject) -> None:
        """append or extend on any open writer (opening one when none is open)."""
        writers = self.open_writers()
        if not writers or (len(writers) < MAX_OPEN_WRITERS and data.draw(st.integers(0, 3)) == 0):
            self.open_writer()
            writers = self.open_writers()
        w = self.pick_writer(data, writers)
        seed = data.draw(SEEDS, label="seed")
        top = self.capacity + 2 if self.capacity is not None else 12
        n = data.draw(st.none() | st.integers(0, top), label="rows (None: append)")
        if n is None:
            (row,) = self.new_rows(1, seed)
            w.writer.append(as_sample(row))
            w.rows.append(row)
        else:
            rows = self.new_rows(n, seed)
            w.writer.extend(as_batch(rows))
            w.rows += rows

    @rule(data=st.data())
    def writer_add_then_commit(self, data: st.DataObject) -> None:
        """Rows for a writer, then commit_segment of any open writer (not always the same one)."""
        self.writer_add(data)
        self.commit_segment(data)

    @precondition(lambda self: bool(self.open_writers()))
    @rule(data=st.data())
    def commit_segment(self, data: st.DataObject) -> None:
        w = self.pick_writer(data, self.open_writers())
        n = len(w.rows)
        assert len(w.writer) == n
        if n == 0:  # an empty writer is aborted; nothing is recorded, the open episode stays open
            assert self.b.commit_segment(w.writer) == Receipt(-1, -1, 0)
            assert w.writer.state == "aborted"
            w.state = "aborted"
            return
        if self.capacity is not None and n > self.capacity:
            with pytest.raises(SegmentStateError):
                self.b.commit_segment(w.writer)
            assert w.writer.state == "aborted"
            w.state = "aborted"
            return
        info = self.b.commit_segment(w.writer)
        w.state = "committed"
        if self.open_start < self.end:  # the rows appended so far end their episode first
            self.model_end_episode()
        start = self.end
        self.model_add(w.rows)
        self.recorded.append((self.ep_end, start, n))
        expected = Receipt(self.ep_end, start, n)
        self.ep_end += 1
        self.open_start = self.end
        self.model_publish()
        assert info == expected

    @precondition(lambda self: any(w.rows for w in self.open_writers()))
    @rule(data=st.data(), keyed=st.booleans())
    def commit_episodes(self, data: st.DataObject, keyed: bool) -> None:
        """A writer's rows as several episodes at once: each recorded as commit_segment would
        one after another, with one write; bad lengths or too many rows change nothing."""
        w = self.pick_writer(data, [w for w in self.open_writers() if w.rows])
        n = len(w.rows)
        cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), max_size=min(n - 1, 6)), label="cuts")) if n > 1 else []
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, n])]
        keys = [(self.ep_end + i).to_bytes(16, 'big') for i in range(len(lengths))] if keyed else None  # never used before
        bad = data.draw(st.sampled_from([None, "short", "zero"]), label="bad lengths")
        if bad is not None or (self.capacity is not None and n > self.capacity):
            wrong = lengths if bad is None else [*lengths[:-1], lengths[-1] - 1] if bad == "short" else [0, *lengths]
            with pytest.raises(SegmentStateError):
                self.b.commit_episodes(w.writer, wrong, None if keys is None or bad == "zero" else keys)
            assert w.writer.state == "open" and len(w.writer) == n  # left as it was
            return
        receipts = self.b.commit_episodes(w.writer, lengths, keys)
        w.state = "committed"
        if self.open_start < self.end:
            self.model_end_episode()
        first = self.end
        self.model_add(w.rows)
        expected = []
        for length in lengths:
            self.recorded.append((self.ep_end, first, length))
            expected.append(Receipt(self.ep_end, first, length))
            self.ep_end += 1
            first += length
        self.open_start = self.end
        self.model_publish()
        assert receipts == expected
        if keys is not None:  # each key answers with its own episode's receipt
            assert [self.b.receipt_for(key) for key in keys] == expected

    @precondition(lambda self: bool(self.open_writers()))
    @rule(data=st.data(), twice=st.booleans())
    def writer_abort(self, data: st.DataObject, twice: bool) -> None:
        w = self.pick_writer(data, self.open_writers())
        w.writer.abort()
        if twice:
            w.writer.abort()  # idempotent
        w.state = "aborted"

    @precondition(lambda self: any(w.state != "open" for w in self.writers))
    @rule(data=st.data(), op=st.sampled_from(["commit_segment", "append", "extend"]))
    def used_writer_raises(self, data: st.DataObject, op: str) -> None:
        w = self.pick_writer(data, [w for w in self.writers if w.state != "open"])
        (row,) = self.new_rows(1, 0)
        call = {
            "commit_segment": lambda: self.b.commit_segment(w.writer),
            "append": lambda: w.writer.append(as_sample(row)),
            "extend": lambda: w.writer.extend(as_batch([row])),
        }[op]
        with pytest.raises(SegmentStateError):
            call()

    # ------------------------------------------------------------------ reading

    @rule(data=st.data())
    def get_at(self, data: st.DataObject) -> None:
        held = self.held()
        n = len(held)
        if data.draw(st.integers(0, 4), label="out of range?") == 0:
            bad = data.draw(st.integers(n, n + 3) | st.integers(-n - 3, -n - 1), label="bad index")
            with pytest.raises(IndexError):
                self.b.get_at(bad)
            with pytest.raises(IndexError):
                self.b.get_at([0, bad] if n else [bad])
            return
        index = data.draw(index_strategy(n), label="index")
        picked = np.arange(n)[as_numpy_index(index)]
        got = self.b.get_at(index)
        if picked.ndim == 0:
            row = held[int(picked)]
            assert int(got["id"]) == row.id and got["note"] == row.note
            np.testing.assert_array_equal(got["obs"], row.obs)
            return
        assert_batch_equal(got, [held[i] for i in picked.reshape(-1)], picked.shape, f"get_at({index!r})")

    @rule(batch_size=st.integers(1, 8), seed=st.none() | SEEDS)
    def sample(self, batch_size: int, seed: int | None) -> None:
        rng = None if seed is None else np.random.default_rng(seed)
        held = {row.id: row for row in self.held()}
        if not held:
            with pytest.raises(NotEnoughDataError):
                self.b.sample(batch_size, rng)
            return
        got, info = self.b.sample(batch_size, rng, with_info=True)
        ids = np.asarray(got["id"]).tolist()
        assert set(ids) <= set(held), f"sampled ids {ids} not all held: {sorted(held)}"
        assert_batch_equal(got, [held[i] for i in ids], (batch_size,), "sample")
        where = {row.id: g for g, row in self.rows.items() if g >= self.begin}
        assert info.row_ids.dtype == np.uint64 and info.row_ids.tolist() == [where[i] for i in ids]
        assert info.episode_ids.dtype == np.uint64
        assert info.episode_ids.tolist() == [self.episode_of(where[i]) for i in ids]
        np.testing.assert_allclose(info.probabilities, 1.0 / len(held))
        assert_batch_equal(self.b.get_rows(info.row_ids), [held[i] for i in ids], (batch_size,), "get_rows(sampled)")

    @rule(batch_size=st.integers(1, 6), data=st.data(), seed=st.none() | SEEDS)
    def sample_sequences(self, batch_size: int, data: st.DataObject, seed: int | None) -> None:
        rng = None if seed is None else np.random.default_rng(seed)
        longest = max((n for _, n in self.episodes), default=0)  # longest + 1: no window fits
        length = data.draw(st.integers(1, longest + 1), label="length")
        if not any(n >= length for _, n in self.episodes):
            with pytest.raises(NotEnoughDataError):
                self.b.sample_sequences(batch_size, length, rng)
            return
        got, info = self.b.sample_sequences(batch_size, length, rng, with_info=True)
        where = {row.id: g for g, row in self.rows.items() if g >= self.begin}
        windows = sum(max(0, n - length + 1) for _, n in self.episodes)
        np.testing.assert_allclose(info.probabilities, 1.0 / windows)
        assert info.row_ids.tolist() == [where[i] for i in np.asarray(got["id"])[:, 0].tolist()]
        assert info.episode_ids.tolist() == [self.episode_of(g) for g in info.row_ids.tolist()]
        ids = np.asarray(got["id"])
        assert ids.shape == (batch_size, length)
        for window in ids.tolist():
            assert set(window) <= set(where), f"window {window} holds rows not held"
            g = [where[i] for i in window]
            assert g == list(range(g[0], g[0] + length)), f"window {window} is not consecutive rows"
            assert any(g0 <= g[0] and g[-1] < g0 + n for g0, n in self.episodes), (
                f"window of globals {g} is not inside one complete episode of {self.episodes}"
            )
        assert_batch_equal(got, [self.rows[where[i]] for i in ids.reshape(-1)], (batch_size, length), "sequences")

    @rule(data=st.data())
    def get_rows(self, data: st.DataObject) -> None:
        """By global id: held ids give their rows; evicted ones EvictedError; others IndexError."""
        ids = data.draw(st.lists(st.integers(max(0, self.begin - 3), self.end + 2), max_size=6), label="row ids")
        evicted = [g for g in ids if g < self.begin]
        unborn = [g for g in ids if g >= self.end]
        if evicted:
            with pytest.raises(EvictedError, match=f"row id {evicted[0]} is no longer held"):
                self.b.get_rows(ids)
        elif unborn:
            with pytest.raises(IndexError, match="never committed"):
                self.b.get_rows(ids)
        else:
            assert_batch_equal(self.b.get_rows(np.array(ids, dtype=np.uint64)), [self.rows[g] for g in ids],
                               (len(ids),), f"get_rows({ids})")

    # ------------------------------------------------------------------ clear, flush, reopen

    @rule(then_sample=st.booleans(), seed=SEEDS)
    def clear(self, then_sample: bool, seed: int) -> None:
        """Every row and episode goes; open writers stay usable."""
        self.b.clear()
        self.begin = self.open_start = self.published_begin = self.end  # ids go on; none is reused
        self.rows, self.recorded = {}, []
        if then_sample:
            with pytest.raises(NotEnoughDataError):
                self.b.sample(1, np.random.default_rng(seed))

    @rule(data=st.data(), read_first=st.booleans())
    def flush_then_read(self, data: st.DataObject, read_first: bool) -> None:
        """After a flush, reads of two or more rows may take the memory-map fast path."""
        if read_first:
            self.get_at(data)
        self.b.flush()
        self.model_publish()
        self.get_at(data)

    @rule(peek_read_only=st.booleans(), flush_first=st.booleans())
    def close_and_reopen(self, peek_read_only: bool, flush_first: bool) -> None:
        if flush_first:
            self.b.flush()
        self.b.close()  # publishes
        self.b.close()  # safe twice
        self.model_publish()
        for w in self.writers:
            if w.state == "open":
                w.state = "dead"
        if peek_read_only:
            self.rb = ReplayBuffer.load_from(self.path)
            assert not self.b.is_mutable
            self.check_against_model()
            self.b.close()
        self.rb = ReplayBuffer.load_from(
            self.path, read_only=False, multiprocessing=self.multiprocessing, segment_buffer_bytes=self.buffer_bytes
        )
        assert self.b.space == SPACE and self.b.capacity == self.capacity

    # ------------------------------------------------------------------ invariants

    def check_against_model(self) -> None:
        held = self.held()
        assert len(self.b) == len(held) == self.end - self.begin
        assert self.capacity is None or len(held) <= self.capacity
        assert self.b.get_segments() == [(g0 - self.begin, n) for g0, n in self.episodes]
        assert self.b.episodes() == [Episode(e, g0, n) for e, g0, n in self.recorded if g0 >= self.begin]
        assert self.b.num_episodes == len(self.episodes)
        info = self.b.info()
        assert (info["total_rows"], info["total_episodes"], info["oldest_row_id"]) == (self.end, self.ep_end, self.begin)
        assert_batch_equal(self.b.get_at(slice(None)), held, (len(held),), "get_at(:)")
        backwards = np.arange(len(held) - 1, -1, -1)
        assert_batch_equal(self.b.get_at(backwards), held[::-1], (len(held),), "get_at(reversed)")

    @invariant()
    def buffer_matches_model(self) -> None:
        if self.rb is None:
            return
        self.check_against_model()
        for w in self.open_writers():
            assert len(w.writer) == len(w.rows)


class FixedCapacityReplayMachine(ReplayMachine):
    @initialize(
        capacity=st.integers(1, 15) | st.integers(64, 66),
        layout=st.sampled_from([{}, {"chunks": True}, {"multiprocessing": True}]),
        buffer_bytes=BUFFER_BYTES,
    )
    def create(self, capacity: int, layout: dict[str, Any], buffer_bytes: int) -> None:
        self.create_buffer(capacity, layout, buffer_bytes)


class UnboundedReplayMachine(ReplayMachine):
    @initialize(layout=st.sampled_from([{}, {"multiprocessing": True}]), buffer_bytes=BUFFER_BYTES)
    def create(self, layout: dict[str, Any], buffer_bytes: int) -> None:
        self.create_buffer(None, layout, buffer_bytes)


# Inherit the loaded profile (tests/conftest.py); only the run length and deadline are set here.
MACHINE_SETTINGS = settings(stateful_step_count=30, deadline=None)

TestFixedCapacityReplayBuffer = FixedCapacityReplayMachine.TestCase
TestFixedCapacityReplayBuffer.settings = MACHINE_SETTINGS
TestUnboundedReplayBuffer = UnboundedReplayMachine.TestCase
TestUnboundedReplayBuffer.settings = MACHINE_SETTINGS


# ---------------------------------------------------------------------- regressions


def test_reopen_after_an_eviction_keeps_every_row(tmp_path: Any) -> None:
    """With capacity >= 64 an eviction releases rows ahead of need; close must not release more:
    the reopened buffer is exactly the closed one (flush/close used to publish a begin ahead of
    the writer's own)."""
    space = BoxSpace(0, 1000, (), np.int64)
    rb = ReplayBuffer.create(space, 64, tmp_path / "rb.h5")
    rb.extend(np.arange(64))
    rb.end_episode()
    rb.append(np.int64(64))  # overwrites row 0: the eviction releases rows 0 and 1
    rows, segments = rb.get_at(slice(None)), rb.get_segments()
    rb.close()
    again = ReplayBuffer.load_from(tmp_path / "rb.h5")
    try:
        assert len(again) == len(rows)
        np.testing.assert_array_equal(again.get_at(slice(None)), rows)
        assert again.get_segments() == segments
    finally:
        again.close()
