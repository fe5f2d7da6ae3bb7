"""``max_policy_calls``: which requests are model calls, how they are counted, and how one past it is refused.

One rule, used by every place that enforces it, so the limit cannot drift between agents:
the builtin loop (:mod:`rollcage.agent`) ends its episode when :meth:`PolicyCalls.take`
says no; the harness's forwarder and the egress proxy count every request that
:func:`model_call_api` calls a model call, and answer one past the limit with
:data:`REFUSAL_STATUS` and :func:`budget_refusal`'s body without forwarding it.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["BUDGET_CODE", "REFUSAL_STATUS", "Api", "PolicyCalls", "budget_refusal", "model_call_api"]

Api = Literal["chat", "responses"]

BUDGET_CODE = "max_policy_calls"
"""The error code of a model call refused past the rollout's ``max_policy_calls``."""

REFUSAL_STATUS = 403
"""The status of a model call refused past ``max_policy_calls``: the request is not the server's to retry."""

_CALL_PATHS: dict[str, Api] = {"/chat/completions": "chat", "/responses": "responses"}


def model_call_api(method: str, path: str) -> Api | None:
    """The API style when ``method path`` is a model call, else ``None``.

    Args:
        method: The HTTP method.
        path: The path below the model route's ``/v1`` (``/chat/completions``); a query is ignored.
    """
    if method != "POST":
        return None
    return _CALL_PATHS.get(path.partition("?")[0].rstrip("/"))


def budget_refusal(limit: int) -> bytes:
    """The JSON body of a model call refused past ``max_policy_calls`` (OpenAI's error shape)."""
    import orjson  # only when a call is refused: the worker imports this module

    return orjson.dumps(
        {
            "error": {
                "message": f"rollcage: this rollout's {limit} model calls (max_policy_calls) are spent",
                "type": "rollcage_budget_exceeded",
                "code": BUDGET_CODE,
            }
        }
    )


class PolicyCalls:
    """One rollout's model calls against its ``max_policy_calls``.

    Args:
        limit: Model calls allowed; ``None``: no limit (the count still runs).
    """

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.spent = 0
        """Model calls taken so far."""
        self.refused = 0
        """Model calls refused past the limit."""

    def take(self) -> bool:
        """Count one model call; ``False`` (and counted as refused) when the limit is already spent."""
        if self.limit is not None and self.spent >= self.limit:
            self.refused += 1
            return False
        self.spent += 1
        return True

    def take_request(self, method: str, path: str) -> bool:
        """:meth:`take` for a request to the model route (``path`` below ``/v1``); others pass free."""
        return model_call_api(method, path) is None or self.take()

    @property
    def reason(self) -> str:
        """Why a call is refused, for a record."""
        return f"the rollout's {self.limit} model calls (max_policy_calls) are spent"

    def refusal_body(self) -> bytes:
        """The body of a refused call (:func:`budget_refusal`)."""
        return budget_refusal(self.limit or 0)
