"""Free loopback ports for the servers the tests start: asked of the kernel, never fixed numbers, so that a port
left in TIME_WAIT by an earlier test, or held by something else on the machine, cannot make a test flaky."""

from __future__ import annotations

import socket


def free_ports(n: int, avoid: tuple[int, ...] = ()) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 now (each socket is held until all are chosen, so none repeats);
    ``avoid``: ports to skip even if free (a server's defaults, which another test may be about to bind)."""
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            if s.getsockname()[1] not in avoid:
                ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def free_port() -> int:
    return free_ports(1)[0]
