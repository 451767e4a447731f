"""Sampling state across processes: SWMR readers follow the writer's priorities through the
priority log (incrementally, across checkpoints, and by a full reload when they fall behind), and
a writer killed with SIGKILL leaves the priorities, counters and settings it last published."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from typing import Any

import numpy as np
import pytest

from h5replay.sampling import Fifo, Prioritized, RateLimit
from h5replay.storage import BoxSpace, ReplayBuffer
from h5replay.storage.replay import table_file as _sampling_file

SPACE = BoxSpace(0, 2**40, (), np.int64)
CTX = mp.get_context("spawn")
pytestmark = pytest.mark.timeout(120)


def follow_main(path: str, asks: Any, answers: Any) -> None:
    """A SWMR reader: for each (seq, ids) asked, wait for that publish and report what it sees."""
    rb = ReplayBuffer.load_from(path, read_only=True, multiprocessing=True)
    try:
        while (ask := asks.get(timeout=60)) is not None:
            seq, ids = ask
            while rb.view.seq < seq:
                rb.refresh()
            _, info = rb.sample(64, np.random.default_rng(seq), with_info=True)
            answers.put((rb.view.seq, rb.priorities(ids).tolist(), rb.info()["priority_sum"],
                         info.row_ids.tolist(), info.probabilities.tolist()))
    finally:
        rb.close()


def test_readers_follow_priority_updates_through_the_log(tmp_path: Any) -> None:
    path = os.path.join(tmp_path, "b.h5")
    saved = _sampling_file.LOG_ENTRIES
    _sampling_file.LOG_ENTRIES = 16  # checkpoints and overwritten log entries every few rounds
    try:
        rb = ReplayBuffer.create(SPACE, 50, path, sampler=Prioritized(exponent=0.5), multiprocessing=True)
    finally:
        _sampling_file.LOG_ENTRIES = saved
    asks, answers = CTX.Queue(), CTX.Queue()
    reader = CTX.Process(target=follow_main, args=(path, asks, answers))
    rng = np.random.default_rng(7)
    try:
        rb.extend(np.arange(30), priorities=rng.random(30) + 0.1)
        rb.flush()
        reader.start()
        checks = 0
        for round_ in range(40):
            # 1 to 30 updates a round: sometimes within the log, sometimes past a whole ring.
            n = int(rng.integers(1, 31))
            ids = rng.integers(rb.view.begin, rb.view.end, size=n)
            rb.update_priorities(ids, rng.random(n) * 10)
            if round_ % 3 == 0:
                rb.extend(np.arange(5), priorities=rng.random(5) + 0.1)  # the ring moves on
            rb.flush()
            if round_ % 2 == 1 and round_ % 5 != 0:
                continue  # the reader misses this publish and catches up on a later one
            held = np.arange(rb.view.begin, rb.view.end)
            asks.put((rb.view.seq, held))
            seq, priorities, total, drawn, probabilities = answers.get(timeout=60)
            assert seq == rb.view.seq
            expected = rb.priorities(held)
            assert np.array_equal(priorities, expected), f"round {round_}: the reader's priorities differ"
            assert total == pytest.approx(float((expected**0.5).sum()), rel=1e-9)
            weights = dict(zip(held.tolist(), (expected**0.5).tolist(), strict=True))
            assert probabilities == pytest.approx([weights[i] / total for i in drawn], rel=1e-9)
            checks += 1
        assert checks >= 20
        assert rb.info()["priority_updates"] > 40 * 16 // 4, "the log wrapped several times"
    finally:
        asks.put(None)
        reader.join(30)
        if reader.is_alive():
            reader.kill()
        rb.close()
    assert reader.exitcode == 0


def doomed_writer_main(path: str, out: Any) -> None:
    """Publish some priorities, counters and removals; then change more without publishing, and
    wait to be killed."""
    limit = RateLimit(min_size_to_sample=2, samples_per_insert=4.0, error_buffer=100.0)
    rb = ReplayBuffer.create(SPACE, 20, path, sampler=Prioritized(0.8), rate_limit=limit, multiprocessing=True)
    rb.extend(np.arange(10), priorities=np.arange(1.0, 11.0))
    rb.end_episode()
    rb.sample(7)
    rb.update_priorities([2, 3], [50.0, 60.0])
    rb.flush()
    out.put(("published", rb.priorities(np.arange(10)).tolist(), rb.info()["inserted"], rb.info()["sampled"]))
    rb.update_priorities([4], [99.0])  # never published
    rb.sample(3)
    rb.storage.flush()  # even flushed rows and log entries do not count until the state is published
    out.put(("unpublished", None, None, None))
    signal.pause()


def test_sigkill_keeps_what_was_published(tmp_path: Any) -> None:
    path = os.path.join(tmp_path, "b.h5")
    out = CTX.Queue()
    writer = CTX.Process(target=doomed_writer_main, args=(path, out))
    writer.start()
    try:
        _, published, inserted, sampled = out.get(timeout=60)
        assert out.get(timeout=60)[0] == "unpublished"
    finally:
        os.kill(writer.pid, signal.SIGKILL)  # type: ignore[arg-type]
        writer.join(30)
    with ReplayBuffer.load_from(path, read_only=False) as rb:
        assert rb.sampling.sampler == Prioritized(0.8)
        assert rb.sampling.rate_limit.samples_per_insert == 4.0
        assert rb.get_rows(np.arange(10)).tolist() == list(range(10))
        assert rb.priorities(np.arange(10)).tolist() == published
        assert (rb.info()["inserted"], rb.info()["sampled"]) == (inserted, sampled) == (10, 7)


def queue_writer_main(path: str, out: Any) -> None:
    rb = ReplayBuffer.create(SPACE, 8, path, sampler=Fifo(), max_times_sampled=1, multiprocessing=True)
    rb.extend(np.arange(6))
    rb.end_episode()
    taken = rb.sample(4).tolist()
    rb.flush()
    out.put(taken)
    rb.sample(2)  # consumed but never published: after a crash these are handed out again
    out.put("unpublished")
    signal.pause()


def test_a_killed_queue_hands_out_only_what_it_had_not_published_as_taken(tmp_path: Any) -> None:
    path = os.path.join(tmp_path, "q.h5")
    out = CTX.Queue()
    writer = CTX.Process(target=queue_writer_main, args=(path, out))
    writer.start()
    try:
        taken = out.get(timeout=60)
        assert out.get(timeout=60) == "unpublished"
    finally:
        os.kill(writer.pid, signal.SIGKILL)  # type: ignore[arg-type]
        writer.join(30)
    with ReplayBuffer.load_from(path, read_only=False) as rb:
        assert taken == [0, 1, 2, 3]
        assert rb.sample(2).tolist() == [4, 5], "rows consumed after the last publish come back (at least once)"
