"""The embedded server's bearer token (`engine.api_key`): one FastAPI dependency guarding the whole app.

With a token set, every route answers 401 unless the request carries `Authorization: Bearer
<token>`, except the probes a launcher or a load balancer calls before it holds any token:
/health, /health_generate, /get_model_info and /model_info. So /generate and the OpenAI
routes need it too (as SGLang's `--api-key` has it), and so do every route that changes the
server's state (pause, continue, weight updates from disk or a group, abort, flush cache,
weight-update groups) and /metrics; FastAPI's /docs and /openapi.json are turned off.
Tokens are compared in constant time. A refusal is logged once per client address and
counted (`engine/auth_refused` in /metrics).

    guard = BearerGuard("s3cret")
    app = FastAPI(dependencies=[Depends(guard)])
"""

from __future__ import annotations

import hmac
import logging

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from async_rl.engine.http_common import ApiError

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/health_generate", "/get_model_info", "/model_info"})
_bearer = HTTPBearer(auto_error=False, description="engine.api_key")


class BearerGuard:
    """The dependency: passes the open probes and requests with the right token, refuses the rest."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("engine.api_key: an empty token guards nothing")
        self._token = token.encode()
        self.refused = 0
        self._logged: set[str] = set()

    async def __call__(self, request: Request,
                       credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
        if request.url.path in OPEN_PATHS:
            return
        given = credentials.credentials.encode() if credentials is not None else b""
        if hmac.compare_digest(given, self._token):
            return
        self.refused += 1
        host = request.client.host if request.client else "?"
        if host not in self._logged:
            self._logged.add(host)
            logger.warning("refused %s %s from %s: %s bearer token (further refusals from it are only counted "
                           "in engine/auth_refused)", request.method, request.url.path, host,
                           "wrong" if given else "no")
        raise ApiError(401, "Authorization: this server requires `Authorization: Bearer <token>` "
                            "(engine.api_key); the token was " + ("wrong" if given else "missing"),
                       headers={"WWW-Authenticate": "Bearer"})

    def stats(self) -> dict[str, int]:
        return {"engine/auth_refused": self.refused}
