"""CURVE authentication with two roles, checked on every message: actor keys may write, learner
keys may only read.

A key directory (made by `h5replay keys generate DIR`, in pyzmq's `zmq.auth` file format)::

    DIR/server.key  DIR/server.key_secret     the server's key pair
    DIR/actor.key   DIR/actor.key_secret      a client key pair for actors
    DIR/learner.key DIR/learner.key_secret    a client key pair for learners
    DIR/actors/*.key                          public keys allowed to write (drop more in)
    DIR/learners/*.key                        public keys allowed to read

libzmq encrypts every connection; a ZAP handler thread admits only listed keys and tags every
message with the client's public key as its User-Id. The server looks the key's role up again
for each message (`role_of`), so a key removed or moved to learners/ loses what it had within a
reload interval, on connections already open too; the writer then closes the sessions of a
removed key and aborts the open segments of a demoted one. The directories are re-read every
second by a thread of their own (never by a server's loop), skipping anything that is not a
regular file; emptying or removing them revokes every key. A directory or key file that cannot
be read (the process is out of descriptors, say, or lacks permission) is no removal: the keys it
held stay as they were (and new ones wait) until it can be read again, so that running out of a
resource never revokes everyone's keys. A refused client gets no answer at all (it cannot
tell a refusal from a dead server), so the server logs each refusal, once per key and address
and at most a few lines a minute (`RefusalLog`).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from h5replay.errors import ConfigError

__all__ = [
    "generate_keys", "RoleAuthenticator", "RefusalLog", "handshake_failure", "server_keys", "read_public_key", "ACTOR",
    "LEARNER",
]

ACTOR, LEARNER = "actor", "learner"
log = logging.getLogger("h5replay.server")
_ROLE_DIRS = {ACTOR: "actors", LEARNER: "learners"}
_REPEAT_AFTER = 300.0  # seconds before the same refusal (what, from where) is logged again
_LINES_PER_MINUTE = 10  # refusal lines at most; the rest are counted and the count told in the next line
_REMEMBERED = 10_000  # (what, from where) pairs remembered; forgotten all at once past this


def _write_certificate(path: str, public: bytes, secret: bytes | None) -> None:
    """A certificate file in pyzmq's format, created with its final permissions from its first byte
    (0600 for a secret, never readable by others even for an instant) under a temporary name, then
    renamed into place."""
    lines = [f"#   ****  Generated on {datetime.datetime.now()} by h5replay  ****", "", "metadata", "curve",
             f'    public-key = "{public.decode("ascii")}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode("ascii")}"')
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if secret is not None else 0o644)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def generate_keys(directory: str | os.PathLike[str]) -> list[str]:
    """Create server, actor and learner key pairs in `directory`; returns the files written.
    Secret keys are created 0600 (see `_write_certificate`), in a directory made 0700 if new.

    Raises:
        ConfigError: the directory already holds a server key (never overwrite keys).
    """
    root = os.fspath(directory)
    if os.path.exists(os.path.join(root, "server.key_secret")):
        raise ConfigError(f"{root!r} already holds keys; remove them or choose another directory")
    os.makedirs(root, mode=0o700, exist_ok=True)
    written = []
    for name in ("server", ACTOR, LEARNER):
        public, secret = zmq.curve_keypair()
        base = os.path.join(root, name)
        _write_certificate(base + ".key", public, None)
        _write_certificate(base + ".key_secret", public, secret)
        written += [base + ".key", base + ".key_secret"]
        if name in _ROLE_DIRS:
            os.makedirs(os.path.join(root, _ROLE_DIRS[name]), exist_ok=True)
            target = os.path.join(root, _ROLE_DIRS[name], f"{name}.key")
            _write_certificate(target, public, None)
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


_KEY_LINE = re.compile(rb'^\s*public-key\s*=\s*["\']?([0-9A-Za-z.\-:+=^!/*?&<>()\[\]{}@%$#]{40})["\']?\s*$', re.M)
_MAX_KEY_FILE = 64 * 1024


def read_public_key(path: str) -> bytes | None:
    """The public key (Z85) in a certificate file, never blocking: anything but a regular file (a
    FIFO, a device) is skipped (None), as is a file without a key or bigger than 64 KiB.

    Raises:
        OSError: the file cannot be opened or read.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO opens at once, unread
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _MAX_KEY_FILE:
            return None
        data = os.read(fd, _MAX_KEY_FILE + 1)
    finally:
        os.close(fd)
    match = _KEY_LINE.search(data)
    return match.group(1) if match else None


@dataclass
class _Listing:
    """What one reading of the key directories found."""

    keys: dict[str, tuple[str, bytes]] = field(default_factory=dict)  # key file -> (role, public key)
    unreadable: list[str] = field(default_factory=list)  # files that hold no key (malformed, not regular)
    failed: dict[str, OSError] = field(default_factory=dict)  # directories or files that could not be read

    def roles(self) -> dict[bytes, str]:
        """{public key: role}; a key listed in both directories gets the actor role."""
        roles: dict[bytes, str] = {}
        for role, key in self.keys.values():
            if roles.get(key) != ACTOR:
                roles[key] = role
        return roles


# What a listing or a read may meet when the directory or the file is really gone: then its keys
# are revoked. Any other error (EMFILE, ENFILE, EACCES, EIO, ENOMEM...) says nothing of the keys.
_GONE = (FileNotFoundError, NotADirectoryError)


def _list_keys(directory: str) -> _Listing:
    """Read every key file under `directory`/actors and /learners."""
    listing = _Listing()
    for role in (LEARNER, ACTOR):
        sub = os.path.join(directory, _ROLE_DIRS[role])
        try:
            names = sorted(os.listdir(sub))
        except _GONE:
            continue  # removed: no key of this role
        except OSError as exc:
            listing.failed[sub] = exc
            continue
        for name in names:
            if not name.endswith(".key"):
                continue
            path = os.path.join(sub, name)
            try:
                public = read_public_key(path)
            except _GONE:
                continue  # removed since it was listed
            except OSError as exc:
                listing.failed[path] = exc
                continue
            if public is None:  # malformed, not a regular file, or still being copied in
                listing.unreadable.append(path)
                continue
            listing.keys[path] = (role, public)
    return listing


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


def handshake_failure(event: int, value: int, endpoint: str, directory: str) -> tuple[str, str]:
    """(kind, message) for a handshake that failed before any key was checked, as libzmq's socket
    monitor reports it: `event` is EVENT_HANDSHAKE_FAILED_PROTOCOL (`value`, a ZMTP protocol error)
    or EVENT_HANDSHAKE_FAILED_NO_DETAIL (`value`, an errno), and `endpoint` is the local address
    the connection came in on (not the peer's).

    A client without keys is not always seen as one: through a proxy that hands it the server's
    whole greeting at once (Docker's port proxy does, now and then), libzmq's client finds the
    mechanism mismatch and hangs up before its own greeting has gone out, so the server sees only
    a connection ending mid-handshake (NO_DETAIL). That is logged too, as the likely mistake."""
    keys_needed = ("this server runs with --auth, so clients need --secret-key and --server-key "
                   "(secret_key= and server_key= in Python)")
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        why = os.strerror(value) if value > 0 else "the connection closed"
        # Kind "no keys", as a mismatch: one mistake, one line, whichever way libzmq saw it first.
        return "no keys", (f"a client on {endpoint} hung up during its handshake ({why}), before saying which "
                           f"mechanism it speaks: most likely a client without CURVE keys; {keys_needed}")
    if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return "no keys", f"refused a client without CURVE keys on {endpoint}: {keys_needed}"
    if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        return "server key", (f"refused a CURVE handshake on {endpoint}: the client's server key is not this "
                              f"server's public key ({os.path.join(directory, 'server.key')})")
    return f"protocol {value:#x}", f"a handshake on {endpoint} failed (ZMTP protocol error {value:#x})"


class RoleAuthenticator(ThreadAuthenticator):
    """Admits the keys listed under actors/ and learners/ and tags each message with its key (the
    User-Id); `role_of(key)` is the key's role now. Refused keys are logged (`RefusalLog`) with the
    address they came from. `start()` also starts the thread that re-reads the directories every
    `reload_interval` seconds; `generation` counts the reloads that changed something."""

    def __init__(self, context: zmq.Context[Any], directory: str | os.PathLike[str], reload_interval: float = 1.0) -> None:
        super().__init__(context)
        self.directory = os.fspath(directory)
        self.reload_interval = reload_interval
        self._roles: dict[bytes, str] = {}
        self.generation = 0
        self._reported: set[str] = set()
        self._address = "an unknown address"
        self._refusals = RefusalLog()
        self._trouble = RefusalLog()  # key directories that could not be read
        self._files: dict[str, tuple[str, bytes]] = {}  # each key file of the last reading -> (role, key)
        self._stop_reloading = threading.Event()
        self._reloader: threading.Thread | None = None
        self.reload(first=True)
        # pyzmq's own device for deciding on keys: it calls self.callback(domain, key) (below).
        self.configure_curve_callback("*", self)

    def start(self) -> None:
        super().start()
        self._reloader = threading.Thread(target=self._reload_forever, name="h5replay-keys", daemon=True)
        self._reloader.start()

    def stop(self) -> None:
        self._stop_reloading.set()
        if self._reloader is not None:
            self._reloader.join(5)
            self._reloader = None
        super().stop()

    def _reload_forever(self) -> None:
        while not self._stop_reloading.wait(self.reload_interval):
            try:
                self.reload()
            except Exception:  # a key directory gone wrong must not stop the reloads (nor the server)
                log.exception("re-reading the key directories under %s failed", self.directory)

    def role_of(self, key: str | bytes | None) -> str | None:
        """The role of a client key (Z85, as the User-Id of its messages) now, or None when the
        key is not (or no longer) listed."""
        if key is None:
            return None
        return self._roles.get(key.encode("ascii") if isinstance(key, str) else key)

    def reload(self, first: bool = False) -> int:
        """Re-read the key directories; returns the count of keys admitted. Keys no longer listed
        are revoked at once: a key file removed (or left without a key), a role directory
        emptied or removed. A directory or file that cannot be read (out of descriptors, EMFILE;
        permissions; I/O errors) says nothing about its keys: those it held at the last reading
        stay as they were until it can be read again (a new key there waits), and this is logged
        once in a while. Anything but a regular file is skipped (and logged once).

        Raises:
            ConfigError: at the first load, no client key could be read.
        """
        listing = self._read()
        if any(key not in listing.roles() for key in self._roles):
            # A key moved from one directory to the other while they were listed one after the
            # other is in neither listing. A rename is atomic, and done by now: a second listing
            # finds it in its new place, and a key gone from both is revoked.
            listing = self._read()
        for path in set(listing.unreadable) - self._reported:
            log.warning("skipping the key file %s: not a readable key (or not a regular file)", path)
        self._reported = set(listing.unreadable)
        roles = listing.roles()
        if first and not roles:
            reasons = "".join(f"; cannot read {path}: {exc.strerror}" for path, exc in listing.failed.items())
            raise ConfigError(f"no client keys under {self.directory!r}/actors or /learners{reasons}")
        if roles != self._roles:
            removed = [k for k in self._roles if k not in roles]
            demoted = [k for k, r in self._roles.items() if r == ACTOR and roles.get(k) == LEARNER]
            if not first and (removed or demoted):
                log.warning("key directories changed: %d key(s) revoked, %d moved to learners%s", len(removed),
                            len(demoted), "; no client key is admitted any more" if not roles else "")
            self._roles = roles  # one assignment: the other threads see the old dict or the new one
            self.generation += 1
        return len(roles)

    def _read(self) -> _Listing:
        """A reading of the key directories in which what could not be read keeps the keys it
        had at the last reading (`reload`)."""
        listing = _list_keys(self.directory)
        for place, exc in listing.failed.items():
            self._trouble.refused(
                exc.strerror or type(exc).__name__, place,
                f"cannot read {place} to re-read the keys ({exc.strerror or exc}): the keys it held are kept as they "
                "were until it can be read again (remove a key file to revoke its key)")
            for path, entry in self._files.items():
                if path == place or os.path.dirname(path) == place:
                    listing.keys.setdefault(path, entry)
        self._files = dict(listing.keys)
        return listing

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
        # The key itself, not its role: the server asks for the role of every message.
        return z85.encode(client_public_key).decode("ascii")
