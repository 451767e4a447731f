"""How the server's listening sockets are set up, and how a process says which endpoints it bound:
one place for the writer and the readers."""

from __future__ import annotations

from typing import Any

import zmq

from h5replay.config import ServerConfig

__all__ = ["configure_router", "bound_endpoint", "Started"]


def configure_router(sock: zmq.Socket[Any], config: ServerConfig, curve: tuple[bytes, bytes] | None, *,
                     mandatory: bool) -> None:
    """Limits, heartbeats and (with `curve`, the server's public and secret key) encryption.

    `mandatory`: a reply to a peer that is gone raises (the writer then drops its session);
    readers set it off, so a learner that left is simply not answered.
    """
    sock.linger = 1000
    sock.router_mandatory = 1 if mandatory else 0
    # libzmq disconnects a peer sending a larger frame, without a word; leave room above the
    # message limit so that decode, which answers with an error naming the limit, sees it first.
    sock.maxmsgsize = 2 * config.limits.max_message_bytes
    sock.rcvhwm = config.max_in_flight
    sock.sndhwm = max(1000, config.max_in_flight)
    sock.heartbeat_ivl = int(config.heartbeat_interval * 1000)
    sock.heartbeat_timeout = int(config.heartbeat_timeout * 1000)
    sock.heartbeat_ttl = int(config.heartbeat_timeout * 1000)
    if curve is not None:
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = curve


def bound_endpoint(sock: zmq.Socket[Any]) -> str:
    """The endpoint `sock` last bound, as libzmq resolved it (port 0 becomes the port it took)."""
    return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))


class Started:
    """How a process tells its parent that it serves, and on which endpoints (one bound on port 0
    gets a free port: this is how the parent learns which). Picklable, for spawned processes."""

    def __init__(self, ctx: Any) -> None:
        self._event = ctx.Event()
        self._endpoints = ctx.Queue(1)

    def set(self, endpoints: tuple[str, ...] | None = None) -> None:
        if endpoints is not None:
            self._endpoints.put(endpoints)
        self._event.set()

    def wait(self, timeout: float) -> bool:
        return bool(self._event.wait(timeout))

    def endpoints(self, timeout: float) -> tuple[str, ...]:
        """The endpoints the process bound, in the order it reports them.

        Raises:
            queue.Empty: none came within `timeout` (a process that reports none).
        """
        return tuple(self._endpoints.get(timeout=timeout))
