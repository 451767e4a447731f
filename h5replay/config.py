"""Settings of the server and the clients: frozen dataclasses, every default in one place.

Pure: no sockets, no files. The CLI builds these from flags; tests build them directly.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import numbers
import os
import re
import socket
from dataclasses import dataclass, field
from typing import Any

from h5replay.errors import ConfigError
from h5replay.protocol import DEFAULT_LIMITS, Limits
from h5replay.sampling import SamplingConfig, Table, check_tables

__all__ = ["ServerConfig", "ClientConfig", "DEFAULT_ENDPOINT", "MAX_SECONDS", "read_endpoint_for", "check_endpoint", "check_seconds"]

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5555"
#: The longest duration a setting may take (about three years): anything longer is a typo, and
#: the timers that take these (setitimer, libzmq's int milliseconds) overflow not far beyond.
MAX_SECONDS = 1e8
_MAX_HEARTBEAT_SECONDS = 6553.0  # libzmq's ZMQ_HEARTBEAT_TTL holds at most 6553.599 s
_MAX_CLIENT_SECONDS = 1e6  # a client's timeout goes to libzmq as int milliseconds (at most ~24 days)
_MAX_READERS = 1024
_MAX_ROWS = 1 << 62  # row and episode ids are int64: a capacity or a key window beyond is no size
_MAX_QUEUED = 1 << 20  # max_in_flight becomes a libzmq high-water mark, an int
_PORT = re.compile(r"[0-9]+")


def check_endpoint(endpoint: Any, name: str, *, any_port: bool = False) -> None:
    """Raise ConfigError unless `endpoint` is ipc://PATH or tcp://HOST:PORT with a port up to
    65535 (0, any free port, only where `any_port`: a bind). libzmq itself takes a larger port
    modulo 65536, binding a port nobody asked for.

    Raises:
        ConfigError: the message names the setting (`name`), the endpoint and what is wrong.
    """
    example = "e.g. tcp://127.0.0.1:5555 or ipc:///tmp/h5replay.sock"
    if not isinstance(endpoint, str):
        raise ConfigError(f"{name} must be an endpoint string ({example}), got {endpoint!r}")
    if endpoint.startswith("ipc://"):
        if endpoint == "ipc://":
            raise ConfigError(f"{name} {endpoint!r} names no path ({example})")
        return
    if not endpoint.startswith("tcp://"):
        raise ConfigError(f"{name} {endpoint!r} must start with tcp:// or ipc:// ({example})")
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    lowest = 0 if any_port else 1
    if not host or not _PORT.fullmatch(port) or not lowest <= int(port) <= 65535:
        raise ConfigError(f"{name} {endpoint!r} needs a host and a port from {lowest} to 65535"
                          f"{' (0: any free one)' if any_port else ''}, {example}")


def check_seconds(name: str, value: Any, *, zero: bool = False, most: float = MAX_SECONDS) -> None:
    """Raise ConfigError unless `value` is a finite number of seconds above 0 (or 0 itself, with
    `zero`) and at most `most`: NaN, infinities and bools are refused."""
    number = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else math.nan
    if not math.isfinite(number) or not (0 <= number if zero else 0 < number) or number > most:
        raise ConfigError(f"{name} must be a finite number of seconds {'>=' if zero else '>'} 0 and <= {most:g}, "
                          f"got {value!r}")


def _check_int(name: str, value: Any, lowest: int, highest: int | None = None, *, none: bool = False) -> None:
    """Raise ConfigError unless `value` is an int (not a bool) in [lowest, highest], or None with `none`."""
    if none and value is None:
        return
    number = int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else None
    if number is None or number < lowest or (highest is not None and number > highest):
        bound = f">= {lowest}" if highest is None else f">= {lowest} and <= {highest}"
        raise ConfigError(f"{name} must be an int {bound}{' or None' if none else ''}, got {value!r}")


def read_endpoint_for(endpoint: str) -> str:
    """The learners' endpoint next to a writer endpoint: the next TCP port (port 0, any free port,
    stays 0), or `<path>.read` for ipc.

    Raises:
        ConfigError: `endpoint` is not a bind endpoint (see `check_endpoint`).
    """
    check_endpoint(endpoint, "endpoint", any_port=True)
    if endpoint.startswith("ipc://"):
        return endpoint + ".read"
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    return f"tcp://{host}:{int(port) + 1 if int(port) else 0}"


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
    # Several tables of a new file, by name (`serve --tables FILE`); not with `sampling`. For an
    # existing file, when given, they must be the file's own.
    tables: dict[str, Table] | None = None
    # Refuse Box values outside the space's bounds, and NaN, as gymnasium's `contains` would
    # (`serve --no-check-bounds` turns it off: then the server stores what fits the dtype and shape).
    check_bounds: bool = True
    # The keys of the space that are the observation, for a new file (`serve --observation-keys
    # obs`): episodes then keep their final observation and learners draw n-step transitions.
    # An existing file keeps its own (when given, they must be the file's).
    observation_keys: tuple[str, ...] | None = None
    # How many of the latest episodes keep their idempotency keys, for a new file (None: 65,536);
    # an existing file keeps its own (when given, it must be the file's).
    idempotency_window: int | None = None

    def __post_init__(self) -> None:
        _check_int("capacity", self.capacity, 1, _MAX_ROWS, none=True)
        _check_int("idempotency_window", self.idempotency_window, 1, _MAX_ROWS, none=True)
        _check_int("num_readers", self.num_readers, 0, _MAX_READERS)
        if self.tables is not None:
            if self.sampling is not None:
                raise ConfigError("give either tables or sampling (one table), not both")
            check_tables(self.tables)
        if self.num_readers and not self.multiprocessing:
            raise ConfigError("reader processes need multiprocessing=True (SWMR); use num_readers=0")
        for name in ("session_timeout", "idle_timeout", "open_timeout", "reader_timeout"):
            check_seconds(name, getattr(self, name))
        # In whole milliseconds to libzmq: below 1 ms a heartbeat would be off.
        for name in ("heartbeat_interval", "heartbeat_timeout"):
            check_seconds(name, getattr(self, name), most=_MAX_HEARTBEAT_SECONDS)
            if getattr(self, name) < 1e-3:
                raise ConfigError(f"{name} must be at least 0.001 seconds (libzmq counts milliseconds), got "
                                  f"{getattr(self, name)!r}")
        check_seconds("priority_publish_interval", self.priority_publish_interval, zero=True, most=1.0)
        _check_int("max_in_flight", self.max_in_flight, 1, _MAX_QUEUED)
        for name in ("client_bytes_in", "client_bytes_out", "total_bytes_in", "total_bytes_out"):
            _check_int(name, getattr(self, name), 1, none=True)
        _check_int("max_clients_per_key", self.max_clients_per_key, 1)
        _check_int("actor_slots", self.actor_slots, 0, none=True)
        if not 0 <= self.resolved_actor_slots < self.limits.max_clients:
            raise ConfigError(f"actor_slots must be >= 0 and below max_clients={self.limits.max_clients}, got "
                              f"{self.actor_slots!r}")
        _check_int("min_free_bytes", self.min_free_bytes, 0, none=True)
        _check_int("staging_memory_bytes", self.staging_memory_bytes, 0)
        _check_int("metrics_port", self.metrics_port, 1, 65535, none=True)
        check_endpoint(self.bind, "bind", any_port=True)
        if self.read_bind is not None:
            check_endpoint(self.read_bind, "read_bind", any_port=True)
        else:
            try:
                check_endpoint(self.resolved_read_bind, "read_bind", any_port=True)
            except ConfigError:
                raise ConfigError(f"the learners' endpoint would be {self.resolved_read_bind} (the port after bind's "
                                  f"{self.bind}), which is no port; give read_bind (--read-bind)") from None
        if self.advertise_read is not None:
            check_endpoint(self.advertise_read, "advertise_read")
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

    def bound_to(self, bind: str) -> ServerConfig:
        """This config once the actors' endpoint is bound as `bind` (the port the kernel picked
        for port 0): the learners' endpoint stays what it was resolved to before, so a server
        bound to port 0 has its readers bind any free port too, never the port after the picked
        one (which another program may hold)."""
        return self.replace(bind=bind, read_bind=self.resolved_read_bind)


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
    # A learner's reads of compressed leaves (compression="zstd"/"lz4"): False, the records travel as
    # stored and this client decodes them (a fraction of the bytes); True, the server decodes them
    # and sends raw rows (a client without the codec's package).
    raw_rows: bool = False
    # A learner on the host of the server's file (the same kernel, a path to the same file): True,
    # it draws from its own SWMR view of the file with the server's sampling code, nothing copied
    # through the socket (draws that change the server's state, queues and rate limits, are still
    # the server's); False, every draw goes to the server.
    local_reads: bool = True

    def __post_init__(self) -> None:
        check_seconds("timeout", self.timeout, most=_MAX_CLIENT_SECONDS)
        check_seconds("rate_limit_timeout", self.rate_limit_timeout, zero=True, most=86_400)
        check_seconds("shard_retry_interval", self.shard_retry_interval)
        check_seconds("batch_seconds", self.batch_seconds, zero=True)
        check_seconds("heartbeat_interval", self.heartbeat_interval, most=_MAX_CLIENT_SECONDS / 3)
        if self.heartbeat_interval < 1e-3:
            raise ConfigError(f"heartbeat_interval must be at least 0.001 seconds (libzmq counts milliseconds), got "
                              f"{self.heartbeat_interval!r}")
        for name in ("max_in_flight", "batch_rows", "batch_bytes", "commit_attempts"):
            _check_int(name, getattr(self, name), 1)
        for name in ("raw_rows", "local_reads"):  # a string such as "false" would read as True
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        check_endpoint(self.endpoint, "endpoint")
