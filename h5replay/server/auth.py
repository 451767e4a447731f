"""CURVE authentication with two roles: actor keys may write, learner keys may only read.

A key directory (made by `h5replay keys generate DIR`, in pyzmq's `zmq.auth` file format)::

    DIR/server.key  DIR/server.key_secret     the server's key pair
    DIR/actor.key   DIR/actor.key_secret      a client key pair for actors
    DIR/learner.key DIR/learner.key_secret    a client key pair for learners
    DIR/actors/*.key                          public keys allowed to write (drop more in)
    DIR/learners/*.key                        public keys allowed to read

libzmq encrypts every connection; a ZAP handler thread admits only listed keys and tags each
message with its role as the User-Id, which the writer reads off the frames. A refused client
gets no answer at all (it cannot tell a refusal from a dead server), so the server logs each
refusal, once per key and address and at most a few lines a minute (`RefusalLog`).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from h5replay.errors import ConfigError

__all__ = ["generate_keys", "RoleAuthenticator", "RefusalLog", "handshake_failure", "server_keys", "ACTOR", "LEARNER"]

ACTOR, LEARNER = "actor", "learner"
log = logging.getLogger("h5replay.server")
_ROLE_DIRS = {ACTOR: "actors", LEARNER: "learners"}
_REPEAT_AFTER = 300.0  # seconds before the same refusal (what, from where) is logged again
_LINES_PER_MINUTE = 10  # refusal lines at most; the rest are counted and the count told in the next line
_REMEMBERED = 10_000  # (what, from where) pairs remembered; forgotten all at once past this


def generate_keys(directory: str | os.PathLike[str]) -> list[str]:
    """Create server, actor and learner key pairs in `directory`; returns the files written.

    Raises:
        ConfigError: the directory already holds a server key (never overwrite keys).
    """
    root = os.fspath(directory)
    if os.path.exists(os.path.join(root, "server.key_secret")):
        raise ConfigError(f"{root!r} already holds keys; remove them or choose another directory")
    os.makedirs(root, exist_ok=True)
    written = []
    for name in ("server", ACTOR, LEARNER):
        public, secret = zmq.auth.create_certificates(root, name)
        os.chmod(secret, 0o600)
        written += [public, secret]
    for role, sub in _ROLE_DIRS.items():
        os.makedirs(os.path.join(root, sub), exist_ok=True)
        target = os.path.join(root, sub, f"{role}.key")
        shutil.copyfile(os.path.join(root, f"{role}.key"), target)
        written.append(target)
    return written


def server_keys(directory: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """(public, secret) of the server's key pair in `directory`."""
    path = os.path.join(os.fspath(directory), "server.key_secret")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the server key {path!r}: {exc}; run `h5replay keys generate DIR`") from exc
    if not secret:
        raise ConfigError(f"{path!r} holds no secret key")
    return public, secret


def _role_keys(directory: str) -> tuple[dict[bytes, str], list[str]]:
    """({public key: role}, [files that could not be read])."""
    keys: dict[bytes, str] = {}
    unreadable = []
    for role in (LEARNER, ACTOR):  # a key listed in both directories gets the actor role
        sub = os.path.join(directory, _ROLE_DIRS[role])
        if not os.path.isdir(sub):
            continue
        for name in sorted(os.listdir(sub)):
            if not name.endswith(".key"):
                continue
            try:
                public, _ = zmq.auth.load_certificate(os.path.join(sub, name))
            except (OSError, ValueError):  # a malformed file, or one still being copied in
                unreadable.append(os.path.join(sub, name))
                continue
            if public:
                keys[public] = role
    return keys, unreadable


class RefusalLog:
    """Logs refused handshakes as warnings: each (what, from where) once per `_REPEAT_AFTER` seconds,
    and at most `_LINES_PER_MINUTE` lines a minute, so that a client retrying every second, or a
    port scan, cannot flood the log. Pure bookkeeping; `clock` is injectable for tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._seen: dict[tuple[str, str], float] = {}
        self._window = -60.0
        self._lines = 0
        self._untold = 0

    def refused(self, what: str, source: str, message: str) -> bool:
        """Log `message` unless the same refusal was logged lately; returns whether it was logged."""
        now = self._clock()
        last = self._seen.get((what, source))
        if last is not None and now - last < _REPEAT_AFTER:
            return False
        if now - self._window >= 60.0:
            self._window, self._lines = now, 0
        if self._lines >= _LINES_PER_MINUTE:
            self._untold += 1
            return False
        if len(self._seen) >= _REMEMBERED:
            self._seen.clear()
        self._seen[(what, source)] = now
        self._lines += 1
        if self._untold:
            message += f" (and {self._untold} more refusals not logged, to keep the log readable)"
            self._untold = 0
        log.warning("%s", message)
        return True


def handshake_failure(code: int, endpoint: str, directory: str) -> tuple[str, str]:
    """(kind, message) for a handshake that failed before any key was checked: libzmq's socket
    monitor reports it (EVENT_HANDSHAKE_FAILED_PROTOCOL) with the listening endpoint, not the peer."""
    if code == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return "no keys", (f"refused a client without CURVE keys on {endpoint}: this server runs with --auth, so "
                           "clients need --secret-key and --server-key (secret_key= and server_key= in Python)")
    if code == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        return "server key", (f"refused a CURVE handshake on {endpoint}: the client's server key is not this "
                              f"server's public key ({os.path.join(directory, 'server.key')})")
    return f"protocol {code:#x}", f"a handshake on {endpoint} failed (ZMTP protocol error {code:#x})"


class RoleAuthenticator(ThreadAuthenticator):
    """Admits the keys listed under actors/ and learners/; the User-Id of a message is its role.
    Refused keys are logged (`RefusalLog`) with the address they came from."""

    def __init__(self, context: zmq.Context[Any], directory: str | os.PathLike[str]) -> None:
        super().__init__(context)
        self.directory = os.fspath(directory)
        self._roles: dict[bytes, str] = {}
        self._reported: set[str] = set()
        self._warned_empty = False
        self._address = "an unknown address"
        self._refusals = RefusalLog()
        self.reload()
        # pyzmq's own device for deciding on keys: it calls self.callback(domain, key) (below).
        self.configure_curve_callback("*", self)

    def reload(self) -> int:
        """Re-read the key directories (keys dropped in later are admitted); returns the count.

        Unreadable files are skipped (and logged once). At start-up no usable key is an error;
        later, an empty or unreadable directory keeps the keys already admitted.

        Raises:
            ConfigError: at the first load, no client key could be read.
        """
        roles, unreadable = _role_keys(self.directory)
        for path in set(unreadable) - self._reported:
            log.warning("skipping the unreadable key file %s", path)
        self._reported = set(unreadable)
        if not roles:
            if not self._roles:
                raise ConfigError(f"no client keys under {self.directory!r}/actors or /learners")
            if not self._warned_empty:
                log.warning("no readable client keys under %s any more; keeping the %d admitted before",
                            self.directory, len(self._roles))
                self._warned_empty = True
            return len(self._roles)
        self._warned_empty = False
        self._roles = roles  # one assignment: the authenticator thread sees the old dict or the new one
        return len(roles)

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        # The credentials callback is not told who asks: note the peer's address first (frame 3 of
        # a ZAP request; the authenticator thread handles one request at a time).
        self._address = msg[3].decode("utf-8", "replace") if len(msg) > 3 and msg[3] else "an unknown address"
        await super().handle_zap_message(msg)

    def callback(self, domain: str, key: bytes) -> bool:
        """Admit `key` (Z85) when it is listed; log a refusal otherwise."""
        if key in self._roles:
            return True
        text = key.decode("ascii", "replace")
        self._refusals.refused(text, self._address, (
            f"refused a CURVE handshake from {self._address}: its key {text} is not listed under "
            f"{os.path.join(self.directory, 'actors')} or {os.path.join(self.directory, 'learners')} (copy the "
            "client's public .key file there to admit it; it is picked up while the server runs)"))
        return False

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self._roles.get(z85.encode(client_public_key), LEARNER)
