"""Settings of the server and the clients: frozen dataclasses, every default in one place.

Pure: no sockets, no files. The CLI builds these from flags; tests build them directly.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from h5replay.errors import ConfigError
from h5replay.protocol import DEFAULT_LIMITS, Limits
from h5replay.sampling import SamplingConfig

__all__ = ["ServerConfig", "ClientConfig", "DEFAULT_ENDPOINT", "read_endpoint_for"]

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5555"
_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")


def read_endpoint_for(endpoint: str) -> str:
    """The learners' endpoint next to a writer endpoint: the next TCP port (port 0, any free port,
    stays 0), or `<path>.read` for ipc."""
    if endpoint.startswith("ipc://"):
        return endpoint + ".read"
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://") :].rpartition(":")
        if not port.isdigit():
            raise ConfigError(f"endpoint {endpoint!r} needs an explicit port (0: any free one), e.g. tcp://127.0.0.1:5555")
        return f"tcp://{host}:{int(port) + 1 if int(port) else 0}"
    raise ConfigError(f"endpoint {endpoint!r} must start with tcp:// or ipc://")


def is_loopback(endpoint: str) -> bool:
    """True for ipc:// and for tcp:// endpoints on a loopback address."""
    if endpoint.startswith("ipc://"):
        return True
    host = endpoint[len("tcp://") :].rpartition(":")[0] if endpoint.startswith("tcp://") else ""
    return host in _LOOPBACK_HOSTS or host.startswith("127.")


@dataclass(frozen=True)
class ServerConfig:
    """Everything `h5replay serve` needs. `space` (a Space) and `capacity` only for a new file."""

    path: str
    space: Any = None
    capacity: int | None = None
    bind: str = DEFAULT_ENDPOINT
    read_bind: str | None = None  # default: read_endpoint_for(bind)
    # What learners are told to connect to for reads, when read_bind is not reachable as written
    # (e.g. tcp://0.0.0.0:5556 inside a container: advertise tcp://server:5556).
    advertise_read: str | None = None
    num_readers: int = 1
    multiprocessing: bool = True  # SWMR: reader processes read while the writer writes
    limits: Limits = DEFAULT_LIMITS
    # Requests of one client the server will queue before that client's sends block.
    max_in_flight: int = 8
    # ZMTP heartbeats: a peer silent this long (its libzmq, not its Python) is disconnected.
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0
    # A session with open segments and no request for this long has them aborted.
    session_timeout: float = 300.0
    fsync: bool = False  # fsync every commit: survives power loss, not just a process crash
    storage_kwargs: dict[str, Any] = field(default_factory=dict)
    metrics_port: int | None = None  # serve Prometheus metrics over HTTP on this port
    metrics_address: str = "127.0.0.1"
    auth_dir: str | None = None  # CURVE keys (h5replay keys generate): only listed clients connect
    insecure: bool = False  # allow a non-loopback bind without authentication
    # Sampler, rate limit and max_times_sampled of a new file (None: uniform, no limit); for an
    # existing file, when given, they must be the file's own.
    sampling: SamplingConfig | None = None
    # Refuse Box values outside the space's bounds, and NaN, as gymnasium's `contains` would
    # (`serve --no-check-bounds` turns it off: then the server stores what fits the dtype and shape).
    check_bounds: bool = True

    def __post_init__(self) -> None:
        if self.num_readers < 0:
            raise ConfigError(f"num_readers must be >= 0, got {self.num_readers}")
        if self.num_readers and not self.multiprocessing:
            raise ConfigError("reader processes need multiprocessing=True (SWMR); use num_readers=0")
        for name in ("heartbeat_interval", "heartbeat_timeout", "session_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.max_in_flight < 1:
            raise ConfigError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        read_endpoint_for(self.bind)  # validates the endpoint's form
        exposed = not (is_loopback(self.bind) and is_loopback(self.resolved_read_bind))
        if exposed and not self.insecure and self.auth_dir is None:
            raise ConfigError(
                f"binding {self.bind} exposes the store beyond this machine without authentication; "
                "pass --auth DIR (see `h5replay keys generate`), bind 127.0.0.1, or pass --insecure"
            )
        if os.path.isdir(self.path):
            raise ConfigError(f"{self.path!r} is a directory; give the HDF5 file's path")

    @property
    def resolved_read_bind(self) -> str:
        return self.read_bind or read_endpoint_for(self.bind)

    def replace(self, **changes: Any) -> ServerConfig:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ClientConfig:
    """How a client talks to the server."""

    endpoint: str = DEFAULT_ENDPOINT
    timeout: float = 10.0  # seconds to wait for any reply before ServerUnavailableError
    name: str = "h5replay-client"
    max_in_flight: int = 4  # requests sent before waiting for a reply (actors pipeline appends)
    batch_rows: int = 256  # an actor sends steps in messages of up to this many rows...
    batch_bytes: int = 4 * 1024 * 1024  # ... or this many bytes ...
    # ... or once the first buffered step is this old, whichever comes first. An episode that fits in
    # one message within this time travels as a single push: one round trip.
    batch_seconds: float = 1.0
    heartbeat_interval: float = 1.0
    # How long the server may hold a commit or a sample back for its rate limit (Reverb's
    # rate_limiter_timeout) before refusing it with RateLimitedError.
    rate_limit_timeout: float = 60.0
    # Over several servers (endpoints=[...]): a shard that did not answer is probed again (in the
    # background) this often, and used again once it answers.
    shard_retry_interval: float = 2.0
    # A commit or push whose reply does not come within `timeout` is sent again with the same
    # idempotency key (the server answers a retry of a commit it applied with the original
    # receipt): this many sends in all, the last one also waiting out `rate_limit_timeout` when
    # the server has a rate limit.
    commit_attempts: int = 3

    def __post_init__(self) -> None:
        if self.timeout <= 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {self.timeout}")
        if not 0 <= self.rate_limit_timeout <= 86_400:
            raise ConfigError(f"rate_limit_timeout must be in [0, 86400] seconds, got {self.rate_limit_timeout}")
        if self.shard_retry_interval <= 0:
            raise ConfigError(f"shard_retry_interval must be > 0 seconds, got {self.shard_retry_interval}")
        if self.max_in_flight < 1 or self.batch_rows < 1 or self.batch_bytes < 1 or self.commit_attempts < 1:
            raise ConfigError("max_in_flight, batch_rows, batch_bytes and commit_attempts must be >= 1")
        if not self.endpoint.startswith(("tcp://", "ipc://")):
            raise ConfigError(f"endpoint {self.endpoint!r} must start with tcp:// or ipc://")
