"""Asking a server's own endpoints over loopback (``/ping``, the management API, the token API).

Why a urllib opener without proxies: a ``$http_proxy`` in the environment would send a request for 127.0.0.1 to
the proxy; and why (status, body) instead of exceptions: every caller (readiness, status, key refresh) turns a
refusal or silence into its own one-line message.
"""

from __future__ import annotations

import urllib.error
import urllib.request


def http_get(url: str, key: str | None = None, timeout: float = 5.0) -> tuple[int, bytes]:
    """GET without proxies (loopback): (status, body); status 0 when nothing answers."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with opener.open(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (OSError, urllib.error.URLError):
        return 0, b""
