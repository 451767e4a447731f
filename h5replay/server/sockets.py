"""How the server's listening sockets are set up: one place for the writer, the readers and the
read front.

Every ROUTER facing clients reads its peers without pause (RCVHWM 0): a high-water mark that
stops reading a peer is the state in which libzmq 4.3.5 aborts the process when the peer then
hangs up (`Assertion failed: !_io_error`, libzmq issue 4841; see guard.py). What a client may
make the server hold is bounded by the connection guard instead, and ZMQ_MAXMSGSIZE refuses a
single oversized frame before libzmq allocates it.
"""

from __future__ import annotations

from typing import Any

import zmq

from h5replay.config import ServerConfig

__all__ = ["configure_router", "router_options"]


def router_options(config: ServerConfig, curve: tuple[bytes, bytes] | None, *, mandatory: bool) -> list[tuple[int, Any]]:
    """The (option, value) pairs of a client-facing ROUTER, in the order they must be set.

    `mandatory`: a reply to a peer that is gone raises (the writer then drops its session);
    readers set it off, so a learner that left is simply not answered. `curve`: the server's
    public and secret key.
    """
    options: list[tuple[int, Any]] = [
        (zmq.LINGER, 1000),
        (zmq.ROUTER_MANDATORY, 1 if mandatory else 0),
        # libzmq disconnects a peer sending a larger frame, without a word and before allocating
        # it; room above the message limit lets decode, which names the limit, see it first.
        (zmq.MAXMSGSIZE, 2 * config.limits.max_message_bytes),
        (zmq.RCVHWM, 0),  # never stop reading a peer: see the module docstring
        (zmq.SNDHWM, max(1000, config.max_in_flight)),
        (zmq.HEARTBEAT_IVL, int(config.heartbeat_interval * 1000)),
        (zmq.HEARTBEAT_TIMEOUT, int(config.heartbeat_timeout * 1000)),
        (zmq.HEARTBEAT_TTL, int(config.heartbeat_timeout * 1000)),
    ]
    if curve is not None:
        options += [(zmq.CURVE_SERVER, 1), (zmq.CURVE_PUBLICKEY, curve[0]), (zmq.CURVE_SECRETKEY, curve[1])]
    return options


def configure_router(sock: zmq.Socket[Any], config: ServerConfig, curve: tuple[bytes, bytes] | None, *,
                     mandatory: bool) -> None:
    """Limits, heartbeats and (with `curve`) encryption on a client-facing ROUTER."""
    for option, value in router_options(config, curve, mandatory=mandatory):
        sock.setsockopt(option, value)
