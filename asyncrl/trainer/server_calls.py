"""Trainer rank 0's calls to inference servers' control routes (JSON over HTTP, bounded
by a timeout, failures named with the route and what the server said) and the PUB
socket every publisher announces versions on."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import zmq

from asyncrl.transport import RunSite, bind, server_socket, write_endpoints


def pub_socket(site: RunSite) -> tuple[zmq.Context, zmq.Socket]:
    """Rank 0's PUB socket, its endpoint written where generators find it."""
    ctx = zmq.Context()
    sock = server_socket(ctx, zmq.PUB, site.transport, site.run_dir)
    endpoint = bind(sock, site.transport, site.run_dir, "trainer-weights")
    write_endpoints(site.run_dir, "trainer", {"weights": endpoint})
    return ctx, sock


def post_control(url: str, path: str, payload: dict, timeout_s: float) -> dict:
    """POST JSON to a server's control route; the answer, or RuntimeError when the server
    reports failure or answers an error status (naming the route and what it said)."""
    request = urllib.request.Request(
        f"{url}{path}",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            text = resp.read().decode()
    except urllib.error.HTTPError as e:  # say what the server said, not just its status
        raise RuntimeError(f"{url}{path} answered {e.code}: {e.read()[:300]!r}") from e
    body = json.loads(text) if text.strip().startswith("{") else {}
    if body.get("success") is False:
        raise RuntimeError(f"{url}{path}: {body.get('message')}")
    return body


def get_control(url: str, path: str, timeout_s: float) -> dict:
    """GET a server's control route; its JSON answer."""
    with urllib.request.urlopen(f"{url}{path}", timeout=timeout_s) as resp:
        return json.loads(resp.read().decode())
