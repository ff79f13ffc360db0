"""What the API tells browsers and reads from proxies: CORS for the origins
of --allowed-origins, and the client a trusted proxy (--forwarded-allow-ips)
names in X-Forwarded-For."""

from __future__ import annotations

import ipaddress

from pyserve.http.io import Response


class CORS:
    """CORS headers for allowed origins only; with none allowed, CORS is off.

    A listed origin is echoed back (with `Vary: Origin`); `*` allows any
    origin as `*`. Credentials are never allowed: the API authenticates
    with a bearer key that the page's own script sends, so no browser
    cookie ever needs to cross origins."""

    def __init__(self, origins: list[str]):
        self.any_origin = "*" in origins
        self.origins = frozenset(o for o in origins if o != "*")

    def allowed(self, origin: str | None) -> bytes | None:
        """The Access-Control-Allow-Origin value for `origin`, or None."""
        if origin is None:
            return None
        if origin in self.origins:
            return origin.encode("latin-1")
        return b"*" if self.any_origin else None

    @staticmethod
    def headers(allow_origin: bytes) -> list[tuple[bytes, bytes]]:
        headers = [(b"access-control-allow-origin", allow_origin)]
        if allow_origin != b"*":
            headers.append((b"vary", b"Origin"))
        return headers

    @staticmethod
    def wrap(send, allow_origin: bytes):
        """`send` with the CORS headers added to the response's start."""
        extra = CORS.headers(allow_origin)

        async def send_with_cors(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        return send_with_cors

    @staticmethod
    def preflight(request_headers: dict[str, str]) -> Response:
        response = Response(204, b"", "text/plain")
        response.headers = [
            (b"access-control-allow-methods", b"DELETE, GET, HEAD, OPTIONS, POST"),
            (b"access-control-allow-headers",
             request_headers.get("access-control-request-headers", "authorization, content-type").encode("latin-1")),
            (b"access-control-max-age", b"600"),
        ]
        return response


class TrustedProxies:
    """The proxies whose X-Forwarded-For is believed (`*`: any peer)."""

    def __init__(self, items: list[str]):
        self.any_peer = "*" in items
        self.networks = [ipaddress.ip_network(i, strict=False) for i in items if i != "*"]

    def trusts(self, host: str) -> bool:
        if self.any_peer:
            return True
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False  # a unix socket path, or a name: not a listed proxy
        return any(address in net for net in self.networks)

    def client(self, scope: dict, headers: dict[str, str]) -> str:
        """`host:port` of the client: the peer, or when the peer is a trusted
        proxy, the nearest address in X-Forwarded-For that is not one
        (`host:0`, the port being unknown)."""
        host, port = scope.get("client") or ("-", 0)
        forwarded = headers.get("x-forwarded-for")
        if forwarded and self.trusts(host):
            hops = [hop.strip() for hop in forwarded.split(",") if hop.strip()]
            for hop in reversed(hops):
                if not self.trusts(hop):
                    return f"{hop}:0"
            if hops:
                return f"{hops[0]}:0"
        return f"{host}:{port}"
