"""``rollcage.collect``: records yielded as they land, backpressure, and every way of stopping.

The scheduler runs on the fake supervisor here (milliseconds, deterministic); the
real supervisor, sandbox and worker under ``collect`` are exercised by
``tests/controller/test_acceptance.py`` and by the trainer example's test.
"""

from __future__ import annotations

import asyncio
import gc
import json
from pathlib import Path
from typing import Any

import pytest

import rollcage
from rollcage.controller import Collection, LocalBackend, ModelEndpointConfig, RunConfig
from rollcage.controller.testing import FakePlan, FakeSupervisor
from rollcage.errors import ConfigError
from rollcage.protocol import RolloutRecord, WorkerInput
from tests.helpers.waiting import wait_for_async


def _rows(*ids: str) -> list[dict[str, Any]]:
    return [{"id": task_id, "input": f"question {task_id}", "expected": "42"} for task_id in ids]


def _collection(
    tmp_path: Path, rows: list[dict[str, Any]], fake: FakeSupervisor, **overrides: Any
) -> Collection:
    buffer = overrides.pop("buffer", None)
    values: dict[str, Any] = {
        "out": tmp_path / "out",
        "model": ModelEndpointConfig(base_url="http://127.0.0.1:9/v1", model_name="fake"),
        "sandbox": "none",
        "retry_backoff_s": 0.0,
        "metrics_interval_s": 0.01,
        "concurrency": 2,
        "deadline_s": 30.0,
        "grace_s": 1.0,
        **overrides,
    }
    config = RunConfig(**values)
    backend = LocalBackend(config.rollout_settings(), supervise=fake)
    return Collection(config, tasks=rows, backend=backend, buffer=buffer)


def _on_disk(out: Path) -> list[RolloutRecord]:
    path = out / "rollouts.jsonl"
    return [RolloutRecord.model_validate_json(line) for line in path.read_bytes().splitlines()]


async def test_every_attempt_is_yielded_as_it_lands_with_its_result_in_memory(tmp_path: Path) -> None:
    fake = FakeSupervisor({"a": "42", "b": "7"}, outcomes={"b": ["infra_failure", "completed"]})
    got: list[RolloutRecord] = []
    async with _collection(tmp_path, _rows("a", "b"), fake, attempts=2) as rollouts:
        async for record in rollouts:
            got.append(record)
    # Every attempt, the retried infrastructure failure included, exactly as rollouts.jsonl holds them.
    assert sorted(r.rollout_id for r in got) == sorted(r.rollout_id for r in _on_disk(tmp_path / "out"))
    assert len(got) == 6 and sum(r.outcome == "infra_failure" for r in got) == 2
    answered = [r for r in got if r.outcome == "completed"]
    # The parsed result rides along (nothing is read back from disk): trajectory and turns.
    results = [r.result() for r in answered]
    assert all(res is not None and res.trajectory.turns for res in results)
    assert {r.task_id: r.reward for r in answered} == {"a": 1.0, "b": 0.0}
    assert rollouts.summary().exit_code == 0


async def test_a_consumer_that_does_not_take_records_pauses_the_rollouts(tmp_path: Path) -> None:
    fake = FakeSupervisor()
    collection = _collection(tmp_path, _rows(*"abcdefghij"), fake, concurrency=2, buffer=1)
    async with collection:
        # One record waits in the buffer and each of the two slots holds one it cannot hand over.
        await wait_for_async(lambda: len(fake.calls) == 3, what="three attempts")
        for _ in range(200):
            await asyncio.sleep(0)  # every chance to start more, if nothing held them back
        assert len(fake.calls) == 3
        records = collection.__aiter__()
        first = await anext(records)
        await wait_for_async(lambda: len(fake.calls) == 4, what="one more attempt per record taken")
        assert first.outcome == "completed"
        await records.aclose()
    assert (
        collection.summary().metrics.rollouts == 4
    )  # the three started after the first ended and were recorded


async def test_leaving_the_block_stops_in_flight_rollouts_through_their_supervisors(tmp_path: Path) -> None:
    fake = FakeSupervisor(plan=lambda spec, t: FakePlan(hang=spec.task_id != "quick"), hang_s=30.0)
    async with _collection(tmp_path, _rows("quick", "slow-1", "slow-2"), fake, concurrency=3) as rollouts:
        async for record in rollouts:
            assert record.task_id == "quick"
            await fake.wait_in_flight(2)
            break
    on_disk = {r.task_id: r.outcome for r in _on_disk(tmp_path / "out")}
    assert on_disk == {"quick": "completed", "slow-1": "cancelled", "slow-2": "cancelled"}
    assert fake.in_flight == 0 and rollouts.summary().interrupted


async def test_cancelling_the_consumer_abandons_in_flight_rollouts_at_once(tmp_path: Path) -> None:
    fake = FakeSupervisor(plan=lambda spec, t: FakePlan(hang=True), hang_s=30.0)
    collection = _collection(tmp_path, _rows("a", "b"), fake)

    async def consume() -> None:
        async for _ in collection:
            pass

    task = asyncio.create_task(consume())
    await fake.wait_in_flight(2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # Their supervisors were cancelled (they stop and reap the workers): nothing recorded, rerun on resume.
    assert fake.in_flight == 0
    assert _on_disk(tmp_path / "out") == []


async def test_breaking_out_of_a_bare_loop_still_stops_the_run(tmp_path: Path) -> None:
    fake = FakeSupervisor(plan=lambda spec, t: FakePlan(hang=spec.task_id != "quick"), hang_s=30.0)
    collection = _collection(tmp_path, _rows("quick", "slow"), fake)
    async for _ in collection:
        # "slow" must be running when the loop is left (a rollout not started yet leaves no record).
        await fake.wait_in_flight(1)
        break
    gc.collect()  # the abandoned iterator is closed when collected, as CPython does at once
    # The stop is asked for and the fake has returned before the run writes the stopped rollout's
    # record: wait for the records, not only for those two.
    await wait_for_async(
        lambda: (
            fake.in_flight == 0
            and collection.summary().interrupted
            and (tmp_path / "out" / "rollouts.jsonl").read_bytes().count(b"\n") == 2
        ),
        what="the run to stop and record both rollouts",
    )
    assert {r.task_id: r.outcome for r in _on_disk(tmp_path / "out")} == {
        "quick": "completed",
        "slow": "cancelled",
    }


async def test_malformed_rows_refuse_the_run_before_anything_runs(tmp_path: Path) -> None:
    fake = FakeSupervisor()
    bad = [*_rows("a"), {"id": "b"}, {"id": "a", "input": "again"}]
    with pytest.raises(ConfigError, match=r"2 malformed row\(s\).*line 2"):
        async for _ in _collection(tmp_path, bad, fake, strict=True):
            pass
    assert fake.calls == []


def test_collect_checks_its_arguments_and_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs model_name"):
        rollcage.collect(_rows("a"), model="http://127.0.0.1:9/v1")
    with pytest.raises(ConfigError, match="concurrency"):
        rollcage.collect(_rows("a"), model="http://127.0.0.1:9/v1", model_name="m", concurrency=0)
    with pytest.raises(ConfigError, match="nonsense"):
        rollcage.collect(_rows("a"), model="http://127.0.0.1:9/v1", model_name="m", nonsense=1)
    ready = rollcage.collect(_rows("a"), model="http://127.0.0.1:9/v1", model_name="m", out=tmp_path / "o")
    assert isinstance(ready, Collection) and ready.out_dir == tmp_path / "o"


async def test_a_dataset_file_runs_the_same_way(tmp_path: Path) -> None:
    dataset = tmp_path / "d.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in _rows("a", "b")))
    fake = FakeSupervisor({"a": "42", "b": "42"})
    values: dict[str, Any] = {"dataset": dataset, "out": tmp_path / "out", "sandbox": "none"}
    config = RunConfig(model=ModelEndpointConfig(base_url="http://127.0.0.1:9/v1", model_name="f"), **values)
    collection = Collection(config, backend=LocalBackend(config.rollout_settings(), supervise=fake))
    seen = [record.reward async for record in collection]
    assert seen == [1.0, 1.0]


def test_worker_input_of_a_collected_row_is_the_rows_model_visible_part(tmp_path: Path) -> None:
    # collect() takes the rows as dataset lines: the same validation, the same input.json.
    fake = FakeSupervisor()
    seen: list[WorkerInput] = []
    fake.plan_for = lambda spec: seen.append(spec) or FakePlan()  # type: ignore[method-assign]

    async def go() -> None:
        async for _ in _collection(tmp_path, [{**_rows("a")[0], "instructions": "Be brief."}], fake):
            pass

    asyncio.run(go())
    assert (seen[0].task_id, seen[0].input, seen[0].instructions) == ("a", "question a", "Be brief.")
