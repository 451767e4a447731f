"""Resource exhaustion fails closed for the request or the connection, never for everyone (issue
21, defect 11).

A few hundred idle TCP connections (no handshake) to a `serve --auth` writer at a low descriptor
limit made the key reloader's listing fail with EMFILE, read as an empty directory: every key was
revoked, live sessions dropped, open segments aborted. At the same moment every connection whose
descriptor the guard could not duplicate became "unguarded" for good, free to stream without a
byte budget. Real servers in children with a low RLIMIT_NOFILE and real idle connections on
127.0.0.1; the key reloads also in process, with EMFILE and EACCES injected into the OS calls.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.auth
from fault_helpers import FewDescriptorsServer, file_holders
from service_helpers import episode_rows, server_config, wait_until

from h5replay.client import ActorClient, LearnerClient
from h5replay.errors import ServerUnavailableError
from h5replay.server import guard
from h5replay.server.auth import ACTOR, LEARNER, RoleAuthenticator, generate_keys

MB = 1 << 20


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    directory = tmp_path / "keys"
    generate_keys(directory)
    return directory


def keys_of(keys: Path, name: str) -> dict[str, Path]:
    return {"secret_key": keys / f"{name}.key_secret", "server_key": keys / "server.key"}


@contextlib.contextmanager
def idle_connections(endpoint: str, count: int) -> Iterator[list[socket.socket]]:
    """`count` TCP connections to a tcp:// endpoint that never say a word (a connect the server
    cannot accept any more waits in its backlog, or times out: skipped)."""
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    held: list[socket.socket] = []
    try:
        for _ in range(count):
            with contextlib.suppress(OSError):
                held.append(socket.create_connection((host, int(port)), timeout=0.5))
        yield held
    finally:
        for sock in held:
            sock.close()


def descriptors_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# ---------------------------------------------------------------- a real server out of descriptors


@pytest.mark.timeout(120)
@pytest.mark.parametrize("reserve", [None, 0], ids=["descriptors-kept-in-reserve", "descriptors-run-out"])
def test_idle_connections_at_a_low_descriptor_limit_revoke_no_key_and_drop_no_session(tmp_path, keys, reserve):
    """300 idle connections on each endpoint of a server limited to 256 descriptors. By default the
    guard cuts connections that would take the last descriptors (the server's own); with no reserve
    the descriptors run out for real, and the key reloads fail with EMFILE. Either way every key
    stays admitted: the actor's open segment commits, the learner reads, and once the idle
    connections are gone new clients come in."""
    config = server_config(tmp_path / "rb.h5", auth_dir=str(keys), num_readers=1)
    with FewDescriptorsServer(config, nofile=256, reserve=reserve) as server, \
            ActorClient(server.endpoint, timeout=10, **keys_of(keys, "actor")) as actor, \
            LearnerClient(server.endpoint, timeout=10, **keys_of(keys, "learner")) as learner:
        actor.push_episode(episode_rows(1, 0, 5))
        segment = actor.segment()
        segment.extend(episode_rows(1, 1, 400))  # sent: the server holds an open segment of it
        assert wait_until(lambda: actor.info()["open_segments"] == 1, timeout=5)
        with idle_connections(server.endpoint, 300), idle_connections(server.read_endpoint, 300):
            time.sleep(2.5)  # two key reloads (every second) with the descriptors taken
            held = descriptors_of(server.pid)
            assert server.process.is_alive(), f"the server died (exit code {server.process.exitcode})"
            receipt = segment.commit()  # the session and its open segment survived
            assert receipt.length == 400
            assert learner.sample(8)["step"].shape == (8,)
        if reserve is None:
            assert held <= 256 - guard.RESERVED_DESCRIPTORS + 8, f"the writer holds {held} descriptors"
        with ActorClient(server.endpoint, timeout=10, **keys_of(keys, "actor")) as newcomer:
            assert newcomer.push_episode(episode_rows(2, 0, 5)).length == 5
        assert learner.sample(8)["step"].shape == (8,)


@pytest.mark.timeout(60)
def test_a_connection_whose_descriptor_cannot_be_duplicated_keeps_its_byte_budget(tmp_path):
    """The guard read each connection's TCP counters through a duplicate of its descriptor; when
    os.dup failed (EMFILE) the connection was marked unguarded for good, and could then stream a
    multipart message without end into the writer's memory. With os.dup failing in the server,
    a client sending past its 4 MiB budget is still cut."""
    config = server_config(tmp_path / "rb.h5", num_readers=0, client_bytes_in=4 * MB)
    with FewDescriptorsServer(config, failing_dup=True) as server:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.linger = 0
        sock.sndhwm = 0
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            sock.connect(server.endpoint)
            frame = bytes(MB)
            # One message of 65 MiB: the server's libzmq holds it whole before the server sees any
            # of it (a sender's libzmq sends nothing of a message before its last frame).
            with contextlib.suppress(zmq.ZMQError):
                for _ in range(64):
                    sock.send(frame, zmq.SNDMORE)
                sock.send(frame)
            assert monitor.poll(10_000), "the client streaming past its budget was never disconnected"
        finally:
            monitor.close(0)
            sock.close(0)
        assert server.process.is_alive()
        with ActorClient(server.endpoint, timeout=10) as actor:
            assert actor.push_episode(episode_rows(3, 0, 5)).length == 5


@pytest.mark.timeout(90)
def test_a_reader_the_system_will_not_restart_fails_its_reads_never_the_writer(tmp_path):
    """A reader restart that hit EMFILE (no pipe for the new process) raised out of the writer's
    loop: the writer died. Now that reader is tried again every second, and the writer serves on."""
    path, no_pipes = tmp_path / "rb.h5", tmp_path / "no-pipes"
    with FewDescriptorsServer(server_config(path, num_readers=1), no_pipes_while=str(no_pipes)) as server:
        with ActorClient(server.endpoint, timeout=10) as actor:
            actor.push_episode(episode_rows(4, 0, 5))
            assert wait_until(lambda: len(file_holders(server.pid, path)) == 1, timeout=10)
            no_pipes.touch()
            for pid in file_holders(server.pid, path):
                os.kill(pid, signal.SIGKILL)
            time.sleep(2.5)  # two restarts refused
            assert server.process.is_alive(), f"the writer died (exit code {server.process.exitcode})"
            assert actor.push_episode(episode_rows(4, 1, 5)).length == 5
        no_pipes.unlink()
        with LearnerClient(server.endpoint, timeout=2) as learner:
            assert wait_until(lambda: _samples(learner), timeout=20), "the reader never came back"


def _samples(learner: LearnerClient) -> bool:
    try:
        return learner.sample(4)["step"].shape == (4,)
    except ServerUnavailableError:
        return False


# ---------------------------------------------------------------- key reloads that cannot read


def _failing(real: Any, error: int, when: Any) -> Any:
    """`real` (an os function taking a path first), raising OSError(`error`) for paths `when` accepts."""
    def call(path: Any, *args: Any, **kwargs: Any) -> Any:
        if when(os.fspath(path)):
            raise OSError(error, os.strerror(error), os.fspath(path))
        return real(path, *args, **kwargs)

    return call


def _public(keys: Path, name: str) -> bytes:
    return zmq.auth.load_certificate(keys / f"{name}.key")[0]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("error", [errno.EMFILE, errno.ENFILE, errno.EACCES, errno.EIO], ids=errno.errorcode.get)
def test_a_key_directory_that_cannot_be_listed_keeps_its_keys(keys, monkeypatch, caplog, error):
    auth = RoleAuthenticator(zmq.Context.instance(), keys)
    generation = auth.generation
    monkeypatch.setattr("h5replay.server.auth.os.listdir", _failing(os.listdir, error, lambda path: True))
    with caplog.at_level(logging.WARNING, logger="h5replay.server"):
        for _ in range(3):
            assert auth.reload() == 2
    assert (auth.role_of(_public(keys, "actor")), auth.role_of(_public(keys, "learner"))) == (ACTOR, LEARNER)
    assert auth.generation == generation  # nothing changed: no session is touched
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all(os.strerror(error) in line and "kept" in line for line in lines), lines  # once each


@pytest.mark.timeout(30)
def test_a_key_file_that_cannot_be_read_keeps_its_key_while_other_changes_apply(keys, monkeypatch):
    auth = RoleAuthenticator(zmq.Context.instance(), keys)
    actor, learner = _public(keys, "actor"), _public(keys, "learner")
    unreadable = str(keys / "actors" / "actor.key")
    monkeypatch.setattr("h5replay.server.auth.os.open", _failing(os.open, errno.EMFILE, lambda p: p == unreadable))
    (keys / "learners" / "learner.key").unlink()  # a removal elsewhere still revokes
    public, _ = zmq.auth.create_certificates(keys, "newcomer")
    shutil.copyfile(public, keys / "actors" / "newcomer.key")
    newcomer = _public(keys, "newcomer")
    auth.reload()
    assert (auth.role_of(actor), auth.role_of(learner), auth.role_of(newcomer)) == (ACTOR, None, ACTOR)
    # A new key that cannot be read waits for the next reading that can.
    later = str(keys / "actors" / "later.key")
    shutil.copyfile(keys / "actors" / "newcomer.key", later)
    (keys / "actors" / "newcomer.key").unlink()
    monkeypatch.setattr("h5replay.server.auth.os.open", _failing(os.open, errno.EMFILE, lambda p: p == later))
    auth.reload()
    assert auth.role_of(newcomer) is None
    monkeypatch.undo()
    auth.reload()
    assert (auth.role_of(actor), auth.role_of(newcomer)) == (ACTOR, ACTOR)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["files-removed", "directories-emptied", "directories-removed", "root-removed"])
def test_key_directories_really_emptied_or_removed_still_revoke_every_key(keys, how):
    auth = RoleAuthenticator(zmq.Context.instance(), keys)
    admitted = [_public(keys, "actor"), _public(keys, "learner")]
    for role in ("actors", "learners"):
        if how == "files-removed":
            (keys / role / f"{role[:-1]}.key").unlink()
        elif how == "directories-emptied":
            for path in (keys / role).iterdir():
                path.unlink()
        elif how == "directories-removed":
            shutil.rmtree(keys / role)
    if how == "root-removed":
        shutil.rmtree(keys)
    assert auth.reload() == 0
    assert [auth.role_of(key) for key in admitted] == [None, None]
