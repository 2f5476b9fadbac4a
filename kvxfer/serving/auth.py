"""Bearer tokens for the serving HTTP APIs: every ``kvxfer-decode`` endpoint but ``/health``, and the router's
admin endpoints.

Without a token any client that reaches a decode endpoint could claim another request's output
(``/v1/generate`` names the request by id). The token is a shared secret in ``Authorization: Bearer <token>``,
compared in constant time; it travels in clear over plain HTTP, so keep these APIs on a private network (or
behind TLS). Pass it through the environment rather than the command line, where ``ps`` shows it.
"""

from __future__ import annotations

import hmac
import os

DECODE_TOKEN_ENV = "KVXFER_DECODE_TOKEN"
ROUTER_TOKEN_ENV = "KVXFER_ROUTER_TOKEN"


def resolve(option: str | None, env: str) -> str:
    """The token given on the command line, else the one in ``env``, else none ("")."""
    return option if option is not None else os.environ.get(env, "")


def authorized(headers, token: str) -> bool:
    """True when no token is configured or ``headers`` carry it as a bearer token."""
    if not token:
        return True
    scheme, _, given = headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


def bearer(token: str) -> dict[str, str]:
    """The request headers that present ``token`` (none when there is no token)."""
    return {"authorization": f"Bearer {token}"} if token else {}


def unauthorized():
    """401 with an OpenAI-style error body."""
    from starlette.responses import JSONResponse

    return JSONResponse(
        {"error": {"message": "missing or wrong bearer token", "type": "authentication_error", "code": 401}},
        status_code=401,
        headers={"WWW-Authenticate": "Bearer"},
    )


def guarded(handler, token: str):
    """``handler`` behind the token: a request without it gets 401 before the handler reads a byte of it."""
    if not token:
        return handler

    async def guard(request):
        if not authorized(request.headers, token):
            return unauthorized()
        return await handler(request)

    return guard
