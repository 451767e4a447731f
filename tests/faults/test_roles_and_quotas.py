"""Who may do what, message by message, and how much of the server one key may take (issue 14,
cases 6 to 10): roles checked on every message against its key, revocation that reaches live
connections, quotas that keep actors in, reads kept off the writer's loop, readers replaced,
and no way in through the server's internal socket.

Real servers with CURVE keys in tmp_path, raw DEALERs doing what the official clients never do.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq
import zmq.auth
from fault_helpers import children_of, cli_command, flood_reads
from service_helpers import (
    EPISODE_SPACE,
    SPAWN,
    episode_rows,
    free_port,
    processes,
    row_problems,
    server_config,
    wait_until,
)

from h5replay import protocol as P
from h5replay.client import ActorClient, LearnerClient
from h5replay.config import ClientConfig, ServerConfig
from h5replay.errors import AccessDeniedError, ConfigError, ProtocolError, ReadOnlyError, ServerUnavailableError
from h5replay.server import ServerProcess
from h5replay.server.auth import RoleAuthenticator, generate_keys
from h5replay.storage import BoxSpace, DictSpace


def keys_of(keys: Path, name: str) -> dict[str, Path]:
    return {"secret_key": keys / f"{name}.key_secret", "server_key": keys / "server.key"}


@pytest.fixture
def keys(tmp_path) -> Path:
    directory = tmp_path / "keys"
    generate_keys(directory)
    return directory


def add_key(keys: Path, name: str, role_dir: str) -> Path:
    public, _ = zmq.auth.create_certificates(keys, name)
    target = keys / role_dir / f"{name}.key"
    shutil.copyfile(public, target)
    return target


@contextlib.contextmanager
def curve_dealer(endpoint: str, keys: Path, name: str, routing_id: bytes | None = None) -> Iterator[zmq.Socket[bytes]]:
    public, secret = zmq.auth.load_certificate(keys / f"{name}.key_secret")
    server_public, _ = zmq.auth.load_certificate(keys / "server.key")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = secret, public, server_public
    if routing_id is not None:
        sock.routing_id = routing_id
    sock.connect(endpoint)
    try:
        yield sock
    finally:
        sock.close(0)


def call(sock: zmq.Socket[bytes], message: P.Request, timeout: float = 5.0) -> P.Reply | None:
    """Send a request and wait for its reply (skipping the server's probes); None on a timeout."""
    sock.send_multipart([bytes(f) for f in P.encode(message)])
    deadline = time.monotonic() + timeout
    while (remaining := deadline - time.monotonic()) > 0:
        if not sock.poll(int(remaining * 1000) + 1):
            return None
        reply = P.decode(sock.recv_multipart(), expect=P.Reply)
        if reply.request_id == message.request_id:
            return reply
    return None


def total_episodes(endpoint: str, keys: Path) -> int:
    with ActorClient(endpoint, timeout=10, **keys_of(keys, "actor")) as actor:
        return int(actor.info()["total_episodes"])


# ---------------------------------------------------------------- case 6: roles on every message


@pytest.mark.timeout(120)
def test_a_learner_key_taking_over_an_actors_routing_id_cannot_write(tmp_path, keys):
    """Issue 14, case 6: a learner-key DEALER reusing a departed actor's routing id within ~20 ms
    was served as that actor and could push. The routing id stays bound to the actor's key."""
    config = server_config(tmp_path / "rb.h5", auth_dir=str(keys), num_readers=0)
    with ServerProcess(config, timeout=60) as server:
        before = total_episodes(server.endpoint, keys)
        with curve_dealer(server.endpoint, keys, "actor", routing_id=b"victim") as actor:
            assert isinstance(call(actor, P.Hello(1, "victim", "actor")), P.HelloReply)
            opened = call(actor, P.OpenSegment(2))
            assert isinstance(opened, P.OpenSegmentReply)
        rows = episode_rows(66, 0, 5)
        reply = None
        deadline = time.monotonic() + 10
        while reply is None and time.monotonic() < deadline:  # as soon as the actor's connection is gone
            with curve_dealer(server.endpoint, keys, "learner", routing_id=b"victim") as thief:
                reply = call(thief, P.PushEpisode(3, 5, rows), timeout=0.5)
                if reply is not None:
                    appended = call(thief, P.Append(4, opened.segment_id, 5, rows))
        assert reply is not None, "the learner never got an answer"
        assert isinstance(reply, P.ErrorReply), f"a learner key wrote through an actor's routing id: {reply}"
        assert isinstance(reply.exception(), (AccessDeniedError, ReadOnlyError)), reply
        assert isinstance(appended, P.ErrorReply), appended
        assert total_episodes(server.endpoint, keys) == before


# ---------------------------------------------------------------- case 7: revocation


@pytest.mark.timeout(120)
def test_a_removed_key_loses_its_live_connection_and_its_open_segments(tmp_path, keys):
    """Issue 14, case 7: removing an actor key left its live connections writing."""
    extra = add_key(keys, "second", "actors")
    config = server_config(tmp_path / "rb.h5", auth_dir=str(keys), num_readers=1)
    with ServerProcess(config, timeout=60) as server:
        with ActorClient(server.endpoint, timeout=3, **keys_of(keys, "second")) as actor:
            segment = actor.segment()
            segment.extend(episode_rows(67, 0, 400))  # sent: the server holds an open segment of it
            with ActorClient(server.endpoint, timeout=10, **keys_of(keys, "actor")) as other:
                assert wait_until(lambda: other.info()["open_segments"] == 1, timeout=5)
                extra.unlink()
                assert wait_until(lambda: other.info()["open_segments"] == 0, timeout=5), \
                    "the removed key's open segment was not aborted"
            with pytest.raises((ServerUnavailableError, AccessDeniedError)):
                actor.push_episode(episode_rows(67, 1, 5))
        with pytest.raises(ServerUnavailableError):  # and it cannot come back
            ActorClient(server.endpoint, timeout=1.0, **keys_of(keys, "second"))


@pytest.mark.timeout(120)
def test_a_key_moved_to_learners_loses_writing_on_its_live_connections(tmp_path, keys):
    """Issue 14, case 7: moving an actor key to learners/ kept the actor role."""
    extra = add_key(keys, "third", "actors")
    config = server_config(tmp_path / "rb.h5", auth_dir=str(keys), num_readers=1)
    with ServerProcess(config, timeout=60) as server:
        with ActorClient(server.endpoint, timeout=5, **keys_of(keys, "third")) as actor:
            actor.push_episode(episode_rows(68, 0, 5))
            segment = actor.segment()
            segment.extend(episode_rows(68, 1, 400))
            assert wait_until(lambda: actor.info()["open_segments"] == 1, timeout=5)
            shutil.move(str(extra), str(keys / "learners" / "third.key"))
            assert wait_until(lambda: actor.info()["open_segments"] == 0, timeout=5)
            with pytest.raises(ReadOnlyError):
                actor.push_episode(episode_rows(68, 2, 5))
        with LearnerClient(server.endpoint, timeout=5, **keys_of(keys, "third")) as learner:
            assert len(learner.episodes()) == 1  # it may still read


@pytest.mark.timeout(60)
@pytest.mark.parametrize("move", [("actors", "learners"), ("learners", "actors")])
def test_a_key_moved_while_the_directories_are_listed_keeps_a_role(tmp_path, keys, monkeypatch, move):
    """A reload lists learners/ then actors/: a key renamed from one to the other between the two
    listings was in neither, so it was revoked and its connections dropped (a request in flight
    on them was lost: test_a_key_moved_to_learners_loses_writing_on_its_live_connections failed
    now and then)."""
    source, target = move
    moved = add_key(keys, "mover", source)
    public = zmq.auth.load_certificate(moved)[0]
    auth = RoleAuthenticator(zmq.Context.instance(), keys)
    real_listdir = os.listdir
    listed: list[str] = []

    def listdir_then_move(path):  # the rename lands right after the first directory is listed
        names = real_listdir(path)
        listed.append(os.path.basename(path))
        if len(listed) == 1:
            shutil.move(str(moved), str(keys / target / "mover.key"))
        return names

    monkeypatch.setattr("h5replay.server.auth.os.listdir", listdir_then_move)
    auth.reload()
    monkeypatch.undo()
    assert auth.role_of(public) == ("learner" if target == "learners" else "actor")


@pytest.mark.timeout(120)
def test_a_fifo_in_the_key_directory_does_not_hang_the_server(tmp_path, keys):
    """Issue 14, case 10: key reload ran in the writer loop, and a FIFO in actors/ hung it."""
    config = server_config(tmp_path / "rb.h5", auth_dir=str(keys), num_readers=1)
    server = ServerProcess(config, timeout=60)
    try:
        os.mkfifo(keys / "actors" / "evil.key")
        os.mkfifo(keys / "learners" / "evil.key")
        time.sleep(2.5)  # two reloads
        with ActorClient(server.endpoint, timeout=5, **keys_of(keys, "actor")) as actor:
            for e in range(3):
                assert actor.push_episode(episode_rows(69, e, 5)).length == 5
        with LearnerClient(server.endpoint, timeout=5, **keys_of(keys, "learner")) as learner:
            assert len(learner.episodes()) == 3
    finally:
        if server.stop(10) is None or server.process.is_alive():
            server.kill()


# ---------------------------------------------------------------- case 8: quotas


@pytest.mark.timeout(120)
def test_one_learner_key_cannot_lock_actors_out(tmp_path, keys):
    """Issue 14, case 8: 260 idle connections of one learner key filled the 256-client limit for the
    300 s session timeout. A share of the slots is kept for actor keys, one key's clients are
    bounded, and idle sessions expire."""
    config = server_config(tmp_path / "rb.h5", auth_dir=str(keys), num_readers=1,
                           limits=P.Limits(max_clients=16), max_clients_per_key=10, actor_slots=4, idle_timeout=2.0)
    with ServerProcess(config, timeout=60) as server, contextlib.ExitStack() as stack:
        refusals = []
        for k in range(14):
            sock = stack.enter_context(curve_dealer(server.endpoint, keys, "learner"))
            reply = call(sock, P.Heartbeat(k + 1))
            assert reply is not None
            if isinstance(reply, P.ErrorReply):
                refusals.append(str(reply.exception()))
        assert len(refusals) == 4 and "max_clients_per_key=10" in refusals[0], refusals
        second = add_key(keys, "learner2", "learners")
        time.sleep(1.5)
        for k in range(3):
            sock = stack.enter_context(curve_dealer(server.endpoint, keys, "learner2"))
            reply = call(sock, P.Heartbeat(100 + k))
            assert reply is not None
            if isinstance(reply, P.ErrorReply):
                refusals.append(str(reply.exception()))
        assert any("kept for actor keys" in r for r in refusals[4:]), refusals
        with ActorClient(server.endpoint, timeout=5, **keys_of(keys, "actor")) as actor:  # an actor still gets in
            assert actor.push_episode(episode_rows(70, 0, 5)).length == 5
            # Idle sessions (no open segment) expire: the learners' slots come free.
            assert wait_until(lambda: actor.info()["clients"] <= 2, timeout=8)
        second.unlink()


# ---------------------------------------------------------------- case 9: reads off the writer


IMAGES = DictSpace({"img": BoxSpace(0, 255, (64, 64, 4), np.uint8), "n": BoxSpace(0, 1 << 30, (), np.int64)})


def _image_rows(n: int) -> dict[str, np.ndarray]:
    return {"img": np.full((n, 64, 64, 4), 7, np.uint8), "n": np.arange(n, dtype=np.int64)}


@pytest.mark.timeout(60)
def test_a_read_sent_to_the_writer_endpoint_is_refused_naming_the_read_endpoint(start_server):
    server = start_server(num_readers=1)
    with ActorClient(server.endpoint, timeout=10) as actor:
        actor.push_episode(episode_rows(71, 0, 10))
        reply = actor.connection.request(lambda rid: P.Info(rid))
        assert isinstance(reply, P.InfoReply)
        with pytest.raises(ProtocolError, match=re.escape(server.read_endpoint)):
            actor.connection.request(lambda rid: P.Sample(rid, 4))
    with LearnerClient(server.endpoint, timeout=10) as learner:  # learners read from the readers, as ever
        assert not row_problems(learner.sample(8))


def _commits_in(endpoint: str, seconds: float) -> int:
    done = 0
    with ActorClient(endpoint, timeout=30) as actor:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            actor.push_episode(_image_rows(2))
            done += 1
    return done


@pytest.mark.serial  # compares two commit rates: tests running beside it would skew one or the other
@pytest.mark.timeout(120)
def test_reads_on_the_writer_endpoint_cannot_starve_ingest(start_server):
    """Issue 14, case 9: one learner sampling images on the writer endpoint took commits from 2,250
    to 81 in 8 s. With --readers 0 a pass of the writer handles its writes first and gives reads a
    bounded share of its time."""
    server = start_server(space=IMAGES, capacity=4000, num_readers=0)
    with ActorClient(server.endpoint, timeout=30) as actor:
        for _ in range(10):
            actor.push_episode(_image_rows(200))
    alone = _commits_in(server.endpoint, 3.0)
    stop = SPAWN.Event()
    with processes() as procs:
        procs.append(SPAWN.Process(target=flood_reads, args=(server.endpoint, stop), daemon=True))
        procs[0].start()
        time.sleep(1.0)
        flooded = _commits_in(server.endpoint, 3.0)
        stop.set()
        procs[0].join(10)
    print(f"\ncommits in 3 s: {alone} alone, {flooded} while a learner floods the writer endpoint with reads")
    # Before: about 1/6 here (289 of 1,822), 1/28 in the issue. The machine is shared: keep a margin.
    assert flooded >= alone / 3, (alone, flooded)


# ---------------------------------------------------------------- case 10: readers, internal socket


def _reader_pids(server: ServerProcess) -> list[int]:
    found = []
    for pid in children_of(server.pid):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            if b"spawn_main" in cmdline.read():
                found.append(pid)
    return found


@pytest.mark.serial  # a replacement reader process must start and answer within 15 s; not so at load 9
@pytest.mark.timeout(120)
def test_a_stopped_reader_is_replaced_after_a_deadline(start_server):
    """Issue 14, case 10: a SIGSTOPped reader was never replaced; learners failed as long as it
    was stopped."""
    server = start_server(num_readers=1, reader_timeout=2.0)
    with ActorClient(server.endpoint, timeout=10) as actor:
        actor.push_episode(episode_rows(72, 0, 50))
    assert wait_until(lambda: len(_reader_pids(server)) == 1, timeout=10)
    stopped = _reader_pids(server)[0]
    os.kill(stopped, signal.SIGSTOP)
    try:
        def served() -> bool:  # by a reader process (a learner on the file's host would draw itself)
            try:
                wire = ClientConfig(endpoint=server.endpoint, timeout=1.0, local_reads=False)
                with LearnerClient(config=wire) as learner:
                    return learner.sample(4)["step"].shape == (4,)
            except ServerUnavailableError:
                return False

        assert wait_until(served, timeout=15), "no reader answered again after the stopped one"
        assert stopped not in _reader_pids(server)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stopped, signal.SIGCONT)
            os.kill(stopped, signal.SIGKILL)


def _private_sockets(server: ServerProcess) -> list[str]:
    """Paths of the unix sockets the server's processes bound in its private directory."""
    inodes: set[str] = set()
    for pid in [server.pid, *children_of(server.pid)]:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        inodes.add(link[8:-1])
    paths = set()
    with open("/proc/net/unix") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            if len(fields) >= 8 and fields[6] in inodes and "/h5replay-" in fields[7]:
                paths.add(fields[7])
    return sorted(paths)


@pytest.mark.timeout(120)
def test_no_forged_reply_reaches_a_learner_through_the_internal_socket(start_server):
    """Issue 14, case 10: the ipc socket between the proxy and the readers took connections from any
    process of the same user, and a forged reply reached a learner. A process that connects there
    now, as a reader would, is never handed a request, and what it sends is dropped."""
    server = start_server(num_readers=2)
    with ActorClient(server.endpoint, timeout=10) as actor:
        actor.push_episode(episode_rows(73, 0, 50))
    paths = []
    assert wait_until(lambda: bool(paths.extend(_private_sockets(server)) or paths), timeout=10)
    stop, forged = threading.Event(), [0]

    def impostor(path: str) -> None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.linger = 0
        sock.routing_id = os.urandom(22)
        sock.connect(f"ipc://{path}")
        try:
            while not stop.is_set():
                with contextlib.suppress(zmq.Again):
                    sock.send(b"", zmq.NOBLOCK)  # "ready", as a reader says
                if sock.poll(50):
                    learner_id, *frames = sock.recv_multipart()
                    request = P.decode(frames, expect=P.Request)
                    fake = {k: np.zeros(4, v.dtype) for k, v in episode_rows(0, 0, 4).items()}
                    fake["obs"] = np.zeros((4, 16), np.float32)
                    reply = P.SampleReply(request.request_id, 1 << 40, 0, 0, 4, np.arange(4), np.zeros(4, np.uint64),
                                          np.full(4, 0.25), fake)
                    sock.send_multipart([learner_id, *[bytes(f) for f in P.encode(reply)]])
                    forged[0] += 1
        finally:
            sock.close(0)

    threads = [threading.Thread(target=impostor, args=(path,), daemon=True) for path in paths]
    for thread in threads:
        thread.start()
    try:
        time.sleep(1.0)
        with LearnerClient(server.endpoint, timeout=5) as learner:
            for _ in range(40):
                batch = learner.sample(4)
                assert not row_problems(batch) and np.all(batch["actor"] == 73), "a forged reply reached the learner"
    finally:
        stop.set()
        for thread in threads:
            thread.join(5)
    assert forged[0] == 0, f"the impostor was handed {forged[0]} requests"


@pytest.mark.timeout(60)
def test_secret_keys_are_never_readable_by_others_even_for_an_instant(tmp_path):
    """Issue 14, case 10: `keys generate` wrote server.key_secret with the umask's permissions
    before its chmod (another local user read it in 2 of 20 runs): every file holding a secret is
    created 0600 from its first byte (traced with strace)."""
    if shutil.which("strace") is None:
        pytest.skip("needs strace")
    trace = tmp_path / "trace"
    done = subprocess.run(["strace", "-f", "-e", "trace=open,openat,creat", "-o", str(trace),
                           *cli_command("keys", "generate", str(tmp_path / "keys"))], capture_output=True, text=True,
                          timeout=60)
    if done.returncode != 0 and "ptrace" in done.stderr:
        pytest.skip(f"strace cannot trace here: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-1000:]
    created = [line for line in trace.read_text().splitlines() if "O_CREAT" in line and "key_secret" in line]
    assert len(created) >= 3, trace.read_text()[-3000:]
    for line in created:
        assert line.rstrip().split(",")[-1].split(")")[0].strip() == "0600", f"a secret created without 0600: {line}"


def _serve_refused(tmp_path: Path, *flags: str) -> list[str]:
    """`h5replay serve` with `flags`: it must exit 2 at once, before creating the file; its stderr."""
    space = tmp_path / "space.json"
    space.write_text(json.dumps(EPISODE_SPACE.to_json()))
    path = tmp_path / "rb.h5"
    try:
        done = subprocess.run(cli_command("serve", str(path), "--space", str(space), "--capacity", "100", *flags),
                              capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`serve {' '.join(flags)}` was not refused: the server started")
    assert done.returncode == 2, done
    assert not path.exists(), "the server got as far as creating the file"
    return done.stderr.strip().splitlines()


@pytest.mark.timeout(120)
def test_metrics_beyond_loopback_need_insecure_or_auth(tmp_path, keys):
    """Issue 14, case 10: `--metrics-address 0.0.0.0` was accepted without --insecure."""
    bind = f"tcp://127.0.0.1:{free_port()}"
    for address in ("0.0.0.0", "::", "10.1.2.3", "127.0.0.1.nip.io"):
        lines = _serve_refused(tmp_path, "--bind", bind, "--metrics-port", str(free_port()), "--metrics-address",
                               address)
        assert len(lines) == 1 and address in lines[0] and "--insecure" in lines[0], lines
    path = str(tmp_path / "rb.h5")
    for address in ("127.0.0.1", "127.5.6.7", "::1", "[::1]", "localhost"):  # loopback: allowed
        ServerConfig(path=path, bind=bind, metrics_port=9100, metrics_address=address)
    ServerConfig(path=path, bind=bind, metrics_port=9100, metrics_address="0.0.0.0", insecure=True)
    ServerConfig(path=path, bind=bind, metrics_port=9100, metrics_address="0.0.0.0", auth_dir=str(keys))


@pytest.mark.timeout(60)
def test_loopback_is_decided_by_parsing_the_address(tmp_path):
    """Issue 14, case 10: the loopback check took any host starting with "127." for loopback, so
    `127.0.0.1.nip.io` (a name that resolves anywhere) was bound without --insecure."""
    port = free_port()
    lines = _serve_refused(tmp_path, "--bind", f"tcp://127.0.0.1.nip.io:{port}")
    assert len(lines) == 1 and "127.0.0.1.nip.io" in lines[0] and "--insecure" in lines[0], lines
    path = str(tmp_path / "rb.h5")
    for host in ("127.0.0.1.nip.io", "127.evil.example", "0.0.0.0", "[::]", "1.2.3.4"):
        with pytest.raises(ConfigError, match="--insecure"):
            ServerConfig(path=path, bind=f"tcp://{host}:{port}")
    for host in ("127.0.0.1", "127.1.2.3", "[::1]", "localhost"):
        ServerConfig(path=path, bind=f"tcp://{host}:{port}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("readers", [1, 2])  # one reader binds the endpoint itself; two sit behind a front
def test_one_key_cannot_open_connections_without_end_to_the_learners_endpoint(tmp_path, keys, readers):
    """`--max-clients-per-key` bounds one key's connections to the learners' endpoint too, as it
    bounds its sessions on the writer: a key over it is refused with an error reply naming the
    limit, another key is not, and a connection that ends frees its place."""
    config = server_config(tmp_path / "rb.h5", auth_dir=str(keys), num_readers=readers, max_clients_per_key=3)
    with ServerProcess(config, timeout=60) as server, contextlib.ExitStack() as stack:
        socks = [stack.enter_context(curve_dealer(server.read_endpoint, keys, "learner")) for _ in range(3)]
        for k, sock in enumerate(socks):
            assert isinstance(call(sock, P.Heartbeat(k + 1)), P.HeartbeatReply)
        with curve_dealer(server.read_endpoint, keys, "learner") as fourth:
            reply = call(fourth, P.Heartbeat(10))
            assert isinstance(reply, P.ErrorReply), reply
            assert "max_clients_per_key=3" in str(reply.exception()) and "learners' endpoint" in str(reply.exception())
        for k, sock in enumerate(socks):  # the three admitted go on being served
            assert isinstance(call(sock, P.Heartbeat(20 + k)), P.HeartbeatReply)
        with curve_dealer(server.read_endpoint, keys, "actor") as other:  # another key has its own share
            assert isinstance(call(other, P.Heartbeat(30)), P.HeartbeatReply)
        socks[0].close(0)  # a connection that ends frees its place, once the server has seen it end

        def admitted() -> bool:
            with curve_dealer(server.read_endpoint, keys, "learner") as again:
                return isinstance(call(again, P.Heartbeat(40)), P.HeartbeatReply)

        assert wait_until(admitted, timeout=10)
