"""Settings of the server and the clients: frozen dataclasses, every default in one place.

Pure: no sockets, no files. The CLI builds these from flags; tests build them directly.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
from dataclasses import dataclass, field
from typing import Any

from h5replay.errors import ConfigError
from h5replay.protocol import DEFAULT_LIMITS, Limits
from h5replay.sampling import SamplingConfig

__all__ = ["ServerConfig", "ClientConfig", "DEFAULT_ENDPOINT", "read_endpoint_for"]

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5555"


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


def is_loopback_host(host: str) -> bool:
    """True for "localhost" and for IP addresses of the loopback network (127.0.0.0/8, ::1),
    decided by parsing the address: a name like "127.0.0.1.nip.io" resolves anywhere."""
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_loopback(endpoint: str) -> bool:
    """True for ipc:// and for tcp:// endpoints on a loopback address (see `is_loopback_host`)."""
    if endpoint.startswith("ipc://"):
        return True
    host = endpoint[len("tcp://") :].rpartition(":")[0] if endpoint.startswith("tcp://") else ""
    return is_loopback_host(host)


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
    # A session without an open segment and no request for this long is forgotten (its slot freed).
    idle_timeout: float = 30.0
    # With auth_dir: sessions one key may hold at once, and slots of limits.max_clients that only
    # actor keys may take, so that learners can never lock actors out (None: a quarter).
    max_clients_per_key: int = 64
    actor_slots: int | None = None
    fsync: bool = False  # fsync every commit: survives power loss, not just a process crash
    # Priority updates are acknowledged once applied in memory and published (written, flushed,
    # shown to readers) at the end of the writer's pass, with its commits. A value > 0 lets a
    # pass that only applied updates leave them unpublished until the oldest is this many seconds
    # old: fewer flushes (worth it with fsync), and a SIGKILL may lose that long of updates.
    priority_publish_interval: float = 0.0
    # Seconds opening the file may take (a damaged file keeps HDF5 retrying); SIGTERM stops it too.
    open_timeout: float = 30.0
    # Bytes one client may have in flight towards a server process, and bytes of replies it may
    # leave unread, before it is disconnected; then the same for all clients together. None:
    # 4x, 8x, 16x and 16x max_message_bytes (at least 16 MiB each). See server/guard.py.
    client_bytes_in: int | None = None
    client_bytes_out: int | None = None
    total_bytes_in: int | None = None
    total_bytes_out: int | None = None
    # Free bytes the disk must keep: below it, new rows are refused (DiskFullError) and reads go
    # on; writes resume once space is freed. None: 1 GiB or 5% of the file system, the smaller.
    min_free_bytes: int | None = None
    # Memory all open segments together may buffer before they spill rows to the file's staging
    # area (each starts with a small block that grows; none is held up front).
    staging_memory_bytes: int = 128 * 1024 * 1024
    # A reader process that has not looked at its socket for this long (stopped, or stuck) is
    # killed and replaced.
    reader_timeout: float = 10.0
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
    # How many of the latest episodes keep their idempotency keys, for a new file (None: 65,536);
    # an existing file keeps its own (when given, it must be the file's).
    idempotency_window: int | None = None

    def __post_init__(self) -> None:
        if self.idempotency_window is not None and (
                type(self.idempotency_window) is not int or self.idempotency_window < 1):
            raise ConfigError(f"idempotency_window must be an int >= 1 (episodes) or None, got {self.idempotency_window!r}")
        if self.num_readers < 0:
            raise ConfigError(f"num_readers must be >= 0, got {self.num_readers}")
        if self.num_readers and not self.multiprocessing:
            raise ConfigError("reader processes need multiprocessing=True (SWMR); use num_readers=0")
        for name in ("heartbeat_interval", "heartbeat_timeout", "session_timeout", "idle_timeout", "open_timeout",
                     "reader_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if not 0 <= self.priority_publish_interval <= 1:
            raise ConfigError(f"priority_publish_interval must be between 0 and 1 second, got "
                              f"{self.priority_publish_interval!r}")
        if self.max_in_flight < 1:
            raise ConfigError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        for name in ("client_bytes_in", "client_bytes_out", "total_bytes_in", "total_bytes_out"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ConfigError(f"{name} must be an int >= 1 or None, got {value!r}")
        if type(self.max_clients_per_key) is not int or self.max_clients_per_key < 1:
            raise ConfigError(f"max_clients_per_key must be an int >= 1, got {self.max_clients_per_key!r}")
        if not 0 <= self.resolved_actor_slots < self.limits.max_clients:
            raise ConfigError(f"actor_slots must be >= 0 and below max_clients={self.limits.max_clients}, got "
                              f"{self.actor_slots!r}")
        if self.min_free_bytes is not None and (type(self.min_free_bytes) is not int or self.min_free_bytes < 0):
            raise ConfigError(f"min_free_bytes must be an int >= 0 or None, got {self.min_free_bytes!r}")
        if type(self.staging_memory_bytes) is not int or self.staging_memory_bytes < 0:
            raise ConfigError(f"staging_memory_bytes must be an int >= 0, got {self.staging_memory_bytes!r}")
        read_endpoint_for(self.bind)  # validates the endpoint's form
        exposed = not (is_loopback(self.bind) and is_loopback(self.resolved_read_bind))
        if exposed and not self.insecure and self.auth_dir is None:
            raise ConfigError(
                f"binding {self.bind} exposes the store beyond this machine without authentication; "
                "pass --auth DIR (see `h5replay keys generate`), bind 127.0.0.1, or pass --insecure"
            )
        if self.metrics_port is not None and not is_loopback_host(self.metrics_address) and not self.insecure \
                and self.auth_dir is None:
            raise ConfigError(
                f"--metrics-address {self.metrics_address} serves the metrics beyond this machine, over plain HTTP; "
                "keep it on 127.0.0.1, or pass --insecure (or run with --auth) to mean it"
            )
        if os.path.isdir(self.path):
            raise ConfigError(f"{self.path!r} is a directory; give the HDF5 file's path")

    @property
    def resolved_actor_slots(self) -> int:
        return self.limits.max_clients // 4 if self.actor_slots is None else self.actor_slots

    def resolved_min_free_bytes(self) -> int:
        """`min_free_bytes`, or its default for the file system holding `path` (reads the disk)."""
        if self.min_free_bytes is not None:
            return self.min_free_bytes
        try:
            st = os.statvfs(os.path.dirname(os.path.abspath(self.path)))
        except OSError:
            return 1 << 30
        return min(1 << 30, st.f_blocks * st.f_frsize // 20)

    def byte_budgets(self) -> tuple[int, int, int, int]:
        """(client in, client out, total in, total out) bytes: see `client_bytes_in`."""
        unit = self.limits.max_message_bytes
        floor = 16 * 1024 * 1024
        chosen = (self.client_bytes_in, self.client_bytes_out, self.total_bytes_in, self.total_bytes_out)
        defaults = (4 * unit, 8 * unit, 16 * unit, 16 * unit)
        return tuple(max(floor, d) if c is None else c for c, d in zip(chosen, defaults))  # type: ignore[return-value]

    @property
    def resolved_read_bind(self) -> str:
        return self.read_bind or read_endpoint_for(self.bind)

    def replace(self, **changes: Any) -> ServerConfig:
        return dataclasses.replace(self, **changes)


def process_name(prefix: str) -> str:
    """`prefix-host-pid`, unique per process across machines and containers. A pid alone is not:
    the containers of one service often run their program under the same pid, and over several
    shards an actor's name picks its home shard, so they would all pile onto one."""
    return f"{prefix}-{socket.gethostname()}-{os.getpid()}"


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
