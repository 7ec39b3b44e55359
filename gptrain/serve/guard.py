"""What the server checks before a request reaches an endpoint: the ``Host`` header (a guard against
DNS rebinding: a page on another site whose name was re-pointed at this machine), the
``Content-Type`` of the JSON endpoints (``application/json``, which a browser sends cross-site only
after a CORS preflight this server never grants), and the JSON body itself (its size and depth)."""
from __future__ import annotations

import ipaddress
import json
import socket

from fastapi import Request
from fastapi.responses import JSONResponse

from gptrain.serve.megatron_api import BadRequest

class Refused(Exception):
    """An HTTP error other than 400: ``status`` and the one-line message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def require_json(request: Request) -> None:
    """415 unless the body is declared ``application/json`` (``text/plain``, form encodings and no
    type at all are what a page on another site can send without asking first)."""
    kind = request.headers.get("content-type")
    if kind is None or kind.split(";", 1)[0].strip().lower() != "application/json":
        shown = "none" if kind is None else repr(kind)
        raise Refused(415, f"Content-Type: must be application/json, got {shown}")


async def json_body(request: Request, limit: int):
    """The parsed body: 413 over ``limit`` bytes (from Content-Length when given, before reading),
    400 when it is not JSON or nests deeper than Python can parse."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise Refused(413, f"body: {int(length)} bytes exceeds the limit of {limit} (--max-body-bytes)")
    raw = b""
    async for piece in request.stream():
        raw += piece
        if len(raw) > limit:
            raise Refused(413, f"body: {len(raw)} bytes exceeds the limit of {limit} (--max-body-bytes)")
    try:
        return json.loads(raw or b"null")
    except RecursionError:
        raise BadRequest(TOO_DEEP) from None
    except ValueError as err:
        raise BadRequest(f"body: not valid JSON ({err})") from None


TOO_DEEP = "body: JSON nested too deeply (no field of this API nests more than 3 levels)"


def _host_name(value: str) -> str:
    value = value.strip().lower()
    if value.startswith("["):  # [v6]:port
        end = value.find("]")
        return value[1:end] if end > 0 else value
    if value.count(":") == 1:
        value = value.split(":", 1)[0]
    return value.rstrip(".")


def own_names(bind_host: str | None, extra: list[str] | None = None) -> set[str]:
    """The names this server answers to: the bind address, this machine's host name and ``extra``
    (``--allowed-hosts``; ``*`` allows any). Loopback names and IP addresses are always allowed."""
    names = {"localhost"}
    try:
        host = socket.gethostname().lower()
        names |= {host, host.split(".", 1)[0]}
    except OSError:
        pass
    for name in [bind_host or "", *(extra or [])]:
        if name.strip():
            names.add(_host_name(name))
    return names


def host_allowed(header: str | None, names: set[str]) -> bool:
    """An IP literal cannot be a rebound DNS name, so any is allowed; a name must be one of ours."""
    if header is None or "*" in names:
        return True  # HTTP/1.0 without Host: no browser sends that
    name = _host_name(header)
    if name in names or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


class HostGuard:
    """ASGI middleware: 403 for a ``Host`` that is not this server's (pure ASGI, so that an
    endpoint still sees its client's disconnect)."""

    def __init__(self, app, names: set[str]):
        self.app, self.names = app, names

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
            if not host_allowed(host, self.names):
                response = error(403, f"Host: {host!r} is not a name of this server (DNS-rebinding guard); "
                                      "use its address or localhost, or start it with --allowed-hosts NAME")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
