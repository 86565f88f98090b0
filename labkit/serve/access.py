"""Who may use the server: an API key, the Host a request names, and the web origins allowed to call it.

A server on 127.0.0.1 is not private: any web page the user opens can send it requests. A "simple"
cross-origin POST (text/plain, no custom header) needs no CORS preflight, so the browser delivers it
and the server runs it even though the page cannot read the answer; and a page whose DNS name is
rebound to 127.0.0.1 is same-origin with the server and reads every answer. Three checks, as ASGI
middleware in front of the routes, close that:

- Host: the request must name the address it reached (or a loopback name, when that address is
  loopback), or one of `allowed_hosts`. A rebound page's requests name the attacker's domain.
- Origin: a browser names the page's origin on every cross-origin request; one that is not in
  `allowed_origins` is refused before it runs. With `allowed_origins` given, Starlette's CORS
  middleware answers their preflights and labels their answers (off by default).
- API key: `Authorization: Bearer <key>` on /v1/*, /tokenize, /detokenize and /metrics, compared in
  constant time (digests of equal length through `hmac.compare_digest`). /health and /version stay
  open for probes.
"""

import hashlib
import hmac
import ipaddress
from dataclasses import dataclass

from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse

from labkit.serve.protocol import RequestError

LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}
KEYED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/metrics")


@dataclass(frozen=True)
class Access:
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = ()  # beyond the address a request reached ("*": any Host)
    allowed_origins: tuple[str, ...] = ()  # web origins whose pages may call the server ("*": any)

    def middleware(self) -> list[Middleware]:
        """Outermost first: Host and Origin, then CORS (which answers allowed preflights), then the key."""
        stack = [Middleware(_Guard, access=self)]
        if self.allowed_origins:
            stack.append(Middleware(CORSMiddleware, allow_origins=list(self.allowed_origins),
                                    allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"]))
        if self.api_key:
            stack.append(Middleware(_KeyCheck, key=self.api_key))
        return stack


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _refuse(message: str, status: int, code: str) -> JSONResponse:
    return JSONResponse(RequestError(message, None, status=status, code=code).body(), status_code=status)


def _header(scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _hostname(host: str) -> str:
    """The name in a Host header, without its port ("[::1]:8000" -> "::1")."""
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class _Guard:
    def __init__(self, app, access: Access):
        self.app, self.access = app, access

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        host = _header(scope, b"host") or ""
        if not self._host_allowed(scope, _hostname(host).lower()):
            return await _refuse(f"Host {host!r} is not one this server answers to (it guards against DNS "
                                 "rebinding): use its address, or start it with --allowed-hosts",
                                 400, "host_not_allowed")(scope, receive, send)
        origin = _header(scope, b"origin")
        if origin is not None and not self._origin_allowed(origin, host):
            return await _refuse(f"requests from the web origin {origin!r} are refused: start the server with "
                                 "--allowed-origins to let pages there call it", 403,
                                 "origin_not_allowed")(scope, receive, send)
        return await self.app(scope, receive, send)

    def _host_allowed(self, scope, name: str) -> bool:
        allowed = self.access.allowed_hosts
        if "*" in allowed or name in allowed:
            return True
        reached = (scope.get("server") or ("",))[0]
        return name == reached or (is_loopback(reached) and name in LOOPBACK_NAMES)

    def _origin_allowed(self, origin: str, host: str) -> bool:
        allowed = self.access.allowed_origins
        return origin in (f"http://{host}", f"https://{host}") or "*" in allowed or origin in allowed


class _KeyCheck:
    def __init__(self, app, key: str):
        self.app = app
        self.digest = hashlib.sha256(key.encode()).digest()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(KEYED_PREFIXES):
            given = _header(scope, b"authorization") or ""
            token = given[7:] if given[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(hashlib.sha256(token.encode()).digest(), self.digest):
                response = _refuse("Incorrect API key provided: send it as 'Authorization: Bearer <key>'",
                                   401, "invalid_api_key")
                response.headers["WWW-Authenticate"] = "Bearer"
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)
