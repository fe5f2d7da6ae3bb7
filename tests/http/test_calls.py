"""``max_policy_calls`` as one rule (rollcage.http.PolicyCalls), whichever agent runs.

The builtin loop, the harness's forwarder and the egress proxy all take their model calls
from :class:`PolicyCalls`; its behaviour end to end is held by tests/worker (the loop ends at
the limit), tests/harness (the forwarder and the proxy refuse past it). Here: the rule itself.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollcage.http import BUDGET_CODE, REFUSAL_STATUS, PolicyCalls, model_call_api


@settings(max_examples=40, deadline=None)
@given(limit=st.integers(min_value=0, max_value=20), asked=st.integers(min_value=0, max_value=40))
def test_exactly_the_limit_is_taken_and_every_later_call_is_refused(limit: int, asked: int) -> None:
    calls = PolicyCalls(limit)
    taken = [calls.take() for _ in range(asked)]
    assert taken == [True] * min(limit, asked) + [False] * max(0, asked - limit)
    assert (calls.spent, calls.refused) == (min(limit, asked), max(0, asked - limit))


def test_no_limit_takes_every_call() -> None:
    calls = PolicyCalls(None)
    assert all(calls.take() for _ in range(1000)) and calls.refused == 0


@pytest.mark.parametrize(
    ("method", "path", "counted"),
    [
        ("POST", "/chat/completions", True),
        ("POST", "/responses?stream=true", True),
        ("POST", "/chat/completions/", True),
        ("GET", "/models", False),
        ("GET", "/chat/completions", False),
        ("POST", "/embeddings", False),
    ],
)
def test_only_model_calls_count(method: str, path: str, counted: bool) -> None:
    calls = PolicyCalls(0)
    assert calls.take_request(method, path) is not counted
    assert (model_call_api(method, path) is not None) is counted


def test_a_refusal_is_a_403_in_openais_error_shape_naming_the_limit() -> None:
    calls = PolicyCalls(3)
    error = json.loads(calls.refusal_body())["error"]
    assert REFUSAL_STATUS == 403 and error["code"] == BUDGET_CODE == "max_policy_calls"
    assert error["type"] == "rollcage_budget_exceeded" and "3 model calls" in error["message"]
    assert "3 model calls (max_policy_calls)" in calls.reason
