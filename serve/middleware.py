"""ASGI middleware in front of the API: the API key, and the size of request bodies."""
from __future__ import annotations

from draftsmith.serve.protocol import error


class BodyGuard:
    """ASGI middleware in front of the API: the API key on /v1/*, POST bodies of at most `max_bytes`
    (413 beyond) read as JSON whatever Content-Type the client sent (curl -d sends form-urlencoded).
    Plain ASGI, so that a handler still hears its client disconnect."""

    class TooLarge(Exception):
        pass

    def __init__(self, app, max_bytes: int, api_key: str | None = None):
        self.app, self.max_bytes, self.api_key = app, max_bytes, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key and scope["path"].startswith("/v1/") and headers.get(b"authorization") != f"Bearer {self.api_key}".encode():
            return await error(401, "missing or wrong API key (Authorization: Bearer <key>)")(scope, receive, send)
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        too_large = error(413, f"the request body is larger than {self.max_bytes} bytes (--max-body-bytes)")
        declared = headers.get(b"content-length")
        if declared and declared.isdigit() and int(declared) > self.max_bytes:
            return await too_large(scope, receive, send)
        scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k != b"content-type"]
                 + [(b"content-type", b"application/json")]}
        received, started = 0, False

        async def counted():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise BodyGuard.TooLarge
            return message

        async def sending(message):
            nonlocal started
            started = True
            await send(message)

        try:
            await self.app(scope, counted, sending)
        except BodyGuard.TooLarge:
            if not started:
                await too_large(scope, receive, send)
