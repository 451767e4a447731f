"""A learner on the host of the server's file reads drawn rows from its own view of the file
(ClientConfig.local_reads, client/_local.py): the same draws and rows as over the socket, none of
them carried by it; no row a ring overwrote between the draw and the read; queues and rate limits
still carry their rows; a file that is not the server's is never read."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from service_helpers import EPISODE_SPACE, episode_rows, processes, row_problems

from h5replay import protocol as P
from h5replay.client import ActorClient, LearnerClient
from h5replay.client._local import LocalRows
from h5replay.config import ClientConfig
from h5replay.hosts import boot_id, describe_file, same_file
from h5replay.sampling import Fifo, Prioritized, RateLimit, SamplingConfig
from h5replay.storage import ReplayBuffer

SPAWN = mp.get_context("spawn")
pytestmark = pytest.mark.timeout(120)


def _wire(endpoint: str) -> LearnerClient:
    return LearnerClient(endpoint, config=ClientConfig(endpoint=endpoint, timeout=10.0, local_reads=False))


def _push(endpoint: str, episodes: int, length: int = 20, priorities: bool = False) -> None:
    with ActorClient(endpoint, timeout=10) as actor:
        for e in range(episodes):
            actor.push_episode(episode_rows(1, e, length),
                               priorities=np.arange(1, length + 1, dtype=np.float64) if priorities else None)


def _rows_sent(learner: Any) -> int:
    return int(learner.info()["rows_out"])


def test_a_learner_on_the_files_host_draws_on_the_server_and_reads_the_rows_itself(start_server: Any,
                                                                                  learner_of: Any) -> None:
    server = start_server()
    _push(server.endpoint, 20)
    with _wire(server.endpoint) as wire:
        expected, expected_info = wire.sample(256, seed=7, with_info=True)
        learner = learner_of(server.endpoint, timeout=10)
        before = _rows_sent(wire)
        batch, info = learner.sample(256, seed=7, with_info=True)
        for key in EPISODE_SPACE.keys():
            np.testing.assert_array_equal(batch[key], expected[key])
        np.testing.assert_array_equal(info.row_ids, expected_info.row_ids)
        np.testing.assert_array_equal(info.episode_ids, expected_info.episode_ids)
        stream = learner.batches(64, prefetch=8)
        for _ in range(10):
            assert not row_problems(next(stream))
        stream.close()
        assert _rows_sent(wire) == before, "no row travelled to the learner on the file's host"
        wire.sample(10)
        assert _rows_sent(wire) == before + 10, "the learner with local_reads=False gets its rows over the socket"


def test_a_prioritized_learner_on_the_host_sees_its_own_updates_in_the_next_draw(start_server: Any) -> None:
    server = start_server(sampling=SamplingConfig(Prioritized(exponent=1.0)))
    _push(server.endpoint, 4, length=5, priorities=True)
    with LearnerClient(server.endpoint, timeout=10) as learner:
        learner.update_priorities(np.arange(20), np.where(np.arange(20) % 5 == 4, 1.0, 0.0))
        batch, info = learner.sample(500, with_info=True)
        assert set(batch["step"].tolist()) == {4}, "read-your-writes: only the rows left with a priority"
        assert np.allclose(info.probabilities, 0.25)
        assert learner._state.local is not None and learner._state.local.num_read > 0


def test_queues_and_rate_limits_still_carry_their_rows(start_server: Any) -> None:
    queue = SamplingConfig(Fifo(), max_times_sampled=1)
    server = start_server("q.h5", sampling=queue)
    _push(server.endpoint, 5, length=10)
    with LearnerClient(server.endpoint, timeout=10) as learner:
        drawn = [learner.sample(10) for _ in range(4)]
        seen = {(e, s) for b in drawn for e, s in zip(b["episode"].tolist(), b["step"].tolist())}
        assert len(seen) == 40, "every row handed out once"
        local = learner._state.local
        assert local is not None and local.num_read == 0, "a consuming draw's rows travel with it"
    limited = start_server("r.h5", sampling=SamplingConfig(rate_limit=RateLimit(samples_per_insert=4.0,
                                                                                 min_size_to_sample=10,
                                                                                 error_buffer=200.0)))
    _push(limited.endpoint, 3, length=10)
    with LearnerClient(limited.endpoint, timeout=10) as learner:
        assert not row_problems(learner.sample(20))
        assert learner._state.local is not None and learner._state.local.num_read == 0


def _flood(endpoint: str, seconds: float) -> None:
    """Episodes of 7 to 29 steps, pushed without pause for `seconds` (the ring wraps many times)."""
    rng = np.random.default_rng(3)
    deadline = time.monotonic() + seconds
    with ActorClient(endpoint, timeout=10) as actor:
        e = 0
        while time.monotonic() < deadline:
            actor.push_episode(episode_rows(2, e, int(rng.integers(7, 30))))
            e += 1


def test_rows_the_ring_overwrites_while_a_learner_reads_them_are_never_returned(start_server: Any) -> None:
    """An actor wraps a ring of 256 rows over and over while the learner samples: every row the
    learner gets is whole, and its row id is the one its episode's first row id and step give (a
    row read from a slot overwritten since the draw would name another episode or step)."""
    server = start_server(capacity=256)
    _push(server.endpoint, 13)
    first_id: dict[tuple[int, int], int] = {}
    with processes() as procs, LearnerClient(server.endpoint, timeout=10) as learner:
        proc = SPAWN.Process(target=_flood, args=(server.endpoint, 4.0))
        proc.start()
        procs.append(proc)
        batches = 0
        deadline = time.monotonic() + 60
        while (proc.is_alive() or batches < 50) and time.monotonic() < deadline:
            batch, info = learner.sample(128, with_info=True)
            assert not row_problems(batch)
            for actor, episode, step, row_id in zip(batch["actor"].tolist(), batch["episode"].tolist(),
                                                    batch["step"].tolist(), info.row_ids.tolist()):
                assert first_id.setdefault((actor, episode), row_id - step) == row_id - step
            batches += 1
        proc.join(30)
        assert proc.exitcode == 0
        local = learner._state.local
        assert local is not None and local.usable and local.num_read > 0
        print(f"{batches} batches, {local.num_read} read from the file, {local.num_missed} drawn again")
        assert learner.info()["length"] <= 256


# ------------------------------------------------------------------ which file is read


def test_the_hello_names_the_file_and_only_that_very_file_on_this_host_is_read(tmp_path: Path) -> None:
    path = tmp_path / "a.h5"
    rb = ReplayBuffer.create(EPISODE_SPACE, 100, str(path), multiprocessing=True)
    try:
        st = os.stat(path)
        described = describe_file(str(path), st.st_dev, st.st_ino)
        assert described is not None and described["host"] == boot_id()
        assert same_file(described) == str(path)
        copy = tmp_path / "b.h5"
        shutil.copyfile(path, copy)
        assert same_file({**described, "path": str(copy)}) is None, "another file at the path named"
        assert same_file({**described, "host": "another-machine"}) is None
        assert same_file({**described, "path": str(tmp_path / "gone.h5")}) is None
        assert same_file({**described, "path": "a.h5"}) is None, "a relative path"
        assert same_file({**described, "path": "/tmp/\x00"}) is None
        assert same_file({**described, "inode": str(st.st_ino)}) is None
        assert same_file(None) is None and same_file([described]) is None
    finally:
        rb.close()


def _draw(server: Any, n: int) -> tuple[P.HelloReply, P.SampleReply]:
    """A hello of `server` and a draw of `n` rows as a reply without them (what a learner on the
    file's host gets), drawn over the socket by a learner that reads no file."""
    st = os.stat(server.config.path)
    with _wire(server.endpoint) as wire:
        _, info = wire.sample(n, with_info=True)
        v = wire._state.view
        hello = P.HelloReply(1, EPISODE_SPACE.to_json(), 100, 0, 0, "test", P.PROTOCOL_VERSION, P.Limits(),
                             "tcp://127.0.0.1:2", wire.replay_id, "instance", {"sampler": "Uniform"},
                             describe_file(server.config.path, st.st_dev, st.st_ino))
    assert v is not None
    return hello, P.SampleReply(1, v.seq, v.generation, v.begin, v.end, info.row_ids, info.episode_ids,
                                info.probabilities, {})


def test_a_file_that_is_not_the_servers_replay_is_given_up_and_never_read(start_server: Any) -> None:
    server = start_server()
    _push(server.endpoint, 2, length=10)
    hello, drawn = _draw(server, 4)
    assert LocalRows.of(hello, enabled=False) is None
    assert LocalRows.of(dataclasses.replace(hello, local_file=None), enabled=True) is None
    other = LocalRows.of(dataclasses.replace(hello, replay_id="another-replay"), enabled=True)
    assert other is not None and other.read(drawn) is None
    assert other.given_up is not None and "another-replay" in other.given_up
    other.close()
    mine = LocalRows.of(hello, enabled=True)
    assert mine is not None
    arrays = mine.read(drawn)
    assert arrays is not None and not row_problems(arrays) and mine.num_read == 1
    mine.close()
    mine.close()
    assert not mine.usable and mine.read(drawn) is None


def test_rows_evicted_since_the_draw_are_not_read_from_the_file(start_server: Any) -> None:
    server = start_server(capacity=64)
    _push(server.endpoint, 3, length=10)
    hello, drawn = _draw(server, 16)
    local = LocalRows.of(hello, enabled=True)
    assert local is not None
    with ActorClient(server.endpoint, timeout=10) as actor:
        for e in range(10, 19):  # 90 more rows: the first 30 leave the ring of 64
            actor.push_episode(episode_rows(1, e, 10))
    assert int(drawn.row_ids.min()) < 30
    assert local.read(drawn) is None and local.num_missed == 1 and local.usable
    _, fresh = _draw(server, 16)
    assert local.read(fresh) is not None and local.num_read == 1
    local.close()


def test_one_view_serves_every_learner_of_a_process_and_gives_way_to_the_callers_reader(start_server: Any) -> None:
    """HDF5 opens a file once per process (a second handle's reads go stale): the learners of a
    process share one view of the file, a reader the caller opens makes it close (the rows then
    travel), and a learner that starts beside the caller's reader opens none."""
    server = start_server(capacity=None)  # a growing file: its datasets are what a second handle breaks
    _push(server.endpoint, 10)
    first, second = LearnerClient(server.endpoint, timeout=10), LearnerClient(server.endpoint, timeout=10)
    try:
        with processes() as procs:
            proc = SPAWN.Process(target=_flood, args=(server.endpoint, 3.0))
            proc.start()
            procs.append(proc)
            rounds = 0
            while proc.is_alive() or rounds < 20:
                assert not row_problems(first.sample(64)) and not row_problems(second.sample(64))
                rounds += 1
            proc.join(30)
        assert first._state.local is not None and second._state.local is not None
        assert (first._state.local.num_read, second._state.local.num_read) == (rounds, rounds), \
            "every draw's rows read from the file, by both learners"
        assert first._state.local._view is second._state.local._view
        mine = ReplayBuffer.load_from(server.config.path, read_only=True, multiprocessing=True)
        try:
            assert first._state.local.given_up == "another reader of the file opened in this process"
            for _ in range(10):
                _push(server.endpoint, 1)
                assert not row_problems(first.sample(64))
                assert not row_problems(mine.sample(64))
            assert first._state.local.num_read == rounds, "the rows travel once the caller's reader is open"
            with LearnerClient(server.endpoint, timeout=10) as third:
                assert not row_problems(third.sample(64))
                assert third._state.local is not None and third._state.local.num_read == 0
                assert "another reader" in (third._state.local.given_up or "")
        finally:
            mine.close()
    finally:
        first.close()
        second.close()
