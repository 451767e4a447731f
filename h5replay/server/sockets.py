"""How the server's listening sockets are set up: one place for the writer and the readers."""

from __future__ import annotations

from typing import Any

import zmq

from h5replay.config import ServerConfig

__all__ = ["configure_router"]


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
