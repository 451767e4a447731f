"""Damaged files, made on purpose: what recovery does with each, for the writer's open, a plain
reader and an SWMR reader.

A SIGKILL never tears a write the page cache already holds; power loss or a bad disk can. So
these tests write the damage into the file's bytes (or rows) directly and check each guard:

* a state row half-written, zero-filled or with a flipped bit fails its CRC-32: the file holds
  one state row, rewritten in place, so there is no older intact one to fall back to, and every
  open refuses the file (StorageError); a live SWMR reader refuses its reads, and serves again
  once the row is whole;
* an idempotency key row that is torn, has a flipped bit, or sits in another episode's slot is
  dropped with a warning: a retry of its episode commits it again, and is never answered with a
  receipt for other rows;
* a priority log entry (or a stored priority) that is not a finite number >= 0, or names a row
  not held, is never applied: the row keeps the priority it had, and draws stay finite;
* an episode record out of range (past the rows held, empty, out of order, without a row held,
  before the first row) refuses the file.
"""

from __future__ import annotations

import logging
import os
import subprocess
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest
from fault_helpers import cli_command

from h5replay.errors import StorageError
from h5replay.sampling import Prioritized
from h5replay.spaces import BoxSpace
from h5replay.storage import ReplayBuffer

pytestmark = pytest.mark.timeout(60)

SPACE = BoxSpace(-1, 1, (3,))
REPLAY = "_h5replay/replay"
TABLE = f"{REPLAY}/tables/default"  # the datasets of a one-table buffer's table
OPENS = ("writer", "reader", "swmr_reader")


def open_as(path: Path, how: str) -> ReplayBuffer:
    return ReplayBuffer.load_from(path, read_only=how != "writer", multiprocessing=how == "swmr_reader")


def rows(n: int, value: float = 0.0) -> np.ndarray:
    return np.full((n, 3), value, np.float32)


def byte_offset(path: Path, name: str, index: int) -> int:
    """Where row `index` of the chunked, unfiltered dataset `name` lies in the file (which a
    writer may hold open: read as an SWMR reader)."""
    with h5py.File(path, "r", swmr=True, locking=False) as f:
        ds = f[name]
        per_chunk = ds.chunks[0]
        chunk = ds.id.get_chunk_info_by_coord((index - index % per_chunk,) + (0,) * (ds.ndim - 1))
        row_bytes = ds.dtype.itemsize * int(np.prod(ds.shape[1:], dtype=np.int64))
        return int(chunk.byte_offset) + (index % per_chunk) * row_bytes


def overwrite(path: Path, offset: int, data: bytes) -> None:
    """Write bytes into the file as a failing disk would: below HDF5, which never sees it."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


# ------------------------------------------------------------------------------ the state row


def _state_row(path: Path) -> bytes:
    with h5py.File(path, "r") as f:
        return bytes(f[f"{REPLAY}/journal"][...].tobytes())


def _state_rows(path: Path) -> tuple[bytes, bytes]:
    """A file of two published episodes (5 and 4 rows); the state row before and after the second."""
    rb = ReplayBuffer.create(SPACE, 16, path)
    rb.extend(rows(5))
    rb.end_episode()
    rb.close()
    older = _state_row(path)
    rb = ReplayBuffer.load_from(path, read_only=False)
    rb.extend(rows(4))
    rb.end_episode()
    rb.close()
    return older, _state_row(path)


def _damaged(kind: str, older: bytes, newer: bytes) -> bytes:
    if kind == "zero-filled":
        return bytes(len(newer))
    if kind == "half-written":  # the new row's first half over the old one's second (values that check out)
        return newer[:64] + older[64:]
    row = bytearray(newer)
    row[8 * 11] ^= 0x04  # a flipped bit in `inserted`, a value nothing else checks
    return bytes(row)


@pytest.mark.parametrize("how", OPENS)
@pytest.mark.parametrize("kind", ["zero-filled", "half-written", "bit flipped"])
def test_a_damaged_state_row_refuses_the_file(tmp_path: Path, kind: str, how: str) -> None:
    path = tmp_path / "rb.h5"
    older, newer = _state_rows(path)
    overwrite(path, byte_offset(path, f"{REPLAY}/journal", 0), _damaged(kind, older, newer))
    with pytest.raises(StorageError, match="damaged replay journal row"):
        open_as(path, how).close()
    overwrite(path, byte_offset(path, f"{REPLAY}/journal", 0), newer)  # the row whole again: served as published
    with open_as(path, how) as rb:
        assert len(rb) == 9 and rb.get_segments() == [(0, 5), (5, 4)]


def test_a_live_reader_refuses_its_reads_while_the_state_row_is_damaged(tmp_path: Path) -> None:
    path = tmp_path / "rb.h5"
    older, newer = _state_rows(path)
    offset = byte_offset(path, f"{REPLAY}/journal", 0)
    with open_as(path, "swmr_reader") as reader:
        assert len(reader) == 9
        overwrite(path, offset, _damaged("half-written", older, newer))
        with pytest.raises(StorageError, match="damaged replay journal row"):
            reader.sample(4)  # after its retries (a writer's rewrite is whole again within them)
        assert reader.view.end == 9  # what it had, not the damaged row's
        overwrite(path, offset, newer)
        assert len(reader) == 9 and reader.sample(4).shape == (4, 3)


def test_serve_refuses_a_file_whose_state_row_is_damaged(tmp_path: Path) -> None:
    path = tmp_path / "rb.h5"
    older, newer = _state_rows(path)
    overwrite(path, byte_offset(path, f"{REPLAY}/journal", 0), _damaged("bit flipped", older, newer))
    done = subprocess.run(cli_command("serve", str(path), "--bind", f"ipc://{tmp_path}/w", "--read-bind",
                                      f"ipc://{tmp_path}/r"), capture_output=True, text=True, timeout=30)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and "damaged replay journal row" in lines[0], done.stderr


# ---------------------------------------------------------------------------- idempotency keys

WINDOW = 4


def _keyed(path: Path, episodes: int = 6) -> list[bytes]:
    """Episodes 0..episodes-1 of 3 rows (ids 3e..3e+2), each committed with its own key, in a
    window of 4: slots 0..3 hold the rows of episodes 4, 5, 2, 3."""
    keys = [bytes([e + 1]) * 16 for e in range(episodes)]
    rb = ReplayBuffer.create(SPACE, 64, path, idempotency_window=WINDOW)
    for e, key in enumerate(keys):
        writer = rb.open_segment_writer()
        writer.extend(rows(3, e / 10))
        rb.commit_segment(writer, idempotency_key=key)
    rb.close()
    return keys


def _key_rows(path: Path) -> np.ndarray:
    with h5py.File(path, "r") as f:
        return f[f"{REPLAY}/commit_keys"][:WINDOW]


def _set_key_row(path: Path, slot: int, row: np.ndarray) -> None:
    with h5py.File(path, "r+") as f:
        f[f"{REPLAY}/commit_keys"][slot] = row


def _retry(rb: ReplayBuffer, key: bytes, value: float) -> tuple[int, int, int]:
    """Commit 3 rows with `key`, as a client's retry does; the receipt."""
    writer = rb.open_segment_writer()
    writer.extend(rows(3, value))
    return tuple(rb.commit_segment(writer, idempotency_key=key))  # type: ignore[return-value]


def test_a_torn_key_row_is_dropped_and_no_retry_gets_another_episodes_receipt(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "rb.h5"
    keys = _keyed(path)
    table = _key_rows(path)
    torn = table[1].copy()  # episode 5's row, slot 1 ...
    torn[:2] = np.frombuffer(keys[1], dtype="<i8")  # ... whose key half is still episode 1's (the slot's old row)
    _set_key_row(path, 1, torn)
    with caplog.at_level(logging.WARNING, "h5replay.storage"), open_as(path, "writer") as rb:
        assert "1 damaged idempotency key rows (slots [1])" in caplog.text
        # Episode 1 left the window long ago: its retry commits it again, not "episode 5".
        assert rb.receipt_for(keys[1]) is None and _retry(rb, keys[1], 0.1) == (6, 18, 3)
        # Episode 5's key was in the torn row: forgotten, so its retry is stored again (the cost
        # of the damage); every other key is remembered.
        assert rb.receipt_for(keys[5]) is None
        assert [rb.receipt_for(k) for k in keys[3:5]] == [(3, 9, 3), (4, 12, 3)]
    with open_as(path, "reader") as rb:  # what export copies: the keys of intact rows only
        assert sorted(r.episode_id for _, r in rb.idempotency_keys()) == [3, 4, 6]


def test_a_key_row_with_a_flipped_bit_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / "rb.h5"
    keys = _keyed(path)
    table = _key_rows(path)
    table[0, 3] ^= 1 << 3  # episode 4's first row id: 12 -> 4, rows of episodes 1 and 2
    _set_key_row(path, 0, table[0])
    with open_as(path, "writer") as rb:
        assert rb.receipt_for(keys[4]) is None
        assert _retry(rb, keys[4], 0.4) == (6, 18, 3)


def test_a_key_row_in_another_episodes_slot_is_dropped(tmp_path: Path) -> None:
    """A whole row, its CRC intact, written to the wrong slot (a misdirected write): it names
    episode 2 with episode 2's key, but the rows of episode 3. Slot 2 still holds episode 2's
    true row; the misplaced one, read after it, must not replace it."""
    path = tmp_path / "rb.h5"
    keys = _keyed(path)
    table = _key_rows(path)
    misplaced = table[2].copy()
    misplaced[3] = 9  # episode 3's first row id
    misplaced[5] = zlib.crc32(misplaced[:5].tobytes())
    _set_key_row(path, 3, misplaced)
    with open_as(path, "writer") as rb:
        assert rb.receipt_for(keys[2]) == (2, 6, 3)
        assert rb.receipt_for(keys[3]) is None  # its row was overwritten by the misplaced one


# ------------------------------------------------------------------------------ priorities


def _prioritized(path: Path) -> None:
    """Rows 0..9 committed with priority 1; then rows 0 and 1 updated to 5 and 7, logged and
    published but not checkpointed (the log holds them, the priorities dataset does not)."""
    rb = ReplayBuffer.create(SPACE, 16, path, sampler=Prioritized(1.0, 1.0))
    writer = rb.open_segment_writer()
    writer.extend(rows(10), priorities=np.ones(10))
    rb.commit_segment(writer)
    rb.update_priorities(np.array([0, 1]), np.array([5.0, 7.0]))
    rb.close()
    assert ReplayBuffer.load_from(path).published.tables[0].pckpt == 0


def _damage_log_entry(path: Path, row_id: int, value: float, update: int = 1) -> None:
    """Overwrite the log entry of update `update` (by default the last: row 1's)."""
    entry = np.array([row_id, np.float64(value).view(np.int64)], dtype=np.int64)
    overwrite(path, byte_offset(path, f"{TABLE}/priority_log", update), entry.tobytes())


@pytest.mark.parametrize("how", OPENS)
@pytest.mark.parametrize(("row_id", "value"), [(1, np.nan), (1, -3.0), (1, np.inf), (-5, 9.0), (12, 9.0),
                                               (1 << 40, 9.0)],
                         ids=["NaN", "negative", "infinite", "negative row id", "row not held", "row id 2**40"])
def test_a_damaged_priority_log_entry_is_never_applied(tmp_path: Path, how: str, row_id: int, value: float) -> None:
    path = tmp_path / "rb.h5"
    _prioritized(path)
    _damage_log_entry(path, row_id, value)
    with open_as(path, how) as rb:
        priorities = rb._sampling.priorities
        assert priorities is not None
        assert priorities[:10].tolist() == [5.0, 1.0] + [1.0] * 8  # row 1 kept the priority it had
        assert rb._sampling.tree.total == pytest.approx(5.0 + 1.0 + 8.0)
        _, info = rb.sample(64, np.random.default_rng(0), with_info=True)
        assert np.all(np.isfinite(info.probabilities)) and np.all(info.probabilities > 0)
        if how == "writer":
            rb.update_priorities(np.array([1]), np.array([2.0]))  # and it takes new updates as before
            assert rb.priorities(np.array([0, 1])).tolist() == [5.0, 2.0]


@pytest.mark.parametrize("how", OPENS)
def test_a_damaged_stored_priority_is_replaced_by_the_default(tmp_path: Path, how: str) -> None:
    path = tmp_path / "rb.h5"
    _prioritized(path)
    with h5py.File(path, "r+") as f:
        f[f"{TABLE}/priorities"][2:4] = [-1.0, np.inf]  # rows 2 and 3, checkpointed values gone bad
    with open_as(path, how) as rb:
        assert rb._sampling.tree.get(np.arange(4)).tolist() == [5.0, 7.0, 1.0, 1.0]  # the default, 1
        assert rb._sampling.tree.total == pytest.approx(5.0 + 7.0 + 8.0)


# ---------------------------------------------------------------------------- episode records


def _wrapped(path: Path) -> None:
    """5 episodes of 4 rows in a ring of 16: rows [4, 20) held, episodes 1..4 ([4, 8) ... [16, 20))."""
    rb = ReplayBuffer.create(SPACE, 16, path)
    for e in range(5):
        rb.extend(rows(4, e / 10))
        rb.end_episode()
        rb.flush()
    assert (rb.published.begin, rb.published.end, rb.published.ep_begin) == (4, 20, 1)
    rb.close()


RECORDS = {  # episode -> (first row id, length) written into its slot
    "past the rows held": (3, (12, 18)),
    "empty": (3, (12, 0)),
    "overlapping the one before": (3, (10, 4)),
    "without a row held": (1, (0, 3)),
    "before the first row": (1, (-2, 8)),
}


@pytest.mark.parametrize("how", OPENS)
@pytest.mark.parametrize("damage", list(RECORDS))
def test_an_episode_record_out_of_range_refuses_the_file(tmp_path: Path, damage: str, how: str) -> None:
    path = tmp_path / "rb.h5"
    _wrapped(path)
    episode, record = RECORDS[damage]
    with h5py.File(path, "r+") as f:
        f[f"{REPLAY}/episodes"][episode % 16] = record
    with pytest.raises(StorageError, match=f"impossible episode record {episode}"):
        open_as(path, how).close()



# ------------------------------------------------------------------------------ a file cut short


@pytest.mark.parametrize("cut", [16 * 1024, 64 * 1024, 200 * 1024])
def test_export_of_a_file_cut_short_keeps_the_longest_readable_run_of_whole_episodes(
        tmp_path: Path, cut: int, caplog: pytest.LogCaptureFixture) -> None:
    from h5replay.storage.export import export_file

    path = tmp_path / "cut.h5"
    rb = ReplayBuffer.create(BoxSpace(-1, 1, (64,)), 5000, path, multiprocessing=True, chunks=True)
    for e in range(40):  # 50 rows an episode, each row holding its episode's number
        writer = rb.open_segment_writer()
        writer.extend(np.full((50, 64), e / 100, np.float32))
        rb.commit_segment(writer)
    rb.close()
    os.truncate(path, os.path.getsize(path) - cut)
    with pytest.raises(StorageError, match="shorter than its HDF5 superblock records"):
        ReplayBuffer.load_from(path, read_only=False)
    with caplog.at_level(logging.WARNING, "h5replay.storage"):
        export_file(path, tmp_path / "copy.h5")
    assert "is cut short: the copy keeps" in caplog.text
    with ReplayBuffer.load_from(tmp_path / "copy.h5") as copy:
        episodes = copy.episodes()
        first = episodes[0].episode_id
        assert 0 < len(episodes) < 40 and [e.episode_id for e in episodes] == list(range(first, first + len(episodes)))
        assert first == 0  # the older episodes lie before the cut; the newest ones were in it
        assert all(e.first_row_id == 50 * e.episode_id and e.length == 50 for e in episodes)
        values = copy.get_at(slice(None))
        expected = np.repeat(np.arange(first, first + len(episodes), dtype=np.float32) / np.float32(100), 50)
        np.testing.assert_array_equal(values[:, 0], expected)


@pytest.mark.parametrize(("cut", "kept"), [(64 * 1024, (11, 24)), (200 * 1024, (30, 39))])
def test_export_of_a_wrapped_ring_cut_short_keeps_its_longest_readable_run(
        tmp_path: Path, cut: int, kept: tuple[int, int]) -> None:
    """2000 rows in a ring of 1500: the file's last bytes hold the first pass's newest slots,
    rows of the middle of what is held. With 64 KiB missing, rows [1250, 1500) are lost: the run
    before them (727 rows, from episode 10's tail) is longer than the one after (500); with
    200 KiB missing, [700, 1500) are lost and the newest run wins."""
    from h5replay.storage.export import export_file

    path = tmp_path / "cut.h5"
    rb = ReplayBuffer.create(BoxSpace(-1, 1, (64,)), 1500, path, multiprocessing=True, chunks=True)
    for e in range(40):
        writer = rb.open_segment_writer()
        writer.extend(np.full((50, 64), e / 100, np.float32))
        rb.commit_segment(writer)
    rb.close()
    os.truncate(path, os.path.getsize(path) - cut)
    export_file(path, tmp_path / "copy.h5")
    with ReplayBuffer.load_from(tmp_path / "copy.h5") as copy:
        episodes = copy.episodes()
        assert (episodes[0].episode_id, episodes[-1].episode_id) == kept
        assert all(e.first_row_id == 50 * e.episode_id and e.length == 50 for e in episodes)
        rows = copy.get_rows(np.arange(50 * kept[0], 50 * kept[1] + 50))
        expected = np.repeat(np.arange(kept[0], kept[1] + 1, dtype=np.float32) / np.float32(100), 50)
        np.testing.assert_array_equal(rows[:, 0], expected)
