"""A file replaced under a running server (issue 21, defect 12): after `mv other.h5 FILE` (a
restore from backup), a reader process started later (a crashed reader restarted, or a stuck one
replaced) opened FILE by name and served the other file's rows as this server's. A reader now
checks that it opened the very file the writer holds, and otherwise answers with a StorageError.

Real servers with reader processes on 127.0.0.1; the reader is SIGKILLed, as a crash would.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from fault_helpers import file_holders
from service_helpers import EPISODE_SPACE, episode_rows, server_config, wait_until

from h5replay.client import ActorClient, LearnerClient
from h5replay.config import ClientConfig
from h5replay.errors import ServerUnavailableError, StorageError
from h5replay.server import ServerProcess
from h5replay.storage import ReplayBuffer


@pytest.mark.timeout(120)
@pytest.mark.parametrize("readers", [1, 2], ids=["one-reader", "front-and-two-readers"])
def test_a_reader_restarted_after_the_file_was_replaced_never_serves_the_other_file(tmp_path, readers, capfd):
    path = tmp_path / "rb.h5"
    other = tmp_path / "backup.h5"
    with ReplayBuffer.create(EPISODE_SPACE, 1000, str(other)) as backup:  # another replay: actor 2's rows
        backup.extend(episode_rows(2, 0, 50))
        backup.end_episode()
    config = server_config(path, num_readers=readers)
    with ServerProcess(config, timeout=60) as server:
        with ActorClient(server.endpoint, timeout=10) as actor:
            actor.push_episode(episode_rows(1, 0, 50))
        assert wait_until(lambda: len(file_holders(server.pid, path)) == readers, timeout=10)
        pids = file_holders(server.pid, path)
        assert len(pids) == readers, pids
        # Over the socket: the reader processes are what this checks (a learner on the file's host
        # would draw from the file itself).
        with LearnerClient(config=ClientConfig(endpoint=server.endpoint, timeout=2, local_reads=False)) as learner:
            assert set(learner.sample(16)["actor"].tolist()) == {1}
            os.replace(other, path)  # `mv backup.h5 rb.h5` while the server runs
            for pid in pids:
                os.kill(pid, signal.SIGKILL)  # the writer restarts them: they open rb.h5 by its name
            refused: StorageError | None = None
            served: set[int] = set()
            deadline = time.monotonic() + 40
            while refused is None and time.monotonic() < deadline:
                try:
                    served |= set(learner.sample(16)["actor"].tolist())
                except StorageError as exc:
                    refused = exc
                except ServerUnavailableError:  # while no reader runs
                    time.sleep(0.1)
            assert served <= {1}, f"a reader served the other file's rows (actors {sorted(served)})"
            assert refused is not None, "no reader ever refused the replaced file"
            assert "no longer the file this server holds" in str(refused) and "restart the server" in str(refused)
        assert server.process.is_alive()
        with ActorClient(server.endpoint, timeout=10) as actor:  # the writer goes on with the file it holds
            assert actor.push_episode(episode_rows(1, 1, 5)).length == 5
    log = capfd.readouterr().err
    assert "no longer leads to the file this server holds" in log and "replaced" in log, log[-3000:]
