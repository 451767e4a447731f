"""A learner on the host of the server's file draws from its own view of the file
(ClientConfig.local_reads, client/_local.py): the same draws and rows as the server's with the same
seed (samples, windows, padded windows, transitions), none of them through the socket; no row the
ring overwrites while it reads; its own priority updates seen; queues and rate limits still drawn
by the server; a file that is not the one the server serves is never read; one view per process."""

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
from h5replay.client._local import CONFIRM_INTERVAL, LocalRows
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


def test_a_learner_on_the_files_host_draws_what_the_server_would_and_nothing_travels(start_server: Any,
                                                                                    learner_of: Any) -> None:
    server = start_server()
    _push(server.endpoint, 20)
    with _wire(server.endpoint) as wire:
        learner = learner_of(server.endpoint, timeout=10)
        for seed in (7, 8):
            expected, expected_info = wire.sample(256, seed=seed, with_info=True)
            batch, info = learner.sample(256, seed=seed, with_info=True)
            for key in EPISODE_SPACE.keys():
                np.testing.assert_array_equal(batch[key], expected[key])
            for field in ("row_ids", "episode_ids", "probabilities"):
                np.testing.assert_array_equal(getattr(info, field), getattr(expected_info, field))
        for pad in (False, True):
            expected, expected_info = wire.sample_sequences(16, 8, seed=3, with_info=True, pad=pad)
            batch, info = learner.sample_sequences(16, 8, seed=3, with_info=True, pad=pad)
            assert sorted(batch) == sorted(expected)
            for key in expected:
                np.testing.assert_array_equal(batch[key], expected[key])
            np.testing.assert_array_equal(info.row_ids, expected_info.row_ids)
        before = wire.info()
        stream = learner.batches(64, prefetch=8)
        for _ in range(10):
            assert not row_problems(next(stream))
        stream.close()
        assert not row_problems(learner.sample(100))
        after = wire.info()
        assert after["rows_out"] == before["rows_out"], "no row travelled to the learner on the file's host"
        assert after["rows_sampled"] == before["rows_sampled"], "nor did the server draw for it"
        wire.sample(10)
        assert wire.info()["rows_out"] == after["rows_out"] + 10, "local_reads=False: rows over the socket"


def test_transitions_drawn_on_the_files_host_are_the_servers(start_server: Any) -> None:
    from transition_helpers import SPACE as TRANSITION_SPACE
    from transition_helpers import episode as transition_episode

    server = start_server(space=TRANSITION_SPACE, capacity=1000, observation_keys=("obs",))
    with ActorClient(server.endpoint, timeout=10) as actor:
        first = 0
        for length, kind in ((10, "terminated"), (7, "truncated"), (5, "cut"), (12, "terminated")):
            rows, final = transition_episode(first, length, kind)
            actor.push_episode(rows, final=final)
            first += length
    with _wire(server.endpoint) as wire, LearnerClient(server.endpoint, timeout=10) as learner:
        expected, expected_info = wire.sample_transitions(200, n_step=3, gamma=0.9, seed=11, with_info=True)
        batch, info = learner.sample_transitions(200, n_step=3, gamma=0.9, seed=11, with_info=True)
        _assert_same_tree(batch, expected)
        np.testing.assert_array_equal(info.has_final, expected_info.has_final)
        assert learner._state.local is not None and learner._state.local.num_draws == 1


def _assert_same_tree(a: Any, b: Any) -> None:
    if isinstance(b, dict):
        assert sorted(a) == sorted(b)
        for key in b:
            _assert_same_tree(a[key], b[key])
    else:
        np.testing.assert_array_equal(a, b)


def test_a_prioritized_learner_on_the_host_sees_its_own_updates_in_the_next_draw(start_server: Any) -> None:
    server = start_server(sampling=SamplingConfig(Prioritized(exponent=1.0)))
    _push(server.endpoint, 4, length=5, priorities=True)
    with LearnerClient(server.endpoint, timeout=10) as learner:
        learner.update_priorities(np.arange(20), np.where(np.arange(20) % 5 == 4, 1.0, 0.0))
        batch, info = learner.sample(500, with_info=True)
        assert set(batch["step"].tolist()) == {4}, "read-your-writes: only the rows left with a priority"
        assert np.allclose(info.probabilities, 0.25)
        assert learner._state.local is not None and learner._state.local.num_draws > 0


def test_queues_and_rate_limits_still_carry_their_rows(start_server: Any) -> None:
    queue = SamplingConfig(Fifo(), max_times_sampled=1)
    server = start_server("q.h5", sampling=queue)
    _push(server.endpoint, 5, length=10)
    with LearnerClient(server.endpoint, timeout=10) as learner:
        drawn = [learner.sample(10) for _ in range(4)]
        seen = {(e, s) for b in drawn for e, s in zip(b["episode"].tolist(), b["step"].tolist())}
        assert len(seen) == 40, "every row handed out once"
        local = learner._state.local
        assert local is not None and local.num_draws == 0, "only the server's writer may draw from a queue"
    limited = start_server("r.h5", sampling=SamplingConfig(rate_limit=RateLimit(samples_per_insert=4.0,
                                                                                 min_size_to_sample=10,
                                                                                 error_buffer=200.0)))
    _push(limited.endpoint, 3, length=10)
    with LearnerClient(limited.endpoint, timeout=10) as learner:
        assert not row_problems(learner.sample(20))
        assert learner._state.local is not None and learner._state.local.num_draws == 0


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
    row read from a slot overwritten under the read would name another episode or step)."""
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
        assert local is not None and local.usable and local.num_draws == batches
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


def _hello_of(server: Any, replay_id: str | None = None) -> P.HelloReply:
    st = os.stat(server.config.path)
    with _wire(server.endpoint) as wire:
        return P.HelloReply(1, EPISODE_SPACE.to_json(), 100, 0, 0, "test", P.PROTOCOL_VERSION, P.Limits(),
                            "tcp://127.0.0.1:2", replay_id or wire.replay_id, "instance", {"sampler": "Uniform"},
                            describe_file(server.config.path, st.st_dev, st.st_ino))


def test_a_file_that_is_not_the_servers_replay_is_given_up_and_never_read(start_server: Any) -> None:
    server = start_server()
    _push(server.endpoint, 2, length=10)
    hello = _hello_of(server)
    assert LocalRows.of(hello, enabled=False) is None
    assert LocalRows.of(dataclasses.replace(hello, local_file=None), enabled=True) is None
    other = LocalRows.of(dataclasses.replace(hello, replay_id="another-replay"), enabled=True)
    assert other is not None
    with _wire(server.endpoint) as wire:
        other.confirm({**wire.info(), "replay_id": "another-replay"}, time.monotonic())
    assert other.draw("sample", 0, 4, np.random.default_rng(0)) is None
    assert other.given_up is not None and "another-replay" in other.given_up
    other.close()
    mine = LocalRows.of(hello, enabled=True)
    assert mine is not None
    assert mine.draw("sample", 0, 4, np.random.default_rng(0)) is None, "never before the server confirms the file"
    with _wire(server.endpoint) as wire:
        stats = wire.info()
    mine.confirm(stats, time.monotonic())
    drawn = mine.draw("sample", 0, 4, np.random.default_rng(0))
    assert drawn is not None and not row_problems(drawn[0]) and mine.num_draws == 1
    assert mine.draw("sample", 10**9, 4, np.random.default_rng(0)) is None, "a publish newer than the file shows"
    assert "older than" in (mine.given_up or "")
    mine.close()
    mine.close()
    assert not mine.usable and mine.draw("sample", 0, 4, np.random.default_rng(0)) is None


def test_a_server_restarted_on_another_file_is_noticed_within_a_second(start_server: Any, tmp_path: Path) -> None:
    """The learner stays connected while its endpoint comes back serving another file: within
    CONFIRM_INTERVAL it stops drawing from the first file, and reads the second one's rows."""
    from service_helpers import free_port

    port = free_port()
    first = start_server("a.h5", bind=f"tcp://127.0.0.1:{port}", num_readers=0)
    with ActorClient(first.endpoint, timeout=10) as actor:
        actor.push_episode(episode_rows(1, 0, 10))
    learner = LearnerClient(first.endpoint, timeout=10)
    try:
        assert set(learner.sample(32)["actor"].tolist()) == {1}
        first.stop()
        second = start_server("b.h5", bind=f"tcp://127.0.0.1:{port}", num_readers=0)
        with ActorClient(second.endpoint, timeout=10) as actor:
            actor.push_episode(episode_rows(2, 0, 10))
        time.sleep(CONFIRM_INTERVAL + 0.1)
        assert set(learner.sample(32)["actor"].tolist()) == {2}, "the rows of the file served now"
        assert "another file" in (learner._state.local.given_up or "")
    finally:
        learner.close()


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
        assert (first._state.local.num_draws, second._state.local.num_draws) == (rounds, rounds), \
            "every draw made from the file, by both learners"
        assert first._state.local._view is second._state.local._view
        mine = ReplayBuffer.load_from(server.config.path, read_only=True, multiprocessing=True)
        try:
            assert first._state.local.given_up == "another reader of the file opened in this process"
            for _ in range(10):
                _push(server.endpoint, 1)
                assert not row_problems(first.sample(64))
                assert not row_problems(mine.sample(64))
            assert first._state.local.num_draws == rounds, "draws travel once the caller's reader is open"
            with LearnerClient(server.endpoint, timeout=10) as third:
                assert not row_problems(third.sample(64))
                assert third._state.local is not None and third._state.local.num_draws == 0
                assert "another reader" in (third._state.local.given_up or "")
        finally:
            mine.close()
    finally:
        first.close()
        second.close()


def test_a_view_never_spans_two_writers_of_the_file(start_server: Any) -> None:
    """A writer SIGKILLed and restarted on the same file: the learner stops drawing from its view
    as the writer's lock goes (its draws then go to the server, which is down), and after the
    restart draws from a view opened afresh (one opened under the dead writer would read stale
    metadata once the next one recovers the file)."""
    from service_helpers import free_port

    from h5replay.errors import ServerUnavailableError

    port = free_port()
    server = start_server("k.h5", bind=f"tcp://127.0.0.1:{port}", num_readers=0)
    _push(server.endpoint, 3)
    learner = LearnerClient(config=ClientConfig(endpoint=server.endpoint, timeout=1.0))
    try:
        assert not row_problems(learner.sample(32))
        local = learner._state.local
        assert local is not None and local.num_draws == 1
        first_view = local._view
        server.kill()
        time.sleep(0.05)
        with pytest.raises(ServerUnavailableError):
            learner.sample(32)
        assert local.num_draws == 1, "no draw from the view once its writer was gone"
        again = start_server("k.h5", bind=f"tcp://127.0.0.1:{port}", num_readers=0)
        with ActorClient(again.endpoint, timeout=10) as actor:
            actor.push_episode(episode_rows(3, 0, 20))
        deadline = time.monotonic() + 30
        while True:
            try:
                batch = learner.sample(200)
                break
            except ServerUnavailableError:
                assert time.monotonic() < deadline
        assert not row_problems(batch) and 3 in set(batch["actor"].tolist())
        assert local.num_draws == 2 and local._view is not first_view, "drawn from a view opened afresh"
    finally:
        learner.close()
