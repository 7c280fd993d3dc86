"""Loopback ports, in one place: the servers' supervision (``zoo serve``), the demo, the benchmarks and the tests.

Ports are asked of the kernel, never fixed numbers, so that a port left in TIME_WAIT by an earlier server, or held
by something else on the machine, cannot make a start fail or a test flaky.
"""

from __future__ import annotations

import socket
from typing import Any

#: TorchServe's own defaults (inference, management, metrics): a server started elsewhere may be about to bind them.
TORCHSERVE_DEFAULT_PORTS = (8080, 8081, 8082)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def free_ports(n: int, host: str = "127.0.0.1", avoid: tuple[int, ...] | set[int] = ()) -> list[int]:
    """``n`` distinct ports free on ``host`` now (each socket is held until all are chosen, so none repeats);
    ``avoid``: ports to skip even if free."""
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            s = socket.socket(_family(host), socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, 0))
            if s.getsockname()[1] not in avoid:
                ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def free_port(host: str = "127.0.0.1", avoid: tuple[int, ...] | set[int] = ()) -> int:
    """One port free on ``host`` now."""
    return free_ports(1, host, avoid)[0]


def port_free(host: str, port: int) -> bool:
    """Whether nothing listens on ``port``. SO_REUSEADDR as the servers bind, so connections of a server just
    stopped, left in TIME_WAIT, do not count (a stop then start would otherwise fail for a minute)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def loopback_address(client: int) -> str:
    """A loopback address of its own for client number ``client`` (127.0.0.2 on; the whole of 127.0.0.0/8 reaches this
    machine): the front door tells clients apart by their address, so a test or benchmark standing in for clients
    on other machines sends each one's requests from its own."""
    return f"127.0.{client // 250}.{2 + client % 250}"


def loopback_session(client: int) -> Any:
    """A ``requests`` session whose connections come from :func:`loopback_address` ``(client)`` (no proxy)."""
    import requests
    from requests.adapters import HTTPAdapter

    class FromAddress(HTTPAdapter):
        def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
            kwargs["source_address"] = (loopback_address(client), 0)
            super().init_poolmanager(*args, **kwargs)

    http = requests.Session()
    http.trust_env = False
    http.mount("http://", FromAddress())
    return http
