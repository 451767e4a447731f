"""SIGKILL a writer at the two moments of a publish that carry priorities, and reopen the file.

The priorities and the running maximum priority must come back exactly as of the last publish
the file shows: every update that publish counts, none it does not (docs/guarantees.md: a kill loses the
updates applied since the last publish, and nothing of an earlier one). Each child process holds
the buffer as an SWMR writer, arms a kill at that moment (a monkeypatch in the child: the real
code runs up to there, its writes reach the file, then the process SIGKILLs itself), and the
test reads the file as a new SWMR reader would (a full load), then reopens it as its next writer.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from service_helpers import SPAWN

from h5replay.sampling import Prioritized
from h5replay.storage import BoxSpace, ReplayBuffer
from h5replay.storage.replay import table_file as _sampling_file
from h5replay.storage.replay.table import Sampling

pytestmark = pytest.mark.timeout(60)

SPACE = BoxSpace(0, 2**40, (), np.int64)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _run_child(target: Any, path: str) -> int:
    """Run `target(path, seq)` in a child until it kills itself; the seq it set (shared memory,
    written at once: a queue's feeder thread could die with the child before sending)."""
    seq = SPAWN.Value("q", -1)
    child = SPAWN.Process(target=target, args=(path, seq))
    child.start()
    try:
        child.join(30)
        assert child.exitcode == -signal.SIGKILL, f"the child ended with {child.exitcode}, not at the armed kill"
        return int(seq.value)
    finally:
        if child.is_alive():
            child.kill()
            child.join(10)


def _reads(path: str, ids: list[int]) -> list[tuple[int, list[float], float | None]]:
    """(seq, priorities of `ids`, running maximum) as a new SWMR reader sees them, then as the
    next writer does (which recovers the file)."""
    seen: list[Any] = []
    with ReplayBuffer.load_from(path, read_only=True, multiprocessing=True) as reader:
        seen.append((reader.published.seq, reader.priorities(ids).tolist(), None))
    with ReplayBuffer.load_from(path, read_only=False, multiprocessing=True) as writer:
        seen.append((writer.published.seq, writer.priorities(ids).tolist(), writer.info()["max_priority"]))
    return seen


# ------------------------------------------------------------------ a checkpoint, then the kill


def _checkpoint_then_die(path: str, seq: Any) -> None:
    """Publish two updates, apply two more (one call each) without publishing, then make an
    update whose log entries need a checkpoint first: killed right after the checkpoint wrote
    the priorities dataset (and HDF5 flushed it to the file)."""
    buffer = ReplayBuffer.load_from(path, read_only=False, multiprocessing=True)
    buffer.update_priorities([0, 1], [5.0, 6.0])
    buffer.flush()
    seq.value = buffer.published.seq
    buffer.update_priorities([2], [7.0])
    buffer.update_priorities([3, 3, 3, 3], [8.0] * 4)  # 7 entries in a log of 8: the next needs a checkpoint
    checkpoint = Sampling.checkpoint

    def checkpoint_then_die(self: Sampling) -> None:
        checkpoint(self)
        buffer.storage.flush()
        _die()

    Sampling.checkpoint = checkpoint_then_die  # type: ignore[method-assign]
    buffer.update_priorities([0, 0], [9.0, 9.0])


def test_a_kill_after_a_priority_checkpoint_recovers_no_update_that_no_publish_counts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoint used to copy every applied priority into the file before the publish that
    counts them: a kill in between gave the reopened buffer, and any reader's full load, the
    updates of rows 2 and 3 that no publish had. Now the file holds either the publish before
    the checkpoint (without them) or one that counts them, and its priorities are exactly that."""
    path = str(tmp_path / "rb.h5")
    monkeypatch.setattr(_sampling_file, "LOG_ENTRIES", 8)  # the file keeps the log it is made with
    with ReplayBuffer.create(SPACE, 16, path, sampler=Prioritized(exponent=1.0), multiprocessing=True) as buffer:
        buffer.extend(np.arange(4), priorities=[1.0] * 4)
        buffer.end_episode()
    flushed = _run_child(_checkpoint_then_die, path)
    # What each publish the file may show counts: the flush's, or one publishing rows 2 and 3's updates.
    expected = {flushed: ([5.0, 6.0, 1.0, 1.0], 6.0), flushed + 1: ([5.0, 6.0, 7.0, 8.0], 8.0)}
    for seq, priorities, maximum in _reads(path, [0, 1, 2, 3]):
        assert seq in expected, f"the file shows publish {seq}, after the flush's {flushed}"
        assert priorities == expected[seq][0], f"publish {seq} shows priorities {priorities}"
        assert maximum in (None, expected[seq][1])


# ------------------------------------------------------------------ a publish cut short


def _raise_max_then_die(path: str, seq: Any) -> None:
    """Publish a running maximum of 50, raise it to 60 without publishing, then die in the
    publish that would carry 60: after its log entries and maximum were written (and flushed),
    before its state row."""
    buffer = ReplayBuffer.load_from(path, read_only=False, multiprocessing=True)
    buffer.update_priorities([0], [50.0])
    buffer.flush()
    seq.value = buffer.published.seq
    buffer.update_priorities([0, 1], [60.0, 2.0])
    journal, storage = buffer._journal, buffer.storage

    def publish_then_die(state: object, fsync: bool = False) -> None:
        journal.write_records()  # type: ignore[union-attr]
        storage.flush()
        _die()

    journal.publish = publish_then_die  # type: ignore[method-assign, union-attr]
    buffer.flush()


def test_an_unpublished_running_maximum_never_leaks_into_the_file(tmp_path: Path) -> None:
    """The running maximum (the default of a row committed without a priority) comes back as of
    the last publish: 50, not the 60 of the publish the kill cut short, also once the next writer
    has published under the same seq the dead one was making; and it outlives every row that
    held it."""
    path = str(tmp_path / "rb.h5")
    with ReplayBuffer.create(SPACE, 16, path, sampler=Prioritized(exponent=1.0), multiprocessing=True) as buffer:
        buffer.extend(np.arange(2), priorities=[1.0, 1.0])
        buffer.end_episode()
    flushed = _run_child(_raise_max_then_die, path)
    for seq, priorities, maximum in _reads(path, [0, 1]):
        assert (seq, priorities, maximum) in ((flushed, [50.0, 1.0], None), (flushed, [50.0, 1.0], 50.0))
    with ReplayBuffer.load_from(path, read_only=False) as buffer:
        buffer.update_priorities([0], [3.0])  # 50 is held no more
        buffer.flush()
        assert buffer.published.seq > flushed  # at the seq the dead writer's publish had, or past it
    with ReplayBuffer.load_from(path, read_only=False) as buffer:
        assert buffer.info()["max_priority"] == 50.0
        buffer.append(np.int64(2))
        buffer.end_episode()
        assert buffer.priorities([0, 1, 2]).tolist() == [3.0, 1.0, 50.0]
