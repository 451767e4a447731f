"""A draw that changes state is a transaction (issue 21): queue rows (fifo, max_times_sampled=1)
and rate-limited samples are never dropped on the way, whatever splits, routes or outlives the
request: a batch split over several messages, shards that cannot give their share, a learner
that dies while its sample waits."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import pytest
from service_helpers import episode_rows, processes, wait_until

from h5replay.client import ActorClient, LearnerClient
from h5replay.config import ClientConfig
from h5replay.sampling import Fifo, SamplingConfig

SPAWN = mp.get_context("spawn")
pytestmark = pytest.mark.timeout(120)
QUEUE = SamplingConfig(Fifo(), max_times_sampled=1)


def waiting_learner_main(endpoint: str, rows: int) -> None:
    """Ask a queue for `rows` rows and wait for them (killed by the test meanwhile)."""
    config = ClientConfig(endpoint=endpoint, timeout=10.0, name="doomed", rate_limit_timeout=60.0)
    with LearnerClient(config=config) as learner:
        learner.sample(rows)


def test_a_learner_that_dies_while_its_sample_waits_takes_no_row(start_server: Any) -> None:
    server = start_server(capacity=1000, sampling=QUEUE, heartbeat_interval=0.2)
    with LearnerClient(server.endpoint, timeout=10) as watcher, processes() as procs:
        doomed = SPAWN.Process(target=waiting_learner_main, args=(server.endpoint, 10))
        procs.append(doomed)
        doomed.start()
        assert wait_until(lambda: watcher.info()["waiting_samples"] == 1, 30), "the sample never waited"
        doomed.kill()
        doomed.join(10)
        # The server notices the connection is gone (its next liveness probe fails) and drops
        # what the departed client had waiting.
        assert wait_until(lambda: watcher.info()["waiting_samples"] == 0, 10), "a dead client's sample still waits"
    with ActorClient(server.endpoint, timeout=10) as actor:
        actor.push_episode(episode_rows(1, 0, 10))
    config = ClientConfig(endpoint=server.endpoint, timeout=10.0, name="heir", rate_limit_timeout=10.0)
    with LearnerClient(config=config) as learner:
        batch = learner.sample(10)
        assert batch["step"].tolist() == list(range(10)), "rows went to a learner that had died"
        assert learner.info()["sampled"] == 10
