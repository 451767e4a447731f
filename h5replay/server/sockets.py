"""How the server's listening sockets are set up, and how a process says which endpoints it bound:
one place for the writer, the readers and the read front.

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

__all__ = ["configure_router", "router_options", "bound_endpoint", "Started"]


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
