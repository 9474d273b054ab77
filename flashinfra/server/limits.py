"""Request body size limit: ``413`` in OpenAI's error format, without ever holding more than the limit.

Plain ASGI middleware (streaming responses and disconnect detection pass through untouched). A declared
``Content-Length`` over the limit is refused before a byte of the body is read; a chunked body is read and
counted as it arrives and refused as soon as it passes the limit; the rest is never read (the connection
is closed by the HTTP server). A body within the limit is handed to the app unchanged.
"""

from __future__ import annotations

from flashinfra.server.errors import error_response

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


def too_large(limit: int):
    return error_response(413, f"the request body is larger than this server's limit of {limit} bytes "
                               "(--max-body-size)", code="request_too_large",
                          headers={"Connection": "close"})


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = None
            if declared is not None and declared > limit:
                await too_large(limit)(scope, receive, send)
                return
        # Read (and count) the body first, at most ``limit`` bytes of it, then replay it to the app.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                chunks.clear()
                await too_large(limit)(scope, receive, send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
