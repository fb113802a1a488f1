"""SGLang 0.5.23's weight-update session, on the embedded server: /begin_weight_update ... /end_weight_update.

    POST /begin_weight_update  {"selector": "all" | "target" | "draft"}   400 while a session is open
    POST /end_weight_update    {}                                          400 while none is open

SGLang 0.5.23 refuses `/update_weights_from_distributed` (and `/update_weights_from_tensor`)
unless it runs between the two (sglang/srt/managers/scheduler_components/weight_updater.py,
`SchedulerWeightUpdaterManager`: `_session is None` -> success false, HTTP 400; a second
begin and an end without a begin are refused the same way). The embedded server holds the
same rule (`weight_routes` asks `require()`), so a client that skips the session fails here
as it would there. Answers have SGLang's shape, `{"success", "message"}`; a refusal is 400.
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter

from async_rl.engine.http_common import ApiError, Strict


class BeginRequest(Strict):
    selector: Literal["target", "draft", "all"] = "all"  # which runners; the embedded engine has one


class EndRequest(Strict):
    pass


class WeightUpdateSession:
    """Whether a session is open; SGLang's refusal texts, word for word."""

    def __init__(self) -> None:
        self.open = False

    def require(self, route: str) -> None:
        if not self.open:
            raise ApiError(400, f"{route} must run between begin_weight_update() and end_weight_update()")

    def router(self) -> APIRouter:
        router = APIRouter()

        @router.post("/begin_weight_update")
        async def begin_weight_update(req: BeginRequest | None = None):
            if self.open:
                raise ApiError(400, "a weight-update session is already open; call end_weight_update() first")
            self.open = True
            return {"success": True, "message": "Success"}

        @router.post("/end_weight_update")
        async def end_weight_update(req: EndRequest | None = None):
            if not self.open:
                raise ApiError(400, "no weight-update session is open; call begin_weight_update() first")
            self.open = False
            return {"success": True, "message": "Success"}

        return router
