"""A server's identity survives its own maintenance (issue 21, defect 6): `h5replay compact` keeps
the replay id, the publish count and how often each row was sampled, so live clients go on as if
the server had only restarted: a learner's reads, a sharded learner's shard, an actor's home."""

from __future__ import annotations

import time

import numpy as np
import pytest
from service_helpers import episode_rows
from shard_helpers import running_shards

from h5replay.cli import main
from h5replay.client import ActorClient, LearnerClient
from h5replay.client._shards import home_shard
from h5replay.config import ClientConfig
from h5replay.sampling import Lifo, SamplingConfig

pytestmark = pytest.mark.timeout(120)


def _name_homed_on(shard: int, num_shards: int) -> str:
    return next(f"actor-{k}" for k in range(1000) if home_shard(f"actor-{k}", num_shards) == shard)


def test_live_clients_go_on_after_a_shard_is_compacted(tmp_path):
    with running_shards(tmp_path, 2) as shards:
        eps = shards.endpoints
        config = ClientConfig(timeout=2.0, shard_retry_interval=0.2)
        name = _name_homed_on(0, 2)
        with ActorClient(config=ClientConfig(timeout=2.0, shard_retry_interval=0.2, name=name), endpoints=eps) as actor, \
                LearnerClient(config=config, endpoints=eps) as learner, \
                LearnerClient(eps[0], timeout=5.0) as single:
            for k in range(30):  # many publishes on shard 0
                actor.push_episode(episode_rows(1, k, 5))
            assert actor.shard == 0
            assert len(learner) == 150 and len(single) == 150
            before = single.view
            shards.stop(0)
            assert main(["compact", shards.paths[0]]) == 0
            shards.start(0)
            # The single-server learner's next read is from the compacted file: not refused as older.
            assert len(single.get(np.arange(5))["step"]) == 5
            assert single.view is not None and before is not None and single.view.seq >= before.seq
            # The sharded clients take the shard back (same replay), and the actor goes home.
            deadline = time.monotonic() + 30
            while learner.shards is not None and learner.shards.live_shards != [0, 1] or actor.shard != 0:
                assert time.monotonic() < deadline, "the compacted shard was never used again"
                learner.sample(4)
                actor.push_episode(episode_rows(2, 0, 2))
                time.sleep(0.05)
            assert len(learner) >= 150


def test_a_compacted_queue_hands_out_no_row_twice(tmp_path, start_server):
    # Lifo takes the newest rows: what it removed lies in the ring past rows still held, and the
    # copy keeps it removed (it used to start every row's count at 0: they came back).
    queue = SamplingConfig(Lifo(), max_times_sampled=1)
    server = start_server("q.h5", capacity=1000, sampling=queue)
    with ActorClient(server.endpoint, timeout=10) as actor:
        actor.push_episode(episode_rows(1, 0, 50))
    config = ClientConfig(endpoint=server.endpoint, timeout=10.0, name="l", rate_limit_timeout=0.5)
    with LearnerClient(config=config) as learner:
        first = learner.sample(20)["step"].tolist()
    server.stop()
    assert main(["compact", str(tmp_path / "q.h5")]) == 0
    again = start_server("q.h5", capacity=1000)
    config = ClientConfig(endpoint=again.endpoint, timeout=10.0, name="l", rate_limit_timeout=0.5)
    with LearnerClient(config=config) as learner:
        rest = learner.sample(30)["step"].tolist()
        assert first + rest == list(range(49, -1, -1))
        assert learner.info()["sampleable"] == 0
