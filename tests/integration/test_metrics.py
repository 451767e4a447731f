"""Prometheus metrics of a live server, scraped over HTTP on loopback."""

from __future__ import annotations

import socket
import urllib.request

import numpy as np
import pytest

from h5replay.client import ActorClient, LearnerClient
from h5replay.config import ClientConfig, ServerConfig
from h5replay.server import ServerProcess
from h5replay.storage import BoxSpace

pytest.importorskip("prometheus_client")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("h5replay_") and " " in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


@pytest.mark.timeout(60)
def test_metrics_follow_the_service(tmp_path):
    metrics_port = _free_port()  # an HTTP port: prometheus-client cannot report one it picked
    config = ServerConfig(
        path=str(tmp_path / "m.h5"), space=BoxSpace(0, 1, (4,)), capacity=1000,
        bind="tcp://127.0.0.1:0", read_bind="tcp://127.0.0.1:0", metrics_port=metrics_port,
    )
    server = ServerProcess(config)
    try:
        before = _scrape(metrics_port)
        assert before["h5replay_commits_total"] == 0 and before["h5replay_length"] == 0
        with ActorClient(server.endpoint, timeout=10) as actor:
            for _ in range(3):
                actor.push_episode(np.zeros((5, 4), np.float32))
            seg = actor.segment()
            seg.append(np.zeros(4, np.float32))
            seg._send_buffered()
            with LearnerClient(server.endpoint, timeout=10) as learner:
                learner.sample(7)  # on the file's host: drawn from the file by the learner itself
            wire = ClientConfig(endpoint=server.endpoint, timeout=10, local_reads=False)
            with LearnerClient(config=wire) as learner:
                learner.sample(2)  # rows sent over the socket
            after = _scrape(metrics_port)
            assert after["h5replay_commits_total"] == 3
            assert after["h5replay_rows_in_total"] == 16
            assert after["h5replay_length"] == 15 and after["h5replay_num_episodes"] == 3
            assert after["h5replay_open_segments"] == 1
            assert after["h5replay_rows_out_total"] == 2 and after["h5replay_rows_sampled_total"] == 2
            assert after["h5replay_file_bytes"] > 0
            assert after['h5replay_request_seconds_count{kind="push_episode"}'] == 3
            seg.abort()
        assert _scrape(metrics_port)["h5replay_aborts_total"] == 1
    finally:
        assert server.stop() == 0


@pytest.mark.timeout(60)
def test_metrics_report_each_table(tmp_path):
    from h5replay.sampling import Fifo, Table

    metrics_port = _free_port()
    config = ServerConfig(
        path=str(tmp_path / "m.h5"), space=BoxSpace(0, 1, (4,)), capacity=1000,
        bind="tcp://127.0.0.1:0", read_bind="tcp://127.0.0.1:0", metrics_port=metrics_port,
        tables={"replay": Table(), "queue": Table(Fifo(), max_times_sampled=1)},
    )
    server = ServerProcess(config)
    try:
        with ActorClient(server.endpoint, timeout=10) as actor, LearnerClient(server.endpoint, timeout=10) as learner:
            actor.push_episode(np.zeros((10, 4), np.float32))
            learner.sample(3, table="queue")
            learner.sample(5, table="replay")
        after = _scrape(metrics_port)
        assert after['h5replay_table_sampled_rows_total{table="queue"}'] == 3
        assert after['h5replay_table_sampleable_rows{table="queue"}'] == 7
        assert after['h5replay_table_sampleable_rows{table="replay"}'] == 10
    finally:
        server.stop()
