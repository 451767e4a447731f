"""A disk that fills up: writes fail with an error reply, reads go on, nothing committed is damaged.

The server runs in a child whose RLIMIT_FSIZE stops the file at a few megabytes, so HDF5's
writes fail with EFBIG ("File too large") exactly as they would with ENOSPC on a full disk (the
server ignores SIGXFSZ). Two runs are shared by the tests below: one where the writer serves
reads from the same HDF5 handle whose write failed and is then stopped by SIGTERM, one with
reader processes that ends with SIGKILL.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from fault_helpers import LimitedServer, read_file_state
from service_helpers import episode_rows, row_problems, server_config

from h5replay.client import ActorClient, LearnerClient
from h5replay.errors import H5ReplayError, StorageError
from h5replay.server import ServerProcess

# Two disk-full runs (module fixtures) serve every test here: one xdist worker runs them all.
pytestmark = pytest.mark.xdist_group("test_disk_full")

# Bytes the server's files may reach. The file's first chunks take about 4.5 MB (an SWMR file's
# uncompressed leaves come in chunks of about 1 MiB: one of obs, holding 16,384 rows, and the
# capacity's 200,000 rows of each int32 leaf); obs's second chunk starts after 82 episodes.
FSIZE = 5_000_000
EPISODE_ROWS = 200  # 16 kB an episode: the limit is hit after about 120
MAX_EPISODES = 1000


@dataclass
class DiskFullRun:
    """What one run saw; the tests below judge it."""

    path: Path
    acked: list[tuple[int, int, int]] = field(default_factory=list)  # (actor, episode, episode id)
    error: BaseException | None = None
    open_segment_outcome: str = ""
    info_after: dict = field(default_factory=dict)
    segments_after: list[tuple[int, int]] = field(default_factory=list)
    read_problems: list[str] = field(default_factory=list)
    later: list[str] = field(default_factory=list)  # outcome of each push after the first error
    exit_code: int | None = None
    ending: str = "sigterm"


def _outcome(call) -> str:
    try:
        call()
    except StorageError as exc:
        return f"StorageError: {exc}"
    except H5ReplayError as exc:
        return f"unexpected {type(exc).__name__}: {exc}"
    return "ok"


def _run(tmp_path: Path, readers: int, ending: str) -> DiskFullRun:
    run = DiskFullRun(tmp_path / "full.h5", ending=ending)
    config = server_config(run.path, capacity=200_000, num_readers=readers)
    server = LimitedServer(config, FSIZE)
    try:
        with ActorClient(server.endpoint, timeout=20) as actor, ActorClient(server.endpoint, timeout=20) as other, \
                LearnerClient(server.endpoint, timeout=20) as learner:
            pending = other.segment()  # open across the failure: its commit must fail cleanly or work
            pending.extend(episode_rows(2, 0, 100))
            for e in range(MAX_EPISODES):
                try:
                    receipt = actor.push_episode(episode_rows(1, e, EPISODE_ROWS))
                except H5ReplayError as exc:
                    run.error = exc
                    break
                run.acked.append((1, e, receipt.episode_id))
            run.open_segment_outcome = _outcome(pending.commit)
            if run.open_segment_outcome == "ok":
                run.acked.append((2, 0, pending.receipt.episode_id))
            # The server still answers: figures from the writer, rows from the readers (or the writer).
            run.info_after = actor.info()
            run.segments_after = learner.get_segments()
            run.read_problems += row_problems(learner.sample(256))
            for start, length in run.segments_after[:: max(1, len(run.segments_after) // 10)]:
                rows = learner.get(np.arange(start, start + length))
                run.read_problems += row_problems(rows)
            for episode in range(MAX_EPISODES, MAX_EPISODES + 3):
                def push(episode: int = episode) -> None:
                    run.acked.append((1, episode, actor.push_episode(episode_rows(1, episode, 10)).episode_id))

                run.later.append(_outcome(push))
            run.info_after["later_requests_ok"] = bool(actor.info())
    finally:
        if ending == "sigkill":
            server.kill()
        run.exit_code = server.stop(30)
    return run


@pytest.fixture(scope="module", params=[(0, "sigterm"), (1, "sigkill")],
                ids=["writer-reads-then-sigterm", "reader-processes-then-sigkill"])
def disk_full(request, tmp_path_factory) -> DiskFullRun:
    readers, ending = request.param
    return _run(tmp_path_factory.mktemp(f"full{readers}"), readers, ending)


@pytest.mark.timeout(120)
def test_a_full_disk_fails_the_commit_with_a_storage_error(disk_full):
    assert disk_full.error is not None, f"no write failed in {MAX_EPISODES} episodes: raise EPISODE_ROWS"
    assert isinstance(disk_full.error, StorageError), repr(disk_full.error)
    message = str(disk_full.error)
    assert "File too large" in message or "errno = 27" in message, message  # says why
    assert 50 <= len(disk_full.acked) < MAX_EPISODES
    # A commit open across the failure, and pushes after it, fail cleanly or work: never anything else.
    assert disk_full.open_segment_outcome == "ok" or disk_full.open_segment_outcome.startswith("StorageError")
    assert all(o == "ok" or o.startswith("StorageError") for o in disk_full.later), disk_full.later


@pytest.mark.timeout(120)
def test_after_the_failure_the_server_keeps_serving_reads(disk_full):
    info = disk_full.info_after
    assert info["later_requests_ok"]
    assert info["num_episodes"] == len(disk_full.acked) - sum(o == "ok" for o in disk_full.later)
    assert info["errors"] >= 1
    assert len(disk_full.segments_after) == info["num_episodes"]
    assert not disk_full.read_problems, disk_full.read_problems[:5]


@pytest.mark.timeout(120)
def test_every_acknowledged_episode_is_intact_in_the_file(disk_full):
    # An SWMR reader opens the file whatever its superblock says (see the xfail below).
    state = read_file_state(disk_full.path, max_len=EPISODE_ROWS)
    assert not state.problems, state.problems
    assert [(a, e) for a, e, _ in state.episodes] == [(a, e) for a, e, _ in sorted(disk_full.acked, key=lambda x: x[2])]
    assert state.first_id == 0


@pytest.mark.timeout(120)
def test_sigterm_after_a_failed_write_exits_loudly_without_touching_the_file(disk_full):
    """After a failed write the server refuses writes; on SIGTERM it leaves the file as its last commit
    published it (HDF5 would retry the failed write while closing) and exits 1, not by a crash."""
    if disk_full.ending != "sigterm":
        pytest.skip("this run ends with SIGKILL")
    assert disk_full.exit_code == 1


@pytest.mark.timeout(120)
def test_the_server_restarts_on_the_file_once_space_is_free(disk_full, tmp_path):
    path = tmp_path / "copy.h5"
    shutil.copyfile(disk_full.path, path)
    server = ServerProcess(server_config(path, capacity=200_000, num_readers=0), timeout=60)
    try:
        with ActorClient(server.endpoint, timeout=10) as actor:
            assert actor.info()["num_episodes"] == len(disk_full.acked)
            actor.push_episode(episode_rows(3, 0, 10))
    finally:
        assert server.stop(30) == 0
