"""Cross-origin requests (CORS): which web pages' scripts may call the API, as vLLM's server allows them.

By default any origin may, with any method and header, without credentials (vLLM's defaults:
`--allowed-origins '["*"]'` and so on). A browser first sends a preflight (OPTIONS with
Access-Control-Request-Method); it is answered here, before the API key is checked, since
browsers send no key with it. Every other response to a request with an allowed Origin names
that origin, errors included, so the page can read them.
"""

from __future__ import annotations

import dataclasses

from quart import Quart, Response, request

METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
SAFELISTED_HEADERS = frozenset({"accept", "accept-language", "content-language", "content-type"})
PREFLIGHT_MAX_AGE_S = 600


@dataclasses.dataclass(frozen=True)
class CorsPolicy:
    allowed_origins: tuple[str, ...] = ("*",)  # "*": any
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False  # cookies and Authorization sent by the browser itself

    def allows_origin(self, origin: str) -> bool:
        return "*" in self.allowed_origins or origin in self.allowed_origins

    def origin_headers(self, origin: str) -> dict[str, str]:
        """The headers that let `origin` read a response (an allowed origin's)."""
        if "*" in self.allowed_origins and not self.allow_credentials:
            return {"Access-Control-Allow-Origin": "*"}
        headers = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        if self.allow_credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        return headers

    def preflight(self, origin: str, method: str, headers: str) -> Response:
        """The answer to a preflight: 200 with what is allowed, or 400 naming what is not."""
        asked = [h.strip().lower() for h in headers.split(",") if h.strip()]
        allowed_headers = {h.lower() for h in self.allowed_headers}
        refused = [what for what, ok in (
            ("origin", self.allows_origin(origin)),
            ("method", "*" in self.allowed_methods or method.upper() in {m.upper() for m in self.allowed_methods}),
            ("headers", "*" in allowed_headers or set(asked) <= allowed_headers | SAFELISTED_HEADERS)) if not ok]
        if refused:  # (an allowed origin still gets its headers, from `install`'s after_request)
            return Response(f"Disallowed CORS {', '.join(refused)}", status=400, content_type="text/plain")
        methods = METHODS if "*" in self.allowed_methods else self.allowed_methods
        answer = {**self.origin_headers(origin), "Access-Control-Allow-Methods": ", ".join(methods),
                  "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S)}
        if asked:
            answer["Access-Control-Allow-Headers"] = ", ".join(
                asked if "*" in allowed_headers else sorted(allowed_headers | SAFELISTED_HEADERS))
        return Response("OK", status=200, headers=answer, content_type="text/plain")

    def install(self, app: Quart) -> None:
        """Answer preflights and mark responses; call before any other `before_request` (the API key's)."""

        @app.before_request
        async def cors_preflight():
            origin = request.headers.get("Origin")
            method = request.headers.get("Access-Control-Request-Method")
            if request.method == "OPTIONS" and origin and method:
                return self.preflight(origin, method, request.headers.get("Access-Control-Request-Headers", ""))

        @app.after_request
        async def cors_headers(response: Response) -> Response:
            origin = request.headers.get("Origin")
            if origin and self.allows_origin(origin) and "Access-Control-Allow-Origin" not in response.headers:
                for name, value in self.origin_headers(origin).items():
                    if name == "Vary":
                        response.vary.add("Origin")
                    else:
                        response.headers[name] = value
            return response
