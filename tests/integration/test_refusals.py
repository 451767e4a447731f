"""Wrong CURVE keys against an --auth server: the client cannot tell a refusal from a dead server
(the server answers nothing), so the server's log says what happened, once per key and address.

Run through the real CLI (`h5replay serve --auth`), its log read back from a file.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from pathlib import Path

import pytest
import zmq.auth
from fault_helpers import cli_server
from service_helpers import EPISODE_SPACE, free_port, wait_until

from h5replay.client import ActorClient
from h5replay.errors import ServerUnavailableError
from h5replay.server.auth import generate_keys


def refused(bind: str, **keys: Path) -> None:
    with pytest.raises(ServerUnavailableError):
        ActorClient(bind, timeout=1.0, **keys)


@pytest.mark.timeout(120)
def test_the_server_logs_each_refused_handshake_once(tmp_path):
    keys, strangers = tmp_path / "keys", tmp_path / "strangers"
    generate_keys(keys)
    generate_keys(strangers)
    ours = {"secret_key": keys / "actor.key_secret", "server_key": keys / "server.key"}
    bind, read_bind = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    space = tmp_path / "space.json"
    space.write_text(json.dumps(EPISODE_SPACE.to_json()))
    log = tmp_path / "serve.log"

    def ready() -> bool:
        try:
            ActorClient(bind, timeout=1.0, **ours).close()
        except ServerUnavailableError:
            return False
        return True

    with cli_server(tmp_path / "rb.h5", bind, read_bind, log, "--auth", str(keys), "--space", str(space),
                    "--capacity", "100", ready=ready):
        for _ in range(3):  # each mistake, made again and again
            refused(bind)  # no keys at all
            refused(bind, secret_key=strangers / "actor.key_secret", server_key=keys / "server.key")  # unlisted key
            refused(bind, secret_key=keys / "actor.key_secret", server_key=strangers / "server.key")  # wrong server key

        def said() -> list[str]:
            return [line for line in log.read_text().splitlines() if "WARNING" in line]

        assert wait_until(lambda: len(said()) >= 3, timeout=10), log.read_text()
        time.sleep(0.5)  # nothing more should come
        lines = said()
        ActorClient(bind, timeout=5, **ours).close()  # the right keys still get in
    stranger_key = zmq.auth.load_certificate(strangers / "actor.key")[0].decode()
    assert len(lines) == 3, lines
    (no_keys,) = [line for line in lines if "without CURVE keys" in line]
    assert bind in no_keys and "--secret-key" in no_keys
    (unlisted,) = [line for line in lines if "is not listed" in line]
    assert stranger_key in unlisted and "127.0.0.1" in unlisted and str(keys / "actors") in unlisted
    (wrong_server,) = [line for line in lines if "server key" in line]
    assert str(keys / "server.key") in wrong_server


class GreetingProxy:
    """A TCP proxy on 127.0.0.1 that holds back a client's first 11 bytes (the ZMTP signature and
    major version) and sends them to the server in one piece, as a port proxy that is slow to
    connect its far side does. The server then answers with the rest of its greeting at once, and
    a client without keys finds the mismatch and hangs up before its own mechanism goes out."""

    HELD = 11

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = 0
        self._sockets: list[socket.socket] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            self.connections += 1
            self._sockets.append(client)
            server = socket.create_connection(self.target, timeout=5)
            self._sockets.append(server)
            for source, sink, held in ((client, server, self.HELD), (server, client, 0)):
                thread = threading.Thread(target=self._pump, args=(source, sink, held), daemon=True)
                thread.start()
                self._threads.append(thread)

    def _pump(self, source: socket.socket, sink: socket.socket, held: int) -> None:
        pending = b""
        source.settimeout(0.2)
        try:
            while not self._stop.is_set():
                try:
                    data = source.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    break
                if len(pending) < held:
                    pending += data
                    if len(pending) < held:
                        continue
                    data, pending = pending, pending + b"x" * held  # sent once; from now on, straight through
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(5)
        for end in self._sockets:
            end.close()
        self.listener.close()


@pytest.mark.timeout(120)
def test_a_client_without_keys_that_hangs_up_mid_handshake_is_logged(tmp_path):
    """Through a proxy that coalesces the greeting (Docker's port proxy, now and then), the server
    never learns that the client spoke NULL: it sees a connection end mid-handshake. The log must
    still say that a client without keys is the likely cause (compose-test's auth run failed for
    want of this line)."""
    keys = tmp_path / "keys"
    generate_keys(keys)
    ours = {"secret_key": keys / "actor.key_secret", "server_key": keys / "server.key"}
    port = free_port()
    bind, read_bind = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{free_port()}"
    space = tmp_path / "space.json"
    space.write_text(json.dumps(EPISODE_SPACE.to_json()))
    log = tmp_path / "serve.log"

    def ready() -> bool:
        try:
            ActorClient(bind, timeout=1.0, **ours).close()
        except ServerUnavailableError:
            return False
        return True

    proxy = GreetingProxy(("127.0.0.1", port))
    try:
        with cli_server(tmp_path / "rb.h5", bind, read_bind, log, "--auth", str(keys), "--space", str(space),
                        "--capacity", "100", ready=ready):
            refused(proxy.endpoint)

            def said() -> list[str]:
                return [line for line in log.read_text().splitlines() if "WARNING" in line]

            assert wait_until(lambda: len(said()) >= 1, timeout=10), log.read_text()
            ActorClient(proxy.endpoint, timeout=5, **ours).close()  # with keys, the same proxy gets in
    finally:
        proxy.close()
    assert proxy.connections >= 2
    (line,) = said()
    assert "hung up during its handshake" in line and "without CURVE keys" in line and "--secret-key" in line, line
