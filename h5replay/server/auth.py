"""CURVE authentication with two roles: actor keys may write, learner keys may only read.

A key directory (made by `h5replay keys generate DIR`, in pyzmq's `zmq.auth` file format)::

    DIR/server.key  DIR/server.key_secret     the server's key pair
    DIR/actor.key   DIR/actor.key_secret      a client key pair for actors
    DIR/learner.key DIR/learner.key_secret    a client key pair for learners
    DIR/actors/*.key                          public keys allowed to write (drop more in)
    DIR/learners/*.key                        public keys allowed to read

libzmq encrypts every connection; a ZAP handler thread admits only listed keys and tags each
message with its role as the User-Id, which the writer reads off the frames.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from h5replay.errors import ConfigError

__all__ = ["generate_keys", "RoleAuthenticator", "server_keys", "ACTOR", "LEARNER"]

ACTOR, LEARNER = "actor", "learner"
log = logging.getLogger("h5replay.server")
_ROLE_DIRS = {ACTOR: "actors", LEARNER: "learners"}


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


class RoleAuthenticator(ThreadAuthenticator):
    """Admits the keys listed under actors/ and learners/; the User-Id of a message is its role."""

    def __init__(self, context: zmq.Context[Any], directory: str | os.PathLike[str]) -> None:
        super().__init__(context)
        self.directory = os.fspath(directory)
        self._roles: dict[bytes, str] = {}
        self._reported: set[str] = set()
        self._warned_empty = False
        self.reload()

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
        self._roles = roles
        self.certs = {"*": dict.fromkeys(roles, True)}
        return len(roles)

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self._roles.get(z85.encode(client_public_key), LEARNER)
