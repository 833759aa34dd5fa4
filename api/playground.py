"""The playground: GET / serves a page for trying the served model in a browser (chat and completion,
every sampling control, each token with its probability and alternatives, branching from any token).

The page is static files in `api/playground/` (HTML, CSS and ES modules: no build step, nothing fetched
from elsewhere) that call the API as any client would; `--disable-playground` turns it off."""

from __future__ import annotations

from pathlib import Path

from quart import Blueprint

from api.state import api_state

STATIC = Path(__file__).resolve().parent / "playground"
# The page loads only its own files and calls only this server (a check that it needs nothing from elsewhere).
CONTENT_SECURITY_POLICY = "default-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'"

playground = Blueprint("playground", __name__, static_folder=str(STATIC), static_url_path="/playground")


@playground.route("/")
async def page():
    """The page; with --api-key it says so, and asks for the key before its first call."""
    html = (STATIC / "index.html").read_text()
    if api_state().api_keys:
        html = html.replace("<body>", '<body data-api-key="required">', 1)
    return html, 200, {"Content-Type": "text/html; charset=utf-8", "Content-Security-Policy": CONTENT_SECURITY_POLICY}


@playground.after_request
async def _no_stale_files(response):
    """The browser asks again each load (a 304 where unchanged), so a new version of the page shows at once."""
    if response.status_code == 200:
        response.cache_control.no_cache = True
    return response
