"""GET /: the browser page (serve/static/index.html), one static file with its CSS and script
inline: a streamed chat that marks where each token came from (the `token_sources` extension),
the request's speculative method and k, the answer beside plain decoding, and the server's
/metrics. Everything it loads comes from this server; it asks for the API key itself, so `/`
needs none (serve/access.py).

The answer carries a Content-Security-Policy naming the page's one inline script by its
hash: a script that model text might smuggle into the document would not run, whatever the
renderer did (it builds every node with textContent, never innerHTML).
"""

from __future__ import annotations

import base64
import hashlib
import re
from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

PAGE = "index.html"
SCRIPT = re.compile(r"<script>(.*?)</script>", re.S)

router = APIRouter()


@cache
def page() -> tuple[str, dict[str, str]]:
    """The page's text and its headers (read once: it is part of the installed package)."""
    html = resources.files("trt_spec.serve").joinpath("static", PAGE).read_text("utf-8")
    scripts = SCRIPT.findall(html)
    assert len(scripts) == 1, f"{PAGE}: expected one inline <script>, found {len(scripts)}"
    digest = base64.b64encode(hashlib.sha256(scripts[0].encode("utf-8")).digest()).decode()
    policy = ("default-src 'none'; connect-src 'self'; img-src 'self' data:; "
              f"style-src 'unsafe-inline'; script-src 'sha256-{digest}'; base-uri 'none'; "
              "form-action 'none'; frame-ancestors 'none'")
    return html, {"Content-Security-Policy": policy, "Cache-Control": "no-cache",
                  "X-Content-Type-Options": "nosniff"}


@router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def index():
    html, headers = page()
    return HTMLResponse(html, headers=headers)  # text/html; charset=utf-8
