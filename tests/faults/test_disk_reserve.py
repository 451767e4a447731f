"""A disk that fills up under the server's free-space reserve (issue 14, case 5): new rows are
refused with DiskFullError before anything is written, reads go on, and writes resume by
themselves once space is freed. One actor can no longer stop every write.

The server runs `h5replay serve` on a small tmpfs mounted in a mount namespace of its own
(`unshare`, as root or in a user namespace), with a ballast file the test deletes through
/proc/<pid>/root to free space. No root and no namespaces: the test is skipped, saying why.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from fault_helpers import ping
from service_helpers import EPISODE_SPACE, endpoint, episode_rows, row_problems, server_config

from h5replay.client import ActorClient, LearnerClient
from h5replay.errors import DiskFullError, LimitExceededError

MB = 1 << 20


def _unshare(probe: Path) -> list[str] | None:
    """The unshare command that gives a mount namespace here (root's, or a user namespace), or None."""
    if shutil.which("unshare") is None:
        return None
    probe.mkdir(exist_ok=True)
    for prefix in (["unshare", "--mount", "--propagation", "private"], ["unshare", "--user", "--map-root-user", "--mount"]):
        done = subprocess.run([*prefix, "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)],
                              capture_output=True, timeout=30)
        if done.returncode == 0:
            return prefix
    return None


class SmallDisk:
    """`h5replay serve` on a tmpfs of `size_mb` holding a ballast of `ballast_mb`."""

    def __init__(self, tmp_path: Path, size_mb: int, ballast_mb: int, *serve_args: str) -> None:
        prefix = _unshare(tmp_path / "probe")
        if prefix is None:
            pytest.skip("needs a mount namespace (unshare, as root or with user namespaces) for a small file system")
        self.mount = tmp_path / "disk"
        self.mount.mkdir()
        space = tmp_path / "space.json"
        space.write_text(json.dumps(EPISODE_SPACE.to_json()))
        self.config = server_config(self.mount / "rb.h5", bind=endpoint(), read_bind=endpoint())
        serve = [sys.executable, "-m", "h5replay", "serve", str(self.mount / "rb.h5"), "--space", str(space),
                 "--capacity", "200000", "--bind", self.config.bind, "--read-bind", self.config.resolved_read_bind,
                 *serve_args]
        script = (f"mount -t tmpfs -o size={size_mb}m tmpfs {self.mount} && head -c {ballast_mb * MB} /dev/zero > "
                  f"{self.mount}/ballast && exec " + " ".join(f"'{a}'" for a in serve))
        self.log = tmp_path / "serve.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([*prefix, "sh", "-c", script], stdout=log, stderr=log)
        deadline = time.monotonic() + 60
        while not ping(self.config.bind):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the server did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.2)

    def free_space(self) -> None:
        """Delete the ballast, through the server's own view of its file system."""
        os.unlink(f"/proc/{self.proc.pid}/root{self.mount}/ballast")

    def close(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


@pytest.mark.timeout(180)
def test_a_full_disk_refuses_new_rows_and_resumes_once_space_is_freed(tmp_path):
    disk = SmallDisk(tmp_path, 40, 20, "--min-free-bytes", "8M", "--readers", "0")
    try:
        with ActorClient(disk.config.bind, timeout=20) as actor, ActorClient(disk.config.bind, timeout=20) as other, \
                LearnerClient(disk.config.bind, timeout=20) as learner:
            pending = other.segment()
            pending.extend(episode_rows(2, 0, 100))
            acked = 0
            refusal = None
            # 2000 rows of 80 bytes an episode: 12 MB of room before the reserve, of which the file's
            # first chunks (about 1 MiB a leaf) take 4.5 MB.
            for e in range(1000):
                try:
                    actor.push_episode(episode_rows(1, e, 2000))
                    acked += 1
                except DiskFullError as exc:
                    refusal = exc
                    break
            assert refusal is not None, "the disk never filled"
            assert "--min-free-bytes" in str(refusal) and "Reads go on" in str(refusal), refusal
            assert acked > 3
            # Reads go on, and what was committed is whole.
            assert len(learner.episodes()) == acked
            assert not row_problems(learner.sample(256))
            # An open segment is refused too: at an append (rows staged in memory may still fit),
            # and the client aborts it, as an episode cannot be committed with a gap; or at its
            # commit, and it stays open to be committed once there is room, or aborted. A push that
            # was refused never stays open: the caller holds only the episode.
            assert actor.info()["open_segments"] == 0
            with pytest.raises(DiskFullError):
                pending.extend(episode_rows(2, 0, 2000))
                pending.commit()
            pending.abort()  # a no-op when the client aborted it already
            assert actor.info()["open_segments"] == 0
            # Space comes back: writes resume without a restart.
            disk.free_space()
            time.sleep(0.2)
            receipt = actor.push_episode(episode_rows(1, 10_000, 2000))
            assert receipt.length == 2000
            info = actor.info()
            assert info["errors"] >= 1 and info["num_episodes"] == acked + 1
        assert "stopped writing after a failed write" not in disk.log.read_text()
    finally:
        code = disk.close()
    assert code == 0, disk.log.read_text()[-2000:]


@pytest.mark.timeout(120)
def test_a_segment_can_never_stage_more_rows_than_the_capacity(start_server):
    """Issue 14, case 5: a segment could stage rows without end (only rows per segment were
    limited), filling the disk for every actor. It is refused at the append that would pass the
    capacity now, before the rows take disk or memory."""
    server = start_server(capacity=5000)
    with ActorClient(server.endpoint, timeout=10) as actor:
        segment = actor.segment()
        segment.extend(episode_rows(1, 0, 4000))
        with pytest.raises(LimitExceededError, match="capacity of 5000"):
            segment.extend(episode_rows(1, 0, 1001))
            segment.commit()
        assert 4000 <= actor.info()["rows_in"] <= 5000  # the client sends its rows in batches
        assert actor.info()["open_segments"] == 0  # the client aborted the segment it could not finish
        assert actor.push_episode(episode_rows(1, 1, 100)).length == 100  # the server writes on
        with LearnerClient(server.endpoint, timeout=10) as learner:
            rows = learner.get(np.arange(100))
            assert not row_problems(rows)
