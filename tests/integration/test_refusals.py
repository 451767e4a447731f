"""Wrong CURVE keys against an --auth server: the client cannot tell a refusal from a dead server
(the server answers nothing), so the server's log says what happened, once per key and address.

Run through the real CLI (`h5replay serve --auth`), its log read back from a file.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq.auth
from fault_helpers import TcpRecorder, cli_server
from service_helpers import EPISODE_SPACE, free_port, wait_until

from h5replay.client import ActorClient
from h5replay.errors import ServerUnavailableError
from h5replay.server.auth import generate_keys


@contextlib.contextmanager
def auth_server(tmp_path: Path, keys: Path) -> Iterator[tuple[str, Path]]:
    """`h5replay serve --auth KEYS` on a free port of 127.0.0.1, logging to a file; yields
    (its endpoint, the log's path) once an actor with the right keys gets in."""
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
        yield bind, log


def refused(bind: str, **keys: Path) -> None:
    with pytest.raises(ServerUnavailableError):
        ActorClient(bind, timeout=1.0, **keys)


@pytest.mark.timeout(120)
def test_the_server_logs_each_refused_handshake_once(tmp_path):
    keys, strangers = tmp_path / "keys", tmp_path / "strangers"
    generate_keys(keys)
    generate_keys(strangers)
    ours = {"secret_key": keys / "actor.key_secret", "server_key": keys / "server.key"}
    with auth_server(tmp_path, keys) as (bind, log):
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


@pytest.mark.timeout(120)
def test_a_client_without_keys_that_hangs_up_mid_handshake_is_logged(tmp_path):
    """Through a proxy that coalesces the greeting (Docker's port proxy, now and then), the server
    never learns that the client spoke NULL: it sees a connection end mid-handshake. The log must
    still say that a client without keys is the likely cause (compose-test's auth run failed for
    want of this line)."""
    keys = tmp_path / "keys"
    generate_keys(keys)
    ours = {"secret_key": keys / "actor.key_secret", "server_key": keys / "server.key"}
    # The ZMTP signature and major version (11 bytes) in one piece: the server then answers with
    # the rest of its greeting at once, and a client without keys finds the mismatch and hangs up
    # before its own mechanism goes out.
    with auth_server(tmp_path, keys) as (bind, log), TcpRecorder(int(bind.rsplit(":", 1)[1]), hold_first=11) as proxy:
        refused(proxy.endpoint)

        def said() -> list[str]:
            return [line for line in log.read_text().splitlines() if "WARNING" in line]

        assert wait_until(lambda: len(said()) >= 1, timeout=10), log.read_text()
        ActorClient(proxy.endpoint, timeout=5, **ours).close()  # with keys, the same proxy gets in
    assert proxy.connections >= 2
    (line,) = said()
    assert "hung up during its handshake" in line and "without CURVE keys" in line and "--secret-key" in line, line
