"""Every number and endpoint of the server's and the clients' settings is checked where it is
given (issue 21, defect 16): a port libzmq would wrap, NaN, an infinity, a duration its timer
cannot hold or a count of the wrong type is a ConfigError naming the setting, never a server that
binds another port or a reader that "failed to start".

Pure: the configs touch no socket (a `path` that does not exist is never opened).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from h5replay.client import ActorClient, LearnerClient
from h5replay.config import ClientConfig, ServerConfig
from h5replay.errors import ConfigError

NAN, INF = math.nan, math.inf


def server(**changes: Any) -> ServerConfig:
    settings: dict[str, Any] = {"path": "/nonexistent/rb.h5", "bind": "tcp://127.0.0.1:0", "read_bind": "tcp://127.0.0.1:0"}
    settings.update(changes)
    return ServerConfig(**settings)


BAD_SERVER = [
    # endpoints: libzmq took port 86546 as 21010 (modulo 65536)
    ("bind", "tcp://127.0.0.1:86546"), ("bind", "tcp://127.0.0.1:65536"), ("bind", "tcp://127.0.0.1:-1"),
    ("bind", "tcp://127.0.0.1:"), ("bind", "tcp://127.0.0.1"), ("bind", "tcp://:5555"), ("bind", "udp://127.0.0.1:5555"),
    ("bind", "ipc://"), ("bind", "tcp://127.0.0.1:\u00b2"), ("bind", 5555), ("read_bind", "tcp://127.0.0.1:70000"),
    ("advertise_read", "tcp://server:0"), ("advertise_read", "tcp://server:99999"),
    # durations: NaN passed `<= 0`; inf and huge values overflow the timers that take them
    *[(name, value) for name in ("session_timeout", "idle_timeout", "open_timeout", "reader_timeout",
                                 "heartbeat_interval", "heartbeat_timeout")
      for value in (NAN, INF, -INF, 0.0, -1.0, 1e9, True, "5")],
    ("heartbeat_timeout", 7000.0), ("heartbeat_interval", 1e-4), ("heartbeat_timeout", 1e-4),
    ("priority_publish_interval", NAN), ("priority_publish_interval", INF), ("priority_publish_interval", -0.1),
    ("priority_publish_interval", 1.5),
    # counts and sizes
    ("num_readers", -1), ("num_readers", 5000), ("num_readers", 1.5), ("num_readers", True), ("max_in_flight", 0),
    ("max_in_flight", 1 << 40), ("max_in_flight", 2.0), ("metrics_port", 0), ("metrics_port", 65536),
    ("metrics_port", 9100.0), ("capacity", 0), ("capacity", 1 << 70), ("capacity", "abc"), ("capacity", NAN),
    ("idempotency_window", 1 << 70), ("idempotency_window", 0), ("staging_memory_bytes", -1),
    ("staging_memory_bytes", NAN), ("min_free_bytes", NAN), ("min_free_bytes", -1), ("client_bytes_in", INF),
    ("max_clients_per_key", 0), ("actor_slots", -1),
]


@pytest.mark.parametrize(("name", "value"), BAD_SERVER, ids=[f"{n}={v!r}" for n, v in BAD_SERVER])
def test_a_bad_server_setting_is_a_config_error_naming_it(name, value):
    with pytest.raises(ConfigError, match=name):
        server(**{name: value})


def test_the_default_read_port_after_port_65535_is_refused_naming_read_bind():
    with pytest.raises(ConfigError, match="65536.*read_bind"):
        server(bind="tcp://127.0.0.1:65535", read_bind=None)


def test_a_server_bound_to_port_0_keeps_its_readers_on_port_0_once_the_kernel_picked_its_port():
    """Regression: bound to tcp://127.0.0.1:0 without read_bind, the readers were given the port
    after the one the kernel picked, which another program may hold (a reader that "failed to
    start" with EADDRINUSE, seen in make test); they must take any free port as well."""
    config = server(read_bind=None)
    assert config.bound_to("tcp://127.0.0.1:40000").resolved_read_bind == "tcp://127.0.0.1:0"
    explicit = server(bind="tcp://127.0.0.1:7000", read_bind=None).bound_to("tcp://127.0.0.1:7000")
    assert explicit.resolved_read_bind == "tcp://127.0.0.1:7001"  # a chosen port keeps the next one


GOOD_SERVER = [
    {"bind": "tcp://127.0.0.1:65535", "read_bind": "tcp://127.0.0.1:65534"}, {"bind": "tcp://*:5555", "insecure": True},
    {"bind": "tcp://[::1]:5555", "read_bind": None}, {"bind": "ipc:///tmp/x.sock", "read_bind": None},
    {"advertise_read": "tcp://server:5556"}, {"heartbeat_interval": 0.001, "heartbeat_timeout": 6553},
    {"session_timeout": np.float64(30), "idle_timeout": 1, "open_timeout": 1e8}, {"priority_publish_interval": 0},
    {"num_readers": np.int64(2), "capacity": 1 << 62, "metrics_port": 65535},
]


@pytest.mark.parametrize("changes", GOOD_SERVER, ids=[",".join(map(str, c.values())) for c in GOOD_SERVER])
def test_good_server_settings_are_taken(changes):
    server(**changes)


BAD_CLIENT = [
    ("endpoint", "tcp://127.0.0.1:86546"), ("endpoint", "tcp://127.0.0.1:0"), ("endpoint", "tcp://server"),
    ("endpoint", "udp://server:5555"), ("endpoint", None),
    *[(name, value) for name in ("timeout", "shard_retry_interval", "heartbeat_interval")
      for value in (NAN, INF, 0.0, -1.0, 1e9)],
    ("rate_limit_timeout", NAN), ("rate_limit_timeout", INF), ("rate_limit_timeout", -1.0),
    ("batch_seconds", NAN), ("batch_seconds", INF), ("batch_seconds", -1.0),
    ("max_in_flight", 0), ("batch_rows", 1.5), ("batch_bytes", 0), ("commit_attempts", True),
    ("local_reads", "false"), ("local_reads", 0), ("raw_rows", None),
]


@pytest.mark.parametrize(("name", "value"), BAD_CLIENT, ids=[f"{n}={v!r}" for n, v in BAD_CLIENT])
def test_a_bad_client_setting_is_a_config_error_naming_it(name, value):
    with pytest.raises(ConfigError, match=name):
        ClientConfig(**{name: value})


def test_good_client_settings_are_taken():
    ClientConfig(endpoint="tcp://server:65535", timeout=1e6, rate_limit_timeout=0, batch_seconds=0)
    ClientConfig(endpoint="ipc:///tmp/x.sock", heartbeat_interval=np.float64(0.5))


@pytest.mark.parametrize("client", [ActorClient, LearnerClient])
def test_clients_refuse_a_port_out_of_range_before_connecting(client):
    with pytest.raises(ConfigError, match="86546"):
        client("tcp://127.0.0.1:86546", timeout=0.1)
    with pytest.raises(ConfigError, match="86546"):  # every shard's endpoint
        client(endpoints=["tcp://127.0.0.1:5555", "tcp://127.0.0.1:86546"], timeout=0.1)
