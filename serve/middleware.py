"""ASGI middleware in front of the API: the API key, and the size of request bodies."""

from __future__ import annotations

from draftsmith.serve.protocol import error


class BodyGuard:
    """The API key on /v1/* (one Authorization header, exactly `Bearer <key>`), and POST bodies of at most
    `max_bytes`: read whole here, declared or chunked, and answered with 413 beyond (the framework's body
    parser turned an error raised while it read into a 400). A body is read as JSON whatever Content-Type
    the client sent (curl -d sends form-urlencoded). Plain ASGI, so that a handler still hears its client
    disconnect."""

    def __init__(self, app, max_bytes: int, api_key: str | None = None):
        self.app, self.max_bytes, self.api_key = app, max_bytes, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if refused := self.refusal(scope):
            return await refused(scope, receive, send)
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        body = b""
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away before its body was in
                return
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                return await self.too_large()(scope, receive, send)
            if not message.get("more_body", False):
                break
        scope = {
            **scope,
            "headers": [(k, v) for k, v in scope["headers"] if k != b"content-type"] + [(b"content-type", b"application/json")],
        }
        delivered = False

        async def replay():
            nonlocal delivered
            if delivered:  # after the body: what the client does next (a disconnect)
                return await receive()
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def refusal(self, scope):
        """The error response for a request refused before its body is read, or None."""
        if self.api_key and scope["path"].startswith("/v1/"):
            given = [value for key, value in scope["headers"] if key == b"authorization"]
            if len(given) > 1:
                return error(400, "more than one Authorization header: send one, 'Authorization: Bearer <key>'")
            if given != [f"Bearer {self.api_key}".encode()]:
                return error(401, "missing or wrong API key (Authorization: Bearer <key>)")
        declared = dict(scope["headers"]).get(b"content-length")
        if scope["method"] == "POST" and declared and declared.isdigit() and int(declared) > self.max_bytes:
            return self.too_large()
        return None

    def too_large(self):
        return error(413, f"the request body is larger than {self.max_bytes} bytes (--max-body-bytes)")
