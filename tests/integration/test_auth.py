"""CURVE authentication with two roles, and the loopback-only default without it.

`h5replay keys generate DIR` (or `generate_keys`) writes pyzmq certificates; a server started with
`auth_dir` / `--auth DIR` admits only the public keys under DIR/actors (may write) and
DIR/learners (may only read). Encryption is checked by a relay in the middle of the TCP
connection that records the bytes: with CURVE nothing of a message shows, without it everything does.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq
import zmq.auth
from fault_helpers import TcpRecorder, cli_command, cli_server
from service_helpers import (
    EPISODE_SPACE,
    RawClient,
    episode_problems,
    episode_rows,
    free_port,
    running_server,
    server_config,
    wait_until,
)

from h5replay import protocol as P
from h5replay.client import ActorClient, LearnerClient
from h5replay.config import ServerConfig
from h5replay.errors import AccessDeniedError, ConfigError, ReadOnlyError, ServerUnavailableError
from h5replay.sampling import Prioritized, SamplingConfig
from h5replay.server import ServerProcess
from h5replay.server.auth import generate_keys

# The module's keys and `secured` server serve many tests: one xdist worker runs them all.
pytestmark = pytest.mark.xdist_group("test_auth")

REFUSED_WITHIN = 1.0  # seconds a refused client waits before ServerUnavailableError
KEY_FILES = ["server.key", "server.key_secret", "actor.key", "actor.key_secret", "learner.key",
             "learner.key_secret", "actors/actor.key", "learners/learner.key"]


def actor_keys(keys: Path, name: str = "actor") -> dict[str, Path]:
    return {"secret_key": keys / f"{name}.key_secret", "server_key": keys / "server.key"}


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("auth") / "keys"
    generate_keys(directory)
    return directory


@pytest.fixture(scope="module")
def secured(keys, tmp_path_factory):
    config = server_config(tmp_path_factory.mktemp("secured") / "rb.h5", auth_dir=str(keys), num_readers=1)
    server = ServerProcess(config, timeout=60)
    try:
        yield server
    finally:
        assert server.stop(30) == 0


# ------------------------------------------------------------------------------------ key files


def _check_key_dir(directory: Path) -> None:
    for name in KEY_FILES:
        path = directory / name
        assert path.is_file(), f"{name} missing"
        public, secret = zmq.auth.load_certificate(path)  # pyzmq's certificate format
        assert len(public) == 40
        if name.endswith("_secret"):
            assert secret is not None and len(secret) == 40
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, f"{name} is readable by others"
        else:
            assert secret is None
    assert zmq.auth.load_certificate(directory / "actors/actor.key")[0] == zmq.auth.load_certificate(directory / "actor.key")[0]


@pytest.mark.timeout(60)
def test_generate_keys_writes_pyzmq_certificates(tmp_path):
    written = generate_keys(tmp_path / "lib")
    assert sorted(os.path.relpath(p, tmp_path / "lib") for p in written) == sorted(KEY_FILES)
    _check_key_dir(tmp_path / "lib")
    with pytest.raises(ConfigError, match="already holds keys"):
        generate_keys(tmp_path / "lib")  # never overwrites keys


@pytest.mark.timeout(60)
def test_cli_keys_generate(tmp_path):
    done = subprocess.run(cli_command("keys", "generate", str(tmp_path / "cli")), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    _check_key_dir(tmp_path / "cli")
    assert "--auth" in done.stderr  # says how to use them
    again = subprocess.run(cli_command("keys", "generate", str(tmp_path / "cli")), capture_output=True, text=True,
                           timeout=60)
    assert again.returncode == 2 and len(again.stderr.strip().splitlines()) == 1, again.stderr


# ------------------------------------------------------------------------------- who gets in


@pytest.mark.timeout(60)
def test_actor_and_learner_with_their_keys_work(secured, keys):
    episodes = [episode_rows(7, e, n) for e, n in enumerate((5, 40, 300))]
    with ActorClient(secured.endpoint, timeout=10, **actor_keys(keys)) as actor:
        receipts = [actor.push_episode(rows) for rows in episodes]
    with LearnerClient(secured.endpoint, timeout=10, **actor_keys(keys, "learner")) as learner:
        segments = learner.get_segments()
        for rows, receipt in zip(episodes, receipts):
            start = next(s for s, n in segments if n == receipt.length and s >= receipt.first_row_id)
            got = learner.get(np.arange(start, start + receipt.length))
            assert not episode_problems(got, receipt.length)
            np.testing.assert_array_equal(got["obs"], rows["obs"])
        assert learner.sample(16)["obs"].shape == (16, 16)


@pytest.mark.timeout(60)
def test_a_client_without_keys_is_refused(secured):
    started = time.monotonic()
    with pytest.raises(ServerUnavailableError):
        ActorClient(secured.endpoint, timeout=REFUSED_WITHIN)
    with pytest.raises(ServerUnavailableError):
        LearnerClient(secured.endpoint, timeout=REFUSED_WITHIN)
    assert time.monotonic() - started < 4 * REFUSED_WITHIN + 2
    done = subprocess.run(cli_command("ping", secured.endpoint, "--timeout", str(REFUSED_WITHIN)),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done


@pytest.mark.timeout(60)
def test_a_plain_zmq_client_gets_no_reply_on_either_endpoint(secured):
    for endpoint in (secured.endpoint, secured.read_endpoint):
        with RawClient(endpoint, timeout=REFUSED_WITHIN) as raw:
            raw.send(P.encode(P.Hello(1, "plain", "actor")))
            with pytest.raises(AssertionError, match="no reply"):
                raw.recv()


@pytest.mark.timeout(60)
def test_an_unknown_key_is_refused(secured, keys, tmp_path):
    zmq.auth.create_certificates(tmp_path, "rogue")
    rogue = {"secret_key": tmp_path / "rogue.key_secret", "server_key": keys / "server.key"}
    with pytest.raises(ServerUnavailableError):
        ActorClient(secured.endpoint, timeout=REFUSED_WITHIN, **rogue)
    with pytest.raises(ServerUnavailableError):
        LearnerClient(secured.endpoint, timeout=REFUSED_WITHIN, **rogue)
    # A listed key that expects another server key (a server impersonated) does not connect either.
    wrong_server = {"secret_key": keys / "actor.key_secret", "server_key": tmp_path / "rogue.key"}
    with pytest.raises(ServerUnavailableError):
        ActorClient(secured.endpoint, timeout=REFUSED_WITHIN, **wrong_server)


@pytest.mark.timeout(60)
def test_a_learner_key_cannot_write(secured, keys):
    learner_as_actor = actor_keys(keys, "learner")
    with ActorClient(secured.endpoint, timeout=10, **learner_as_actor) as client:  # it may say hello
        before = client.info()["total_episodes"]
        with pytest.raises(ReadOnlyError, match="learner"):
            client.push_episode(episode_rows(8, 0, 5))
        with pytest.raises(ReadOnlyError):
            with client.segment() as seg:  # the server first hears of it at the commit
                seg.extend(episode_rows(8, 1, 5))
        assert client.info()["total_episodes"] == before
    with LearnerClient(secured.endpoint, timeout=10, **learner_as_actor) as learner:
        learner.get_segments()  # and read


@pytest.mark.timeout(90)
def test_a_learner_key_may_update_priorities_but_not_write(keys, tmp_path):
    """Priorities are a learner's to set (TD errors); rows stay an actor's to write."""
    config = server_config(tmp_path / "prio.h5", auth_dir=str(keys), num_readers=1,
                           sampling=SamplingConfig(Prioritized(exponent=1.0)))
    with running_server(config) as server:
        with ActorClient(server.endpoint, timeout=10, **actor_keys(keys)) as actor:
            receipt = actor.push_episode(episode_rows(9, 0, 4))
        row_ids = np.arange(receipt.first_row_id, receipt.first_row_id + 4)
        with LearnerClient(server.endpoint, timeout=10, **actor_keys(keys, "learner")) as learner:
            assert learner.update_priorities(row_ids, [0.0, 0.0, 5.0, 0.0]) == 0  # none ignored
            _, info = learner.sample(64, seed=1, with_info=True)
            rows = info.row_ids
            assert set(rows.tolist()) == {int(row_ids[2])}, "the learner's priorities did not take"
        with ActorClient(server.endpoint, timeout=10, **actor_keys(keys, "learner")) as client:
            with pytest.raises(ReadOnlyError, match="learner"):
                client.push_episode(episode_rows(9, 1, 4))
            assert client.info()["total_episodes"] == 1


@pytest.mark.timeout(60)
def test_a_key_dropped_into_actors_is_admitted(secured, keys, tmp_path):
    public, _ = zmq.auth.create_certificates(tmp_path, "late")
    late = {"secret_key": tmp_path / "late.key_secret", "server_key": keys / "server.key"}
    with pytest.raises(ServerUnavailableError):
        ActorClient(secured.endpoint, timeout=REFUSED_WITHIN, **late)
    shutil.copyfile(public, keys / "actors" / "late.key")

    def admitted() -> bool:
        try:
            with ActorClient(secured.endpoint, timeout=1.0, **late) as actor:
                return actor.push_episode(episode_rows(9, 0, 3)).length == 3
        except ServerUnavailableError:
            return False

    assert wait_until(admitted, timeout=10)


# ---------------------------------------------------------------------------------- encryption

MARKER = "PLAINTEXT-MARKER-7f3a"


def _push_through(recorder: TcpRecorder, **keys) -> None:
    with ActorClient(recorder.endpoint, timeout=10, name=MARKER, **keys) as actor:
        actor.push_episode({**episode_rows(11, 0, 4)})


@pytest.mark.timeout(60)
def test_traffic_is_encrypted(secured, keys, tmp_path):
    port = int(secured.endpoint.rpartition(":")[2])
    with TcpRecorder(port) as recorder:
        _push_through(recorder, **actor_keys(keys))
    wire = bytes(recorder.upstream + recorder.downstream)
    assert b"CURVE" in wire  # the ZMTP greeting names the mechanism
    for plain in (MARKER.encode(), b"push_episode", b"fields", b"hello", EPISODE_SPACE.to_json()["type"].encode()):
        assert plain not in wire, f"{plain!r} travels in clear"

    # The control: the same client through the same relay to a server without --auth shows it all.
    open_server = ServerProcess(server_config(tmp_path / "open.h5", num_readers=0), timeout=60)
    try:
        with TcpRecorder(int(open_server.endpoint.rpartition(":")[2])) as recorder:
            _push_through(recorder)
    finally:
        assert open_server.stop(30) == 0
    assert MARKER.encode() in recorder.upstream and b"push_episode" in recorder.upstream
    assert b"NULL" in recorder.upstream


# -------------------------------------------------------------------- loopback unless told not to


@pytest.mark.timeout(60)
def test_a_non_loopback_bind_needs_auth_or_insecure(tmp_path, keys):
    path = str(tmp_path / "rb.h5")
    exposed = f"tcp://0.0.0.0:{free_port()}"
    with pytest.raises(ConfigError, match="--insecure"):
        ServerConfig(path=path, bind=exposed)
    with pytest.raises(ConfigError, match="--insecure"):
        ServerConfig(path=path, bind=f"tcp://127.0.0.1:{free_port()}", read_bind=exposed)
    ServerConfig(path=path, bind=exposed, insecure=True)  # allowed, when asked for (not started here)
    ServerConfig(path=path, bind=exposed, auth_dir=str(keys))


@pytest.mark.timeout(60)
def test_cli_refuses_a_non_loopback_bind_before_binding(tmp_path):
    space = tmp_path / "space.json"
    space.write_text(json.dumps(EPISODE_SPACE.to_json()))
    path = tmp_path / "rb.h5"
    port = free_port()
    done = subprocess.run(cli_command("serve", str(path), "--space", str(space), "--capacity", "100",
                                      "--bind", f"tcp://0.0.0.0:{port}"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--insecure" in lines[0] and "--auth" in lines[0], done.stderr
    assert not path.exists(), "the server got as far as creating the file"


@pytest.mark.timeout(90)
def test_cli_serve_with_auth(tmp_path, keys):
    space = tmp_path / "space.json"
    space.write_text(json.dumps(EPISODE_SPACE.to_json()))
    bind, read_bind = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"

    def ready() -> bool:
        try:
            ActorClient(bind, timeout=1.0, **actor_keys(keys)).close()
        except ServerUnavailableError:
            return False
        return True

    log = tmp_path / "serve.log"
    with cli_server(tmp_path / "rb.h5", bind, read_bind, log, "--auth", str(keys), "--space", str(space),
                    "--capacity", "1000", ready=ready) as proc:
        with ActorClient(bind, timeout=10, **actor_keys(keys)) as actor:
            assert actor.push_episode(episode_rows(12, 0, 10)).length == 10
        with LearnerClient(bind, timeout=10, **actor_keys(keys, "learner")) as learner:
            assert learner.get_segments() == [(0, 10)]
        with pytest.raises(ServerUnavailableError):
            ActorClient(bind, timeout=REFUSED_WITHIN)
        proc.terminate()
        assert proc.wait(30) == 0
    text = log.read_text()
    assert "with CURVE authentication" in text, text


# ------------------------------------------------------------------------- changing the key dir


@contextlib.contextmanager
def _server_with_keys(tmp_path: Path) -> Iterator[tuple[ServerProcess, Path]]:
    """A server under --auth with fresh keys, and an episode pushed with the actor key."""
    keys = tmp_path / "keys"
    generate_keys(keys)
    server = ServerProcess(server_config(tmp_path / "rb.h5", auth_dir=str(keys), num_readers=0), timeout=60)
    try:
        with ActorClient(server.endpoint, timeout=10, **actor_keys(keys)) as actor:
            actor.push_episode(episode_rows(13, 0, 5))
        yield server, keys
    finally:
        server.stop(30)


@pytest.mark.timeout(60)
def test_a_broken_key_file_dropped_in_does_not_stop_the_server(tmp_path):
    with _server_with_keys(tmp_path) as (server, keys), \
            ActorClient(server.endpoint, timeout=10, **actor_keys(keys)) as actor:
        (keys / "actors" / "broken.key").write_text("not a key\n")
        time.sleep(2.5)  # the server re-reads the key directories every second
        assert server.process.is_alive(), f"the server died (exit code {server.process.exitcode})"
        assert actor.push_episode(episode_rows(13, 1, 5)).length == 5  # connected clients go on


@pytest.mark.timeout(60)
def test_emptying_the_key_dirs_revokes_every_key_and_the_server_goes_on(tmp_path):
    """Issue 14, case 7: deleting every key kept every key admitted before (fail open). Now every
    key is revoked (fail closed); the server runs on, and admits keys copied back in."""
    with _server_with_keys(tmp_path) as (server, keys):
        with ActorClient(server.endpoint, timeout=3, **actor_keys(keys)) as actor:
            actor.push_episode(episode_rows(13, 1, 5))
            saved = (keys / "actors" / "actor.key").read_bytes()
            (keys / "actors" / "actor.key").unlink()
            (keys / "learners" / "learner.key").unlink()
            time.sleep(2.5)  # the keys are re-read every second
            assert server.process.is_alive(), f"the server died (exit code {server.process.exitcode})"
            with pytest.raises((ServerUnavailableError, AccessDeniedError)):
                actor.push_episode(episode_rows(13, 2, 5))
        (keys / "actors" / "actor.key").write_bytes(saved)
        assert wait_until(lambda: _pushes(server.endpoint, keys), timeout=10)


def _pushes(endpoint: str, keys: Path) -> bool:
    try:
        with ActorClient(endpoint, timeout=1.0, **actor_keys(keys)) as actor:
            return actor.push_episode(episode_rows(13, 3, 5)).length == 5
    except ServerUnavailableError:
        return False
