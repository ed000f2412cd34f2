"""HTTP to a vLLM server on this machine or cluster, never through a proxy.

``urllib.request.urlopen`` honours ``http_proxy``/``https_proxy`` from the
environment, so on a machine with a proxy configured a request for
``http://127.0.0.1:8000/health`` goes to the proxy, which cannot reach the
local server.  Every request our tools send to a vLLM server goes through the
one opener here, built with an empty :class:`urllib.request.ProxyHandler`.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

__all__ = ["OPENER", "get", "get_json", "post_json"]

OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""The proxy-free opener every request to a vLLM server uses."""


def get(url: str, timeout: float) -> tuple[int, bytes]:
    """GET ``url``; returns (status, body); status 0 when nothing answered."""
    try:
        with OPENER.open(url, timeout=timeout) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), b""
    except (urllib.error.URLError, OSError, TimeoutError):
        return 0, b""


def get_json(url: str, timeout: float) -> Any:
    """GET ``url`` and decode its JSON body; raises ``OSError`` or ``ValueError`` on failure."""
    with OPENER.open(url, timeout=timeout) as resp:
        return json.loads(resp.read().decode("utf-8"))


def post_json(url: str, payload: Mapping[str, Any], timeout: float) -> tuple[int, bytes]:
    """POST a JSON body; returns (status, body); status 0 when nothing answered."""
    data = json.dumps(payload).encode()
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with OPENER.open(req, timeout=timeout) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        return 0, str(exc).encode()
