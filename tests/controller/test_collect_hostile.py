"""``rollcage.collect`` given hostile or careless input: a clear error naming the problem, or every record.

One table: bad configuration (a URL or API key variable ``rollcage run`` refuses, a
nonsense ``buffer``), a reused ``Collection``, graders that raise, and output
directories that are files, devices, FIFOs, damaged, copied, or shared by two runs
at once. The scheduler runs on the fake supervisor (milliseconds, deterministic).
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import rollcage
from rollcage.controller import Collection, LocalBackend, ModelEndpointConfig, RayBackendConfig, RunConfig
from rollcage.controller._config import api_key_problem, model_url_problem
from rollcage.controller.testing import FakePlan, FakeSupervisor
from rollcage.errors import ConfigError
from rollcage.protocol import RolloutRecord
from tests.helpers.viewer_fixtures import record

URL = "http://127.0.0.1:9/v1"
BOUND_S = 60.0
"""Generous bound on a whole collection here: a hang (a FIFO opened for reading) fails instead of blocking."""


def _rows(*ids: str) -> list[dict[str, Any]]:
    return [{"id": task_id, "input": f"question {task_id}", "expected": "42"} for task_id in ids]


def _collection(out: Path, rows: list[dict[str, Any]], fake: FakeSupervisor, **values: Any) -> Collection:
    config = RunConfig(
        out=out,
        model=ModelEndpointConfig(base_url=URL, model_name="fake"),
        sandbox="none",
        retry_backoff_s=0.0,
        concurrency=2,
        deadline_s=30.0,
        grace_s=1.0,
        **values,
    )
    return Collection(config, tasks=rows, backend=LocalBackend(config.rollout_settings(), supervise=fake))


async def _all(collection: Collection) -> list[RolloutRecord]:
    async def take() -> list[RolloutRecord]:
        return [r async for r in collection]

    return await asyncio.wait_for(take(), BOUND_S)


def _lines(out: Path) -> list[RolloutRecord]:
    return [
        RolloutRecord.model_validate_json(line) for line in (out / "rollouts.jsonl").read_bytes().splitlines()
    ]


# ----------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "url", ["ftp://127.0.0.1/v1", "not a url", "http:///v1", "http://127.0.0.1:99999/v1", "127.0.0.1:8000/v1"]
)
def test_a_model_url_run_refuses_is_refused_by_collect_with_the_same_words(url: str) -> None:
    problem = model_url_problem(url)
    assert problem is not None
    with pytest.raises(ConfigError) as raised:
        rollcage.collect(_rows("a"), model=url, model_name="m")
    assert problem in str(raised.value)


def test_an_unset_api_key_variable_is_refused_for_the_local_backend_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("ROLLCAGE_TEST_NO_SUCH_KEY", raising=False)
    monkeypatch.setenv("ROLLCAGE_TEST_EMPTY_KEY", "")
    for name in ("ROLLCAGE_TEST_NO_SUCH_KEY", "ROLLCAGE_TEST_EMPTY_KEY"):
        problem = api_key_problem(name)
        assert problem is not None and name in problem
        with pytest.raises(ConfigError) as raised:
            rollcage.collect(_rows("a"), model=URL, model_name="m", api_key_env=name, out=tmp_path / "o")
        assert problem in str(raised.value)
    # With Ray the variable may be set on the nodes: not this process's to refuse.
    ray = rollcage.collect(
        _rows("a"),
        model=URL,
        model_name="m",
        api_key_env="ROLLCAGE_TEST_NO_SUCH_KEY",
        out=tmp_path / "o",
        backend=RayBackendConfig(),
    )
    assert isinstance(ray, Collection)


@pytest.mark.parametrize("buffer", [-1, 0, True, 1.5, "2", 10**9])
def test_a_buffer_that_is_not_a_number_of_records_is_refused(buffer: Any, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="buffer"):
        rollcage.collect(_rows("a"), model=URL, model_name="m", buffer=buffer, out=tmp_path / "o")
    with pytest.raises(ConfigError, match="buffer"):
        Collection(
            RunConfig(out=tmp_path / "o", model=ModelEndpointConfig(base_url=URL, model_name="m")),
            tasks=_rows("a"),
            buffer=buffer,
        )


async def test_a_used_collection_iterated_again_raises_instead_of_yielding_nothing(tmp_path: Path) -> None:
    collection = _collection(tmp_path / "out", _rows("a", "b"), FakeSupervisor({"a": "42", "b": "42"}))
    assert len(await _all(collection)) == 2
    with pytest.raises(RuntimeError, match=r"already iterated.*rollouts\.jsonl"):
        async for _ in collection:
            pass


# ----------------------------------------------------------------------------- graders


async def test_graders_that_raise_leave_every_record_and_name_their_error(tmp_path: Path) -> None:
    rows = [
        *_rows("fine"),
        {"id": "numeric-overflow", "input": "q", "expected": 10**400, "grader": {"type": "numeric"}},
        {"id": "exact-huge", "input": "q", "expected": 10**5000, "grader": {"type": "normalized"}},
    ]
    fake = FakeSupervisor(dict.fromkeys(("fine", "numeric-overflow", "exact-huge"), "42"))
    got = {r.task_id: r for r in await _all(_collection(tmp_path / "out", rows, fake))}
    assert got["fine"].reward == 1.0 and len(_lines(tmp_path / "out")) == 3
    assert (
        got["numeric-overflow"].grader is not None
        and "not a finite number" in got["numeric-overflow"].grader["error"]
    )
    assert got["exact-huge"].grader is not None and "raised" in got["exact-huge"].grader["error"]


# ----------------------------------------------------------------------------- output directories


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _file(path: Path) -> None:
    path.write_text("not a directory")


def _directory(path: Path) -> None:
    path.mkdir()


OUT_CASES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "out-is-a-file": (
        lambda tmp: (tmp / "out-file", _file(tmp / "out-file"))[0],
        "cannot create output directory",
    ),
    "out-is-a-device": (lambda tmp: Path("/dev/null"), "cannot create output directory"),
    "out-is-a-fifo": (
        lambda tmp: (tmp / "out-fifo", _fifo(tmp / "out-fifo"))[0],
        "cannot create output directory",
    ),
    "log-is-a-fifo": (
        lambda tmp: (tmp / "out", (tmp / "out").mkdir(), _fifo(tmp / "out" / "rollouts.jsonl"))[0],
        "not a regular file",
    ),
    "log-is-a-directory": (
        lambda tmp: (tmp / "out", _directory(tmp / "out"), _directory(tmp / "out" / "rollouts.jsonl"))[0],
        "rollouts.jsonl cannot be read",
    ),
    "log-is-a-link-to-a-device": (
        lambda tmp: (
            tmp / "out",
            (tmp / "out").mkdir(),
            (tmp / "out" / "rollouts.jsonl").symlink_to("/dev/zero"),
        )[0],
        "not a regular file",
    ),
    "log-damaged-mid-file": (
        lambda tmp: (
            tmp / "out",
            (tmp / "out").mkdir(),
            (tmp / "out" / "rollouts.jsonl").write_bytes(
                b"{not json\n"
                + record("r", "t", "completed", 1.0, rollout_dir=str(tmp)).model_dump_json().encode()
                + b"\n"
            ),
        )[0],
        "line 1 is damaged",
    ),
}


@pytest.mark.parametrize("case", sorted(OUT_CASES))
async def test_an_unusable_output_directory_is_refused_with_its_problem_never_a_hang(
    case: str, tmp_path: Path
) -> None:
    make, words = OUT_CASES[case]
    out = make(tmp_path)
    fake = FakeSupervisor({"a": "42"})
    with pytest.raises(ConfigError, match=words):
        await _all(_collection(out, _rows("a"), fake))
    assert fake.calls == []


async def test_a_torn_last_line_is_repaired_and_the_run_finishes_every_sample(tmp_path: Path) -> None:
    out = tmp_path / "out"
    await _all(_collection(out, _rows("a"), FakeSupervisor({"a": "42"})))
    with (out / "rollouts.jsonl").open("ab") as log:
        log.write(b'{"rollout_id": "torn')
    got = await _all(_collection(out, _rows("a", "b"), FakeSupervisor({"a": "42", "b": "42"})))
    assert [r.task_id for r in got] == ["b"] and [r.task_id for r in _lines(out)] == ["a", "b"]


async def test_a_copied_output_directory_resumes_on_its_own_and_leaves_the_original_alone(
    tmp_path: Path,
) -> None:
    original = tmp_path / "original"
    await _all(_collection(original, _rows("a"), FakeSupervisor({"a": "42"})))
    before = (original / "rollouts.jsonl").read_bytes()
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    fake = FakeSupervisor({"a": "42", "b": "42"})
    got = await _all(_collection(copy, _rows("a", "b"), fake))
    assert [r.task_id for r in got] == ["b"] and all(Path(r.rollout_dir).is_relative_to(copy) for r in got)
    assert [r.task_id for r in _lines(copy)] == ["a", "b"]
    assert (original / "rollouts.jsonl").read_bytes() == before


async def test_two_collections_on_one_output_directory_the_second_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    holding = FakeSupervisor(plan=lambda worker_input, try_index: FakePlan(outcome="cancelled", hang=True))
    second = FakeSupervisor({"a": "42"})
    async with _collection(out, _rows("a"), holding):
        await holding.wait_in_flight(1, timeout_s=BOUND_S)
        with pytest.raises(ConfigError, match="another rollcage run is writing"):
            await _all(_collection(out, _rows("a"), second))
    assert second.calls == [] and [r.outcome for r in _lines(out)] == ["cancelled"]


async def test_rewards_of_1e308_in_an_existing_log_do_not_crash_the_resumed_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    old = [
        record(f"old-{n}", f"old{n}", "completed", 1e308, rollout_dir=str(out / "rollouts" / f"old-{n}"))
        for n in range(2)
    ]
    (out / "rollouts.jsonl").write_text("".join(r.model_dump_json() + "\n" for r in old))
    collection = _collection(out, _rows("a"), FakeSupervisor({"a": "42"}))
    got = await _all(collection)
    assert [r.task_id for r in got] == ["a"]
    metrics = collection.summary().metrics
    assert metrics.mean_reward == 1.0 and metrics.health["grader_error"].count == 2


async def test_an_attempt_whose_machinery_raises_is_its_own_infra_failure_and_neighbours_keep_theirs(
    tmp_path: Path,
) -> None:
    fake = FakeSupervisor({"a": "42", "boom": "42"})

    async def supervise(rollout_dir: Path, config: Any, *, stop: asyncio.Event | None = None) -> Any:
        if "boom" in rollout_dir.name:
            raise KeyError("a bug in the machinery")  # nothing anticipated this kind of failure
        return await fake(rollout_dir, config, stop=stop)

    config = RunConfig(
        out=tmp_path / "out",
        model=ModelEndpointConfig(base_url=URL, model_name="fake"),
        sandbox="none",
        retry_backoff_s=0.0,
        max_infra_retries=1,
        concurrency=2,
    )
    collection = Collection(
        config, tasks=_rows("a", "boom"), backend=LocalBackend(config.rollout_settings(), supervise=supervise)
    )
    got = await _all(collection)
    assert sorted((r.task_id, r.outcome) for r in got) == [
        ("a", "completed"),
        ("boom", "infra_failure"),
        ("boom", "infra_failure"),
    ]
    failed = next(r for r in got if r.task_id == "boom")
    assert "KeyError" in failed.receipt.outcome_reason and failed.reward is None
    assert len(_lines(tmp_path / "out")) == 3


def test_a_copy_of_a_live_runs_directory_never_kills_the_originals_processes(tmp_path: Path) -> None:
    import subprocess
    import sys

    from rollcage.runfiles import RolloutLayout
    from rollcage.supervisor.config import TOKEN_ENV
    from rollcage.supervisor.core import _write_token

    original = tmp_path / "original"
    layout = RolloutLayout(original / "rollouts" / "x-s0-t0")
    layout.staging.mkdir(parents=True)
    _write_token(layout, "0f" * 16)
    # A process of the original run's rollout, alive: it carries the rollout's token.
    live = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], env={**os.environ, TOKEN_ENV: "0f" * 16}
    )
    try:
        copy = tmp_path / "copy"
        shutil.copytree(original, copy)
        asyncio.run(_all(_collection(copy, _rows("a"), FakeSupervisor({"a": "42"}))))
        assert live.poll() is None, "resuming a copy killed a process of the original run"
        # The original's own resume does reap what its killed supervisor left.
        asyncio.run(_all(_collection(original, _rows("a"), FakeSupervisor({"a": "42"}))))
        assert live.wait(timeout=BOUND_S) != 0
    finally:
        if live.poll() is None:
            live.kill()
            live.wait()
