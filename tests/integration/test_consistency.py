"""Readers are exact under every interleaving of the writer's moves (issue 8).

A writer in this process commits, aborts, wraps the ring, clears, and fails commits on purpose
(a refused row write, a refused publish right after an eviction), while a reader process reads as
fast as it can through every read there is. Each row says who it is: its episode's uid, its step,
the episode's length, the generation it was written in, and the row id it must get. So the
reader can check every answer on its own, and the test checks the rest against the writer's log:

* every row returned belongs to an episode whose commit succeeded (never an aborted one, a failed
  one, or a torn one), and has the row id it was given;
* no batch mixes generations, and a batch's generation is the one its view reports;
* `episodes()` lists each episode once, in order, whole; windows never cross an episode.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import numpy as np
import pytest

from h5replay.errors import EvictedError, NotEnoughDataError, StorageError
from h5replay.storage import BoxSpace, DictSpace, ReplayBuffer
from h5replay.storage.replay import journal as _journal
from h5replay.storage.segment import SegmentWriter

SPACE = DictSpace({
    "uid": BoxSpace(0, 2**40, (), np.int64),
    "step": BoxSpace(0, 2**40, (), np.int64),
    "length": BoxSpace(0, 2**40, (), np.int64),
    "gen": BoxSpace(0, 2**40, (), np.int64),
    "row": BoxSpace(0, 2**62, (), np.int64),
    "pad": BoxSpace(-1, 1, (6,), np.float32),
})
WRITER_STEPS = 1500


def rows_of(uid: int, length: int, gen: int, first_row: int) -> dict[str, np.ndarray]:
    steps = np.arange(length, dtype=np.int64)
    return {
        "uid": np.full(length, uid, np.int64), "step": steps, "length": np.full(length, length, np.int64),
        "gen": np.full(length, gen, np.int64), "row": first_row + steps,
        "pad": np.full((length, 6), (uid % 7) / 7, np.float32),
    }


def batch_problems(batch: dict[str, np.ndarray], ids: np.ndarray | None, view_gen: int, where: str) -> list[str]:
    """What is wrong with one read's rows, judged from the rows alone."""
    out = []
    gens = np.unique(batch["gen"])
    if gens.size > 1:
        out.append(f"{where}: a batch mixes generations {gens.tolist()}")
    elif gens.size == 1 and int(gens[0]) != view_gen:
        out.append(f"{where}: rows of generation {int(gens[0])} in a read of generation {view_gen}")
    if np.any(batch["step"] >= batch["length"]):
        out.append(f"{where}: a row's step is past its episode's length")
    if np.any(batch["pad"][..., 0] != ((batch["uid"] % 7) / 7).astype(np.float32)):
        out.append(f"{where}: a row's payload does not match its episode")
    if ids is not None and not np.array_equal(batch["row"].reshape(-1), ids.reshape(-1).astype(np.int64)):
        out.append(f"{where}: rows came back under other row ids")
    return out


def reader_main(path: str, ready: Any, stop: Any, out: Any, seed: int) -> None:
    rb = ReplayBuffer.load_from(path, read_only=True, multiprocessing=True)
    rng = np.random.default_rng(seed)
    problems: list[str] = []
    seen: set[int] = set()
    gens: set[int] = set()
    reads = 0
    last_ids = np.zeros(0, np.int64)
    ready.set()
    while not stop.is_set() and len(problems) < 20:
        op = int(rng.integers(0, 5))
        try:
            if op == 0:
                batch, info = rb.sample(48, rng, with_info=True)
                problems += batch_problems(batch, info.row_ids, rb.last_view.generation, "sample")
                last_ids = info.row_ids.astype(np.int64)
                firsts = batch["row"] - batch["step"]
                ep = info.episode_ids.astype(np.int64)
                # rows of one episode id share one uid
                for e in np.unique(ep):
                    if np.unique(batch["uid"][ep == e]).size != 1 or np.unique(firsts[ep == e]).size != 1:
                        problems.append("sample: one episode id covers rows of several episodes")
            elif op == 1:
                batch, ids = rb.get_at_with_ids(slice(None))
                problems += batch_problems(batch, ids, rb.last_view.generation, "get_at(:)")
            elif op == 2:
                length = int(rng.integers(1, 6))
                batch, info = rb.sample_sequences(8, length, rng, with_info=True)
                problems += batch_problems(batch, None, rb.last_view.generation, "sample_sequences")
                same = np.all(batch["uid"] == batch["uid"][:, :1]) and np.all(np.diff(batch["step"], axis=1) == 1)
                if not same:
                    problems.append("sample_sequences: a window crosses an episode or skips a step")
                if not np.array_equal(batch["row"][:, 0], info.row_ids.astype(np.int64)):
                    problems.append("sample_sequences: windows came back under other row ids")
            elif op == 3:
                episodes = rb.episodes()
                view_gen = rb.last_view.generation
                ids = [e.episode_id for e in episodes]
                if ids != sorted(set(ids)) or any(a.first_row_id + a.length > b.first_row_id
                                                  for a, b in zip(episodes, episodes[1:])):
                    problems.append(f"episodes(): out of order, overlapping or repeated: {episodes[:5]}")
                if episodes:
                    e = episodes[int(rng.integers(0, len(episodes)))]
                    try:
                        rows = rb.get_rows(np.arange(e.first_row_id, e.first_row_id + e.length))
                    except EvictedError:
                        rows = None
                    if rows is not None and rb.last_view.generation == view_gen:
                        problems += batch_problems(rows, np.arange(e.first_row_id, e.first_row_id + e.length),
                                                   rb.last_view.generation, "episode rows")
                        if (np.unique(rows["uid"]).size != 1 or rows["step"].tolist() != list(range(e.length))
                                or int(rows["length"][0]) != e.length):
                            problems.append(f"episode {e} came back torn")
            else:
                batch = rb.get_rows(last_ids)
                problems += batch_problems(batch, last_ids, rb.last_view.generation, "get_rows")
                batch = {"uid": batch["uid"], "gen": batch["gen"]}
            seen.update(np.unique(batch["uid"]).tolist())
            gens.update(np.unique(batch["gen"]).tolist())
            reads += 1
        except (NotEnoughDataError, EvictedError):
            continue
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
            problems.append(f"{type(exc).__name__}: {exc}")
    out.put((problems, sorted(seen), reads, sorted(gens)))
    rb.close()


def run_writer(rb: ReplayBuffer, seed: int, monkeypatch: pytest.MonkeyPatch) -> tuple[set[int], set[int], int]:
    """Random moves; returns (uids committed, uids never to be seen, failures injected)."""
    rng = np.random.default_rng(seed)
    committed: set[int] = set()
    invisible: set[int] = set()
    failures = 0
    real_commit = SegmentWriter.commit
    real_publish = _journal.Journal.publish
    for uid in range(WRITER_STEPS):
        action = rng.choice(["commit", "abort", "clear", "fail_rows", "fail_publish"], p=[0.8, 0.07, 0.02, 0.06, 0.05])
        if action == "clear":
            rb.clear()
            continue
        length = int(rng.integers(1, 30))
        writer = rb.open_segment_writer()
        writer.extend(rows_of(uid, length, rb.view.generation, rb.view.end))
        if action == "abort":
            writer.abort()
            invisible.add(uid)
            continue
        if action == "fail_rows":  # the rows cannot be written: nothing of the episode appears
            def refuse(self: SegmentWriter, start: int) -> None:
                raise StorageError("injected: the disk refused the rows")
            monkeypatch.setattr(SegmentWriter, "commit", refuse)
        elif action == "fail_publish":  # the rows are written, the state row is not
            def refuse_publish(self: _journal.Journal, state: _journal.State, fsync: bool = False) -> None:
                raise StorageError("injected: the state row could not be written")
            monkeypatch.setattr(_journal.Journal, "publish", refuse_publish)
        try:
            rb.commit_segment(writer)
            committed.add(uid)
        except StorageError:
            failures += 1
            invisible.add(uid)
        finally:
            monkeypatch.setattr(SegmentWriter, "commit", real_commit)
            monkeypatch.setattr(_journal.Journal, "publish", real_publish)
    return committed, invisible, failures


@pytest.mark.timeout(180)
@pytest.mark.parametrize("capacity", [200, None])  # a ring that wraps and clears; a file that shrinks on clear
def test_readers_are_exact_under_random_interleavings(tmp_path, monkeypatch, capacity):
    path = str(tmp_path / "rb.h5")
    rb = ReplayBuffer.create(SPACE, capacity, path, multiprocessing=True)
    ctx = mp.get_context("spawn")
    ready, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=reader_main, args=(path, ready, stop, out, 7))
    proc.start()
    try:
        assert ready.wait(30), "the reader did not start"
        committed, invisible, failures = run_writer(rb, 11, monkeypatch)
        stop.set()
        problems, seen, reads, gens = out.get(timeout=60)
        proc.join(10)
    finally:
        stop.set()
        if proc.is_alive():
            proc.kill()
        rb.close()
    assert problems == []
    assert failures > 10 and reads > 100, (failures, reads)
    assert len(gens) > 1, "the reader should have read across clear()s"
    assert set(seen) <= committed, f"rows of episodes that were never committed: {sorted(set(seen) & invisible)[:10]}"
    # What the file holds at the end is exactly the writer's view, ids included.
    again = ReplayBuffer.load_from(path)
    try:
        batch, ids = again.get_at_with_ids(slice(None))
        assert batch_problems(batch, ids, again.view.generation, "reopened") == []
        assert set(batch["uid"].tolist()) <= committed
        for e in again.episodes():
            rows = again.get_rows(np.arange(e.first_row_id, e.first_row_id + e.length))
            assert rows["step"].tolist() == list(range(e.length)) and np.unique(rows["uid"]).size == 1
    finally:
        again.close()



def _commands_main(path: str, inbox: Any, done: Any) -> None:
    """A writer process: creates the file, then commits as many 1-row episodes as each command says."""
    rb = ReplayBuffer.create(SPACE, 16, path, multiprocessing=True)
    uid = 0
    try:
        done.put("ready")
        while (count := inbox.get(timeout=60)) is not None:
            for _ in range(count):
                rb.extend(rows_of(uid, 1, 0, uid))
                rb.end_episode()
                uid += 1
            rb.flush()
            done.put(uid)
    finally:
        rb.close()


@pytest.mark.timeout(60)
def test_a_reader_descheduled_while_the_writer_reuses_episode_record_slots_syncs_to_the_newer_state(tmp_path):
    """The episode table is a ring of `capacity` slots: a reader that read the published state
    and then read the records after the writer committed that many more episodes finds newer
    episodes in their slots. It used to call the file damaged ("impossible episode record"; seen
    once under load in the interleaving test); it now syncs to the newer state."""
    path = str(tmp_path / "rb.h5")
    inbox, done = mp.get_context("spawn").Queue(), mp.get_context("spawn").Queue()
    writer = mp.get_context("spawn").Process(target=_commands_main, args=(path, inbox, done))
    writer.start()
    try:
        assert done.get(timeout=60) == "ready"
        inbox.put(4)
        assert done.get(timeout=60) == 4
        with ReplayBuffer.load_from(path, read_only=True, multiprocessing=True) as rb:
            assert len(rb) == 4
            inbox.put(2)
            assert done.get(timeout=60) == 6
            journal = rb._journal
            real_read = journal.read
            stale = real_read()  # the state with 6 episodes, as a reader about to be descheduled reads it
            inbox.put(40)  # meanwhile: 40 more episodes, through every one of the 16 record slots
            assert done.get(timeout=60) == 46
            reads = iter([stale])
            journal.read = lambda: next(reads, None) or real_read()  # type: ignore[method-assign]
            rb.refresh()
            assert len(rb) == 16 and [e.episode_id for e in rb.episodes()] == list(range(30, 46))
            assert rb.get_rows(np.arange(30, 46))["uid"].tolist() == list(range(30, 46))
    finally:
        inbox.put(None)
        writer.join(30)
        if writer.is_alive():
            writer.kill()
