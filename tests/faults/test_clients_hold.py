"""Clients hold whatever the server does: they never abort, and never hang (issue 14).

Real client code in real processes against raw ZeroMQ servers that misbehave on cue.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import zmq
from service_helpers import endpoint

_READER = textwrap.dedent("""
    import sys, time
    import zmq
    from h5replay import protocol as P
    from h5replay.client._connection import Connection
    from h5replay.config import ClientConfig

    endpoint = sys.argv[1]
    conn = Connection(endpoint, ClientConfig(endpoint=endpoint, timeout=5.0, heartbeat_interval=0.2))
    sock = conn._sock  # the socket as the client configures it; driven by hand below
    try:
        sock.recv(zmq.NOBLOCK)  # nothing there yet: libzmq's command counter starts at 0
    except zmq.Again:
        pass
    sock.send_multipart([bytes(f) for f in P.encode(P.Heartbeat(1))])
    time.sleep(1.0)  # the server sends 60 replies of two frames
    assert sock.poll(1000)  # they are there, and the pipe is active
    print("ready", flush=True)
    sys.stdin.readline()  # the server is gone now: libzmq has a "hiccup" waiting for this socket
    time.sleep(0.5)
    frames = 0
    try:  # no poll here (it would look at the commands first): every 100th recv does, the 100th is a second frame
        while True:
            sock.recv(zmq.NOBLOCK)
            frames += 1
    except zmq.Again:
        pass
    print("read", frames, flush=True)
    conn.close()
""")


@pytest.mark.timeout(60)
def test_a_server_gone_between_two_frames_of_a_reply_does_not_abort_the_client():
    """Seen in CI about once in 5 runs of test_crash_recovery.py: a learner aborted with
    `Assertion failed: !_more (src/fq.cpp:80)` when its server was SIGKILLed mid-reply. With
    ZMQ_IMMEDIATE, libzmq ends a socket's pipe as soon as the connection drops, even between two
    frames of a message the application is reading; the client no longer sets it."""
    where = endpoint()
    server = zmq.Context.instance().socket(zmq.ROUTER)
    server.linger = 0
    server.bind(where)
    client = subprocess.Popen([sys.executable, "-c", _READER, where], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert server.poll(10_000), "the client sent nothing"
        identity = server.recv_multipart()[0]
        for _ in range(60):
            server.send_multipart([identity, b"a" * 10, b"b" * 10])
        assert client.stdout is not None and client.stdin is not None
        assert client.stdout.readline().strip() == "ready"
        server.close(0)  # the connection drops, as when a server is killed
        client.stdin.write("go\n")
        client.stdin.flush()
        out, err = client.communicate(timeout=30)
    finally:
        if client.poll() is None:
            client.kill()
        client.wait(10)
        server.close(0)
    assert client.returncode == 0, f"the client died (exit {client.returncode}): {err[-1000:]}"
    assert "read" in out, out


_SEND_AFTER_POLL = textwrap.dedent("""
    import sys, time
    import zmq
    from h5replay import protocol as P
    from h5replay.client._connection import Connection
    from h5replay.config import ClientConfig

    endpoint = sys.argv[1]
    conn = Connection(endpoint, ClientConfig(endpoint=endpoint, timeout=2.0, heartbeat_interval=0.2))
    sock = conn._sock  # as the client configures it
    sock.send_multipart([bytes(f) for f in P.encode(P.Heartbeat(1))])
    assert sock.poll(5000)
    sock.recv_multipart()  # connected
    assert sock.poll(0, zmq.POLLOUT)  # what Connection.send checks before it sends...
    print("polled", flush=True)
    sys.stdin.readline()  # ...and the server vanishes right then
    time.sleep(0.5)
    started = time.monotonic()
    try:
        sock.send_multipart([bytes(f) for f in P.encode(P.Heartbeat(2))])
        print("sent", round(time.monotonic() - started, 2), flush=True)
    except zmq.Again:
        print("timed out", round(time.monotonic() - started, 2), flush=True)
""")


@pytest.mark.timeout(60)
def test_a_send_right_after_the_server_vanished_never_blocks_past_the_timeout():
    """Issue 14, case 10: an actor blocked in a send to a vanished server hung for ever, deaf to
    SIGTERM and Ctrl-C: the send after a timed poll had no timeout of its own, and the pipe the
    poll saw was gone (ZMQ_IMMEDIATE) by the time of the send. The send is bounded now."""
    where = endpoint()
    server = zmq.Context.instance().socket(zmq.ROUTER)
    server.linger = 0
    server.bind(where)
    client = subprocess.Popen([sys.executable, "-c", _SEND_AFTER_POLL, where], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert server.poll(10_000), "the client sent nothing"
        identity, *request = server.recv_multipart()
        server.send_multipart([identity, b"pong"])
        assert client.stdout is not None and client.stdin is not None
        assert client.stdout.readline().strip() == "polled"
        server.close(0)
        client.stdin.write("go\n")
        client.stdin.flush()
        out, err = client.communicate(timeout=15)
    finally:
        if client.poll() is None:
            client.kill()
        client.wait(10)
        server.close(0)
    assert client.returncode == 0, f"exit {client.returncode}: {err[-1000:]}"
    assert "sent" in out or "timed out" in out, out
