"""Clients over several real servers on loopback: where actors write, what learners read.

No Ray here: the routing is the client's (h5replay.client._shards). Failover under SIGKILL is in
tests/faults/test_shard_failover.py.
"""

from __future__ import annotations

import logging
import math
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from service_helpers import EPISODE_SPACE, episode_problems, episode_rows, row_problems, server_config
from shard_helpers import episodes_by_shard, running_shards

from h5replay.client import ActorClient, InDoubt, LearnerClient
from h5replay.client._shards import home_shard
from h5replay.config import ClientConfig
from h5replay.errors import CommitInDoubtError, ConfigError, NotEnoughDataError, ServerUnavailableError
from h5replay.records import SampleInfo, pack_ids, unpack_ids
from h5replay.server import ServerProcess
from h5replay.storage import BoxSpace, DictSpace

pytestmark = pytest.mark.timeout(120)


def fill(endpoints: list[str], shard: int, actor: int, lengths: list[int]) -> None:
    """Episodes of `lengths` rows, written to `shard` alone (an actor given that one endpoint)."""
    with ActorClient(endpoints[shard], timeout=10) as client:
        for e, n in enumerate(lengths):
            client.push_episode(episode_rows(actor, e, n))


def test_home_shard_is_a_stable_hash_of_the_name():
    # BLAKE2b, not the salted hash(): the same in every process, on every machine, forever.
    assert [home_shard(f"actor-{i}", 3) for i in range(8)] == [home_shard(f"actor-{i}", 3) for i in range(8)]
    assert home_shard("actor-0", 3) == 0 and home_shard("actor-1", 3) == 0 and home_shard("actor-5", 4) == 3
    spread = np.bincount([home_shard(f"actor-{i}", 4) for i in range(400)], minlength=4)
    assert spread.min() > 60, spread
    # Names that differ in a counter spread too (crc32's low bits are linear in the name's bits: 45%
    # of these pids sent all 8 hosts to one of 2 shards; a well-mixed hash, about 1 in 128).
    one_shard = sum(len({home_shard(f"actor-3f9c{k:08x}-{pid}", 2) for k in range(8)}) == 1 for pid in range(2000))
    assert one_shard < 60, one_shard


def test_packed_ids_round_trip_and_shard_zero_is_the_plain_id():
    shards, ids = np.array([0, 1, 7, 65535]), np.array([5, 0, 2**48 - 1, 123], dtype=np.uint64)
    packed = pack_ids(shards, ids)
    assert packed.dtype == np.uint64 and int(packed[0]) == 5 and int(packed[1]) == 1 << 48
    back_shards, back_ids = unpack_ids(packed)
    assert back_shards.tolist() == shards.tolist() and back_ids.tolist() == ids.tolist()
    with pytest.raises(ValueError, match="48 bits"):
        pack_ids(0, 2**48)
    with pytest.raises(ValueError, match="shard indices"):
        pack_ids(65536, 0)
    info = SampleInfo(np.array([3, 4], np.uint64), np.zeros(2, np.uint64), np.ones(2))
    assert info.shard_ids.tolist() == [0, 0] and info.packed_row_ids.tolist() == [3, 4]
    assert info.concatenate(info).shard_ids.tolist() == [0, 0, 0, 0]


def test_actors_write_to_their_home_shard_and_learners_read_every_shard(tmp_path, fronts):
    with running_shards(tmp_path, 3) as shards:
        eps = shards.endpoints
        written = {}
        for actor in range(8):  # homes 0, 0, 2, 0, 0, 0, 1, 1: every shard gets some
            name = f"actor-{actor}"
            with fronts.actor(endpoints=eps, timeout=10, name=name) as client:
                assert client.shard == home_shard(name, 3)
                assert client.space == EPISODE_SPACE
                for e in range(3):
                    n = 5 + actor + e
                    if e == 1:
                        with client.segment() as seg:
                            seg.extend(episode_rows(actor, e, n))
                        receipt = seg.receipt
                        assert seg.shard == client.shard and seg.in_doubt_on is None
                    else:
                        receipt = client.push_episode(episode_rows(actor, e, n))
                    written[(actor, e)] = (client.shard, receipt)
                assert client.info()["shard"] == client.shard
                assert client.push_episode(episode_rows(actor, 9, 0)) == (-1, -1, 0)
                assert client.in_doubt == []

        with fronts.learner(endpoints=eps, timeout=10) as learner:
            total = sum(r.length for _, r in written.values())
            assert len(learner) == total
            info = learner.info()
            assert info["length"] == total and info["num_episodes"] == len(written) and info["num_shards"] == 3
            assert [s["length"] for s in info["shards"]] == [
                sum(r.length for s, r in written.values() if s == k) for k in range(3)]
            assert info["live_shards"] == [0, 1, 2] and info["skipped"] == [0, 0, 0]

            # episodes(): packed ids, each reading back exactly its episode.
            episodes = learner.episodes()
            assert len(episodes) == len(written)
            for ep in episodes:
                shard, first = unpack_ids([ep.first_row_id])
                rows = learner.get_rows(pack_ids(shard[0], first[0] + np.arange(ep.length)))
                assert episode_problems(rows, ep.length) == []
                key = (int(rows["actor"][0]), int(rows["episode"][0]))
                assert written[key][0] == int(shard[0])
                assert written[key][1].first_row_id == int(first[0]) and written[key][1].episode_id == int(
                    unpack_ids([ep.episode_id])[1][0])

            # sample with info: rows from every shard, read back by packed ids and by pairs.
            batch, sinfo = learner.sample(500, seed=1, with_info=True)
            assert row_problems(batch) == []
            assert set(sinfo.shard_ids.tolist()) == {0, 1, 2}
            assert np.allclose(sinfo.probabilities, 1 / total)
            again = learner.get_rows(sinfo.packed_row_ids)
            pairs = learner.get_rows(np.stack([sinfo.shard_ids, sinfo.row_ids.astype(np.int64)], axis=1))
            for key in batch:
                assert np.array_equal(again[key], batch[key]) and np.array_equal(pairs[key], batch[key])
            for shard in range(3):  # each row is where the info says
                mask = sinfo.shard_ids == shard
                assert {written[(a, e)][0] for a, e in zip(batch["actor"][mask], batch["episode"][mask])} == {shard}

            windows, winfo = learner.sample_sequences(40, 5, seed=2, with_info=True)
            assert windows["step"].shape == (40, 5) and np.all(np.diff(windows["step"], axis=1) == 1)
            assert len(winfo) == 40 and set(winfo.shard_ids.tolist()) <= {0, 1, 2}
            with pytest.raises(NotEnoughDataError):
                learner.sample_sequences(4, 1000)
            with pytest.raises(NotImplementedError, match="get_rows"):
                learner.get([0])
            with pytest.raises(NotImplementedError, match="episodes"):
                learner.get_segments()
            with pytest.raises(IndexError, match="shard 5 does not exist"):
                learner.get_rows(pack_ids(5, 0)[None])
            with pytest.raises(TypeError, match="integers"):
                learner.get_rows(np.array([0.5]))
            assert learner.shards is not None and learner.shards.shard(1).replay_id
            assert learner.capacity == 3 * 10_000


def test_sampling_follows_shard_lengths(tmp_path, learner_of):
    """Rows are drawn uniformly from the union: each shard's share of a batch follows its share of
    the rows held (a binomial test at a fixed seed, 5 sigma), and every row is equally likely."""
    with running_shards(tmp_path, 3) as shards:
        eps = shards.endpoints
        fill(eps, 0, 0, [100] * 10)   # 1000 rows
        fill(eps, 1, 1, [100] * 30)   # 3000 rows
        fill(eps, 2, 2, [50] * 2)     # 100 rows
        with learner_of(endpoints=eps, timeout=10) as learner:
            counts = np.zeros(3)
            rows_seen = []
            for k in range(20):
                _, info = learner.sample(1000, seed=100 + k, with_info=True)
                counts += np.bincount(info.shard_ids, minlength=3)
                rows_seen.append(info.packed_row_ids)
                assert np.allclose(info.probabilities, 1 / 4100)
            n, expected = counts.sum(), np.array([1000, 3000, 100]) / 4100
            for shard in range(3):
                sigma = math.sqrt(n * expected[shard] * (1 - expected[shard]))
                assert abs(counts[shard] - n * expected[shard]) < 5 * sigma, (shard, counts, n * expected)
            # Within the union, uniform: a chi-square over the rows of shard 1 (3000 cells).
            ids = np.concatenate(rows_seen)
            shard_of, local = unpack_ids(ids)
            per_row = np.bincount(local[shard_of == 1].astype(np.int64), minlength=3000)
            mean = per_row.mean()
            chi2 = float(((per_row - mean) ** 2 / mean).sum())
            assert abs(chi2 - 2999) < 5 * math.sqrt(2 * 2999), chi2
            # The same seed draws the same batch.
            a, ia = learner.sample(64, seed=7, with_info=True)
            b, ib = learner.sample(64, seed=7, with_info=True)
            assert np.array_equal(ia.packed_row_ids, ib.packed_row_ids) and np.array_equal(a["obs"], b["obs"])


def test_shards_must_hold_the_same_space_and_be_listed_once(tmp_path, fronts):
    other = DictSpace({"x": BoxSpace(-1, 1, (3,))})
    with running_shards(tmp_path, 2) as shards, \
            ServerProcess(server_config(tmp_path / "other.h5", space=other), timeout=60) as odd:
        for cls in (fronts.actor, fronts.learner):
            with pytest.raises(ConfigError, match="every shard must hold the same space"):
                cls(endpoints=[*shards.endpoints, odd.endpoint], timeout=10)
            # The same server under two names is the same replay (replay_id), not two shards.
            port = shards.endpoints[0].rpartition(":")[2]
            with pytest.raises(ConfigError, match="serve the same replay"):
                cls(endpoints=[shards.endpoints[0], f"tcp://localhost:{port}"], timeout=10)
            with pytest.raises(ConfigError, match="more than once"):
                cls(endpoints=[shards.endpoints[0]] * 2, timeout=10)
            with pytest.raises(ConfigError, match="empty"):
                cls(endpoints=[], timeout=10)


def test_a_down_shard_is_skipped_with_a_warning_and_counted_and_comes_back(tmp_path, caplog, learner_of):
    with running_shards(tmp_path, 2) as shards:
        eps = shards.endpoints
        fill(eps, 0, 0, [10] * 3)
        fill(eps, 1, 1, [10] * 5)
        # Over the socket: a killed shard is found at its next request (a learner on the file's host
        # draws from the file and notices within CONFIRM_INTERVAL: test_local_reads.py).
        config = ClientConfig(timeout=2.0, shard_retry_interval=0.3, local_reads=False)
        with learner_of(config=config, endpoints=eps) as learner:
            assert len(learner) == 80
            shards.kill(1)
            with caplog.at_level(logging.WARNING, logger="h5replay.client"):
                batch, info = learner.sample(64, seed=3, with_info=True)
            assert set(info.shard_ids.tolist()) == {0} and set(batch["actor"].tolist()) == {0}
            assert any("shard 1" in r.getMessage() and "unavailable" in r.getMessage() for r in caplog.records)
            assert learner.shards is not None and learner.shards.live_shards == [0]
            assert len(learner) == 30
            assert learner.info()["skipped"][1] >= 1
            assert learner.shards.num_skipped[1] >= 2
            with pytest.raises(ServerUnavailableError, match="shard 1"):
                learner.get_rows(pack_ids(1, np.arange(3)))
            # Starts again on the same file: found again by the background probe.
            shards.start(1)
            deadline = time.monotonic() + 30
            while learner.shards.live_shards != [0, 1]:
                assert time.monotonic() < deadline, "the restarted shard was never used again"
                learner.sample(8)
                time.sleep(0.1)
            assert len(learner) == 80
            assert set(learner.sample(400, seed=4, with_info=True)[1].shard_ids.tolist()) == {0, 1}
            # All down: ServerUnavailableError, at once.
            shards.kill(0)
            shards.kill(1)
            with pytest.raises(ServerUnavailableError):
                learner.sample(8)
            with pytest.raises(ServerUnavailableError, match="all 2 shards are unavailable"):
                learner.sample(8)
        with pytest.raises(ServerUnavailableError, match="none of the 2 shards answered"):
            learner_of(endpoints=eps, timeout=0.5)
        with pytest.raises(ServerUnavailableError, match="none of the 2 shards answered"):
            ActorClient(endpoints=eps, timeout=0.5)


def test_a_single_endpoint_list_behaves_like_one_server(tmp_path, fronts):
    with running_shards(tmp_path, 1) as shards:
        with fronts.actor(endpoints=shards.endpoints, timeout=10, name="solo") as actor:
            receipt = actor.push_episode(episode_rows(0, 0, 12))
        with fronts.learner(endpoints=shards.endpoints, timeout=10) as learner, \
                LearnerClient(shards.endpoints[0], timeout=10) as plain:
            _, info = learner.sample(32, seed=1, with_info=True)
            _, plain_info = plain.sample(32, seed=1, with_info=True)
            assert info.shard_ids.tolist() == [0] * 32 and plain_info.shard_ids.tolist() == [0] * 32
            # Packed ids of shard 0 are plain ids: the same call works on both clients.
            ids = receipt.first_row_id + np.arange(12)
            assert np.array_equal(learner.get_rows(ids)["obs"], plain.get_rows(ids)["obs"])
            assert learner.episodes() == plain.episodes()


def test_an_actor_goes_home_between_episodes_while_an_open_one_finishes_where_it_is(tmp_path, actor_of):
    """Home down: the actor writes to the next shard; home back: the push sent to the dead home is
    settled there, new episodes go home, while a segment still open on the other shard finishes
    there (its connection closes once it is done)."""
    name = "returning-actor"
    with running_shards(tmp_path, 2) as shards:
        home = home_shard(name, 2)
        away = 1 - home
        config = ClientConfig(timeout=1.0, shard_retry_interval=0.2, name=name, batch_seconds=0.01)
        with actor_of(config=config, endpoints=shards.endpoints) as actor:
            assert actor.shard == home
            actor.push_episode(episode_rows(0, 0, 5))
            shards.kill(home)
            started = time.monotonic()
            # Sent to the dead home, the push may have landed there as far as the actor can tell:
            # it keeps the episode, to settle it there, and moves on.
            with pytest.raises(CommitInDoubtError) as raised:
                actor.push_episode(episode_rows(0, 1, 5))
            assert time.monotonic() - started < 10
            open_there = actor.segment()
            open_there.extend(episode_rows(0, 2, 300))  # streamed to the other shard, left open
            assert actor.shard == away
            shards.start(home)
            deadline = time.monotonic() + 30
            while actor.shard != home:
                assert time.monotonic() < deadline, "never went home"
                actor.push_episode(episode_rows(0, 9, 1))
                time.sleep(0.1)
            with actor.segment() as seg:  # a new episode goes home...
                seg.extend(episode_rows(0, 3, 7))
            assert seg.shard == home
            open_there.extend(episode_rows(0, 2, 300))  # ...while the open one finishes where it is
            receipt = open_there.commit()
            assert open_there.shard == away and receipt.length == 600
            # Settled on home once it answered, before anything else went there.
            assert actor.in_doubt == [InDoubt(raised.value.key, home, 5, (1, 5, 5))]
            assert actor._router is not None
            actor.push_episode(episode_rows(0, 4, 2))
            assert actor._router.shards[away].client is None  # its connection closed once idle
        for i in range(2):
            assert shards.stop(i) == 0
    held = {(s, e) for s, a, e in episodes_by_shard(shards.paths)[0] if e != 9}
    assert held == {(home, 0), (home, 1), (away, 2), (home, 3), (home, 4)}


def test_one_actor_may_keep_several_segments_open(tmp_path, fronts):
    with running_shards(tmp_path, 2) as shards:
        with fronts.actor(endpoints=shards.endpoints, timeout=10, name="many") as actor:
            segs = [actor.segment() for _ in range(3)]
            for k, seg in enumerate(segs):
                seg.extend(episode_rows(1, k, 10 + k))
            receipts = [seg.commit() for seg in reversed(segs)]
            assert [r.length for r in receipts] == [12, 11, 10]
        with fronts.learner(endpoints=shards.endpoints, timeout=10) as learner:
            assert len(learner) == 33 and len(learner.episodes()) == 3


def test_importing_h5replay_never_imports_ray():
    code = ("import sys, h5replay, h5replay.client, h5replay.cli, h5replay.integrations, h5replay.server; "
            "sys.exit('ray' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_nested_and_text_leaves_merge_across_shards_without_truncation(tmp_path, learner_of):
    """Text decodes to str arrays as wide as each shard's longest: the merged batch takes the widest."""
    from h5replay.storage import TextSpace

    space = DictSpace({"note": TextSpace(max_length=32), "pos": {"xy": BoxSpace(-10, 10, (2,), np.float32)}})
    with running_shards(tmp_path, 2, space=space) as shards:
        for shard, note in ((0, "a"), (1, "a much longer note")):
            with ActorClient(shards.endpoints[shard], timeout=10) as actor:
                actor.push_episode({"note": [note] * 20, "pos": {"xy": np.full((20, 2), shard, np.float32)}})
        with learner_of(endpoints=shards.endpoints, timeout=10) as learner:
            batch, info = learner.sample(200, seed=5, with_info=True)
            assert set(info.shard_ids.tolist()) == {0, 1}
            expected = np.where(info.shard_ids == 0, "a", "a much longer note")
            assert list(batch["note"]) == list(expected)
            assert np.all(batch["pos"]["xy"][:, 0] == info.shard_ids)


def test_actors_in_containers_with_the_same_pid_spread_over_the_shards_by_default(tmp_path, monkeypatch, actor_of):
    """The containers of one compose service run their actor under the same pid: the default name
    (which picks the home shard) must tell them apart, or they all write to one shard."""
    with running_shards(tmp_path, 2) as shards:
        names, homes = set(), set()
        for host in (f"3f9c{k:08x}" for k in range(16)):  # container ids as hostnames, one pid
            monkeypatch.setattr(socket, "gethostname", lambda host=host: host)
            with actor_of(endpoints=shards.endpoints, timeout=10) as actor:
                assert host in actor.config.name
                names.add(actor.config.name)
                homes.add(actor.shard)
        assert len(names) == 16 and homes == {0, 1}


@pytest.mark.parametrize("timeout", [-1, float("nan"), "5", True])
def test_settle_refuses_a_timeout_that_is_not_seconds(tmp_path, timeout, actor_of):
    with running_shards(tmp_path, 2) as shards:
        with actor_of(endpoints=shards.endpoints, timeout=10, name="settler") as actor:
            actor.push_episode(episode_rows(0, 0, 3))
            with pytest.raises(ConfigError, match="settle's timeout must be a number of seconds"):
                actor.settle(timeout)
            assert actor.settle(0) == [] and actor.in_doubt == []


def test_commits_in_flight_and_push_episodes_over_shards_are_waited_for_and_kept_in_order(tmp_path, actor_of):
    # Over several servers every commit is waited for (its shard may change under it): wait=False
    # gives a done PendingCommit, so code written for one server runs unchanged.
    with running_shards(tmp_path, 2) as shards:
        with actor_of(endpoints=shards.endpoints, timeout=10, name="actor-inflight") as actor:
            pending = actor.push_episode(episode_rows(1, 0, 4), wait=False)
            assert pending.done() and pending.result().length == 4
            receipts = actor.push_episodes([episode_rows(1, 1, 2), episode_rows(1, 2, 0), episode_rows(1, 3, 3)])
            assert [r.length for r in receipts] == [2, 0, 3]
            seg = actor.segment()
            seg.extend(episode_rows(1, 4, 5))
            later = seg.commit(wait=False)
            assert later.done() and later.result().length == 5
            actor.flush()
        found, problems = episodes_by_shard(shards.paths)
    assert not problems
    assert [episode for _, _, episode in found] == [0, 1, 3, 4]
