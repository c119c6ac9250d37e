"""Default plugin: the web page at GET / (playground and live dashboard) and its feed, GET /stats/stream.

The page is three static files shipped in the package (no build step, no third-party code); it talks
to the server only through the public API: /v1/models, /v1/chat/completions, /v1/completions
(streamed, with the API key the user typed) and /stats/stream (server-sent events, open like /stats).
`server.ui: false` registers none of it.
"""

from __future__ import annotations

from llmserve.hookspecs import hookimpl

# the page renders model output as text only; nothing may load from elsewhere
_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_FILES = {"/": ("index.html", "text/html; charset=utf-8"),
          "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
          "/ui/style.css": ("style.css", "text/css; charset=utf-8")}


def _static(name: str, media_type: str):
    from importlib.resources import files

    from starlette.responses import Response

    body = (files(__name__) / "static" / name).read_bytes()  # read once: the files ship with the package
    headers = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff", "Content-Security-Policy": _CSP}

    async def endpoint(request):
        return Response(body, media_type=media_type, headers=headers)

    return endpoint


@hookimpl
def register_routes(register, model):
    """Serve the page at GET / (with /ui/app.js, /ui/style.css) and its dashboard feed at GET /stats/stream."""
    if not model.config.server.ui:
        return
    from llmserve_ui.stream import stats_stream

    for path, (name, media_type) in _FILES.items():
        register(path, _static(name, media_type))
    register("/stats/stream", stats_stream)
