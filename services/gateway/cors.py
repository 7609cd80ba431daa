"""Cross-origin requests from browsers (CORS), as vLLM's server answers them (its
``--allowed-origins``, ``--allowed-methods``, ``--allowed-headers``, ``--allow-credentials``,
through Starlette's ``CORSMiddleware``), but off unless origins are named: a browser page of an
allowed origin may call the gateway with a key its user holds; any other page's script is refused
by the browser, which reads the answers' ``Access-Control-*`` headers.

* A **preflight** (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``) is answered
  here, before authentication (a browser sends no ``Authorization`` on one): 200 with what is
  allowed when the origin, the method and every requested header are, else 400 naming what is not.
* Every other response to a request with an allowed ``Origin`` carries
  ``Access-Control-Allow-Origin`` (``*`` where any origin is allowed and no credentials are,
  else the origin itself, with ``Vary: Origin``) — error bodies and streamed answers too, so that
  a page can read why it failed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from aiohttp import web

ANY = "*"
SAFE_HEADERS = frozenset({"accept", "accept-language", "content-language", "content-type"})  # Fetch's safelist
EXPOSED = ", ".join((  # the gateway's own response headers a page's script may read
    "x-request-id", "x-bear-query-id", "x-bear-instance", "x-bear-model", "x-bear-policy", "x-bear-ttft-method",
    "x-bear-predicted-ttft-ms", "x-bear-feasible", "x-bear-attempt", "x-bear-decision-ms", "x-bear-ttft-ms",
    "x-bear-on-time", "retry-after"))


@dataclass(frozen=True)
class CorsPolicy:
    """Which origins, methods and request headers a browser may use; no origins: CORS off
    (no ``Access-Control-*`` header is ever sent, and a preflight is a 405 as any ``OPTIONS``)."""

    origins: tuple[str, ...] = ()
    methods: tuple[str, ...] = (ANY,)
    headers: tuple[str, ...] = (ANY,)
    credentials: bool = False
    max_age_s: int = 600

    @classmethod
    def of(cls, origins: Sequence[str], methods: Sequence[str] = (ANY,), headers: Sequence[str] = (ANY,),
           credentials: bool = False) -> CorsPolicy:
        return cls(tuple(o.rstrip("/") for o in origins), tuple(m.upper() for m in methods),
                   tuple(h.lower() for h in headers), credentials)

    @property
    def enabled(self) -> bool:
        return bool(self.origins)

    def allows_origin(self, origin: str) -> bool:
        return ANY in self.origins or origin in self.origins

    def _allow_origin(self, origin: str) -> dict[str, str]:
        if ANY in self.origins and not self.credentials:
            return {"Access-Control-Allow-Origin": ANY}
        out = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        if self.credentials:
            out["Access-Control-Allow-Credentials"] = "true"
        return out

    def preflight(self, request: web.Request) -> web.Response | None:
        """The answer to a CORS preflight (None: ``request`` is not one, or CORS is off)."""
        origin = request.headers.get("Origin")
        method = request.headers.get("Access-Control-Request-Method")
        if not self.enabled or request.method != "OPTIONS" or origin is None or method is None:
            return None
        asked = [h.strip().lower() for h in request.headers.get("Access-Control-Request-Headers", "").split(",")
                 if h.strip()]
        refused = []
        if not self.allows_origin(origin):
            refused.append("origin")
        if ANY not in self.methods and method.upper() not in self.methods:
            refused.append("method")
        if ANY not in self.headers and any(h not in self.headers and h not in SAFE_HEADERS for h in asked):
            refused.append("headers")
        if refused:
            # Starlette's answer: 400 and a plain-text reason, no Access-Control-Allow-Origin
            return web.Response(status=400, text=f"Disallowed CORS {', '.join(refused)}",
                                headers={"Vary": "Origin"})
        allow_methods = "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT" if ANY in self.methods else \
            ", ".join(self.methods)
        allow_headers = ", ".join(asked) if ANY in self.headers else ", ".join(self.headers)
        headers = {**self._allow_origin(origin), "Access-Control-Allow-Methods": allow_methods,
                   "Access-Control-Max-Age": str(self.max_age_s)}
        if allow_headers:
            headers["Access-Control-Allow-Headers"] = allow_headers
        if ANY in self.origins and not self.credentials:
            headers["Vary"] = "Origin"  # the answer still depends on the request's headers
        return web.Response(status=200, text="OK", headers=headers)

    def decorate(self, request: web.Request, response: web.StreamResponse) -> None:
        """The CORS headers of a response to an allowed origin's request (before its headers go out)."""
        origin = request.headers.get("Origin")
        if not self.enabled or origin is None or not self.allows_origin(origin):
            return
        if "Access-Control-Allow-Origin" in response.headers:  # a preflight answered already
            return
        response.headers.update(self._allow_origin(origin))
        response.headers["Access-Control-Expose-Headers"] = EXPOSED
