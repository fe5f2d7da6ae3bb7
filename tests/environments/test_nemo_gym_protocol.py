"""NeMo Gym's session protocol around a rollout: seed, verify answers, close, and what each failure means."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollcage.controller import (
    EXIT_ALL_GRADER_ERRORS,
    EXIT_OK,
    Controller,
    LocalBackend,
    ModelEndpointConfig,
    RunConfig,
)
from rollcage.controller._graders import parse_verify_answer
from rollcage.controller._servers import AppServer
from rollcage.controller.testing import FakeSupervisor
from rollcage.protocol import RolloutRecord


@pytest.mark.parametrize(
    ("status", "body", "reward", "error"),
    [
        (200, {"reward": 1}, 1.0, None),
        (201, {"reward": 0.5}, 0.5, None),
        (200, {"reward": 0.0, "mask_sample": None}, 0.0, None),
        (500, {"reward": 1.0}, None, "HTTP 500"),
        (422, {"detail": [{"loc": ["body", "responses_create_params"]}]}, None, "HTTP 422"),
        (302, {"reward": 1.0}, None, "HTTP 302"),
        (200, b"<html>", None, "non-JSON"),
        (200, [1.0], None, "not an object"),
        (200, {"reward": "1.0"}, None, "numeric 'reward'"),
        (200, {"reward": True}, None, "numeric 'reward'"),
        (200, b'{"reward": NaN}', None, "non-JSON"),
        (200, {"reward": 1e309}, None, "non-JSON"),
        (200, {}, None, "numeric 'reward'"),
        (200, {"reward": 1.0, "mask_sample": "yes"}, None, "mask_sample"),
        (200, {"reward": 1.0, "failure_kind": 3}, None, "failure_kind"),
    ],
)
def test_verify_answer_is_a_grade_or_a_grader_error(
    status: int, body: Any, reward: float | None, error: str | None
) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    grade = parse_verify_answer(status, raw)
    assert grade.reward == reward
    assert (grade.error is None) if error is None else (error in (grade.error or ""))


def test_verify_answer_honours_mask_and_failure_kind_and_drops_the_echo() -> None:
    answer = {
        "responses_create_params": {"input": "x"},
        "response": {"id": "r"},
        "expected_count": 3,
        "reward": 0.0,
        "mask_sample": True,
        "failure_kind": "sandbox" * 100,
        "resolved": False,
    }
    grade = parse_verify_answer(200, json.dumps(answer).encode(), frozenset({"expected_count"}))
    assert (grade.reward, grade.masked) == (0.0, True)
    assert grade.failure_kind is not None and len(grade.failure_kind) == 200
    assert grade.detail == {
        "name": "verify",
        "resolved": False,
        "mask_sample": True,
        "failure_kind": grade.failure_kind,
    }


class ScriptedEnvironment:
    """An external environment whose seed and verify answers are chosen per test; it logs every call."""

    def __init__(self, *, seed_status: int = 200, verify: Any = None) -> None:
        self.seed_status = seed_status
        self.verify = verify if verify is not None else {"reward": 1.0}
        self.calls: list[tuple[str, str | None, dict[str, Any]]] = []

    def app(self) -> Starlette:
        async def seed(request: Request) -> Response:
            self.calls.append(("seed", request.headers.get("cookie"), json.loads(await request.body())))
            response = JSONResponse({}, status_code=self.seed_status)
            response.set_cookie("sid", f"s{len(self.calls)}")
            return response

        async def verify(request: Request) -> Response:
            self.calls.append(("verify", request.headers.get("cookie"), json.loads(await request.body())))
            if isinstance(self.verify, int):
                return Response(b"broken", status_code=self.verify)
            return JSONResponse(self.verify)

        async def close(request: Request) -> Response:
            self.calls.append(("close", request.headers.get("cookie"), json.loads(await request.body())))
            return JSONResponse({})

        routes = [
            Route("/seed_session", seed, methods=["POST"]),
            Route("/verify", verify, methods=["POST"]),
            Route("/close_session", close, methods=["POST"]),
        ]
        return Starlette(routes=routes)


@pytest.fixture
def serve() -> Iterator[Any]:
    servers: list[AppServer] = []

    def start(env: ScriptedEnvironment) -> str:
        server = AppServer(env.app(), name="scripted-env")
        servers.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in servers:
            server.stop()


async def run(
    tmp_path: Path, url: str, rows: list[dict[str, Any]], **overrides: Any
) -> tuple[int, list[RolloutRecord]]:
    dataset = tmp_path / "d.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = RunConfig(
        dataset=dataset,
        out=tmp_path / "out",
        model=ModelEndpointConfig(base_url="http://127.0.0.1:9/v1", model_name="fake"),
        sandbox="none",
        retry_backoff_s=0.0,
        environment=url,
        **overrides,
    )
    backend = LocalBackend(cfg.rollout_settings(), supervise=FakeSupervisor({"a": "6", "b": "7"}))
    summary = await Controller(cfg, backend=backend).run()
    lines = (cfg.out / "rollouts.jsonl").read_bytes().splitlines()
    return summary.exit_code, [RolloutRecord.model_validate_json(x) for x in lines]


NEMO_ROW = {"responses_create_params": {"input": "count", "temperature": 0.5}, "id": "a", "expected_count": 6}


async def test_seed_cookies_reach_the_sandbox_verify_and_close(tmp_path: Path, serve: Any) -> None:
    env = ScriptedEnvironment()
    code, records = await run(tmp_path, serve(env), [NEMO_ROW])
    assert code == EXIT_OK and [r.reward for r in records] == [1.0]
    assert [(kind, cookie) for kind, cookie, _ in env.calls] == [
        ("seed", None),
        ("verify", "sid=s1"),
        ("close", "sid=s1"),
    ]
    seed_body = env.calls[0][2]
    assert seed_body == NEMO_ROW  # NeMo Gym's run request: the row as it is
    verify_body = env.calls[1][2]
    assert (
        verify_body["expected_count"] == 6
        and verify_body["responses_create_params"] == NEMO_ROW["responses_create_params"]
    )
    assert verify_body["response"]["output"][0]["content"][0]["text"] == "6"
    written = json.loads((Path(records[0].rollout_dir) / "input.json").read_text())
    assert written["resource_cookies"] == {"sid": "s1"}
    assert "expected_count" not in json.dumps(written) and written["model"]["sampling"]["temperature"] == 0.5
    # NeMo Gym 0.7.0's ResourcesCloseSessionRequest (extra="forbid"): these two fields and nothing else.
    assert env.calls[2][2] == {
        "resources_session_id": records[0].rollout_id,
        "episode_id": {"rollout_id": f"{records[0].task_id}-s0", "attempt": 0},
    }


async def test_seed_not_offered_runs_without_a_session(tmp_path: Path, serve: Any) -> None:
    env = ScriptedEnvironment(seed_status=404)
    code, records = await run(tmp_path, serve(env), [NEMO_ROW])
    assert code == EXIT_OK and records[0].reward == 1.0
    assert [(kind, cookie) for kind, cookie, _ in env.calls] == [
        ("seed", None),
        ("verify", None),
        ("close", None),
    ]


async def test_failing_seed_is_an_infrastructure_failure_that_is_retried(tmp_path: Path, serve: Any) -> None:
    env = ScriptedEnvironment(seed_status=503)
    code, records = await run(tmp_path, serve(env), [NEMO_ROW], max_infra_retries=1)
    assert code == 3  # every sample ended in infra_failure
    assert [(r.outcome, r.graded) for r in records] == [("infra_failure", False)] * 2
    assert "seed_session with HTTP 503" in records[0].receipt.outcome_reason
    assert [kind for kind, _, _ in env.calls] == ["seed", "seed"]


async def test_a_run_whose_every_grade_failed_exits_non_zero(tmp_path: Path, serve: Any) -> None:
    env = ScriptedEnvironment(verify=500)
    rows = [NEMO_ROW, {**NEMO_ROW, "id": "b"}]
    code, records = await run(tmp_path, serve(env), rows)
    assert code == EXIT_ALL_GRADER_ERRORS
    assert all(
        r.graded is False and r.reward is None and "HTTP 500" in (r.grader or {})["error"] for r in records
    )


async def test_masked_samples_are_recorded_counted_and_left_out_of_rewards(
    tmp_path: Path, serve: Any
) -> None:
    env = ScriptedEnvironment(verify={"reward": 0.0, "mask_sample": True, "failure_kind": "sandbox"})
    code, records = await run(tmp_path, serve(env), [NEMO_ROW])
    assert code == EXIT_OK
    assert [(r.graded, r.reward, r.masked, r.failure_kind) for r in records] == [(True, 0.0, True, "sandbox")]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert (metrics["masked"], metrics["graded"], metrics["mean_reward"], metrics["pass_at_1"]) == (
        1,
        0,
        None,
        None,
    )
    assert metrics["failure_kinds"] == {"sandbox": 1}
