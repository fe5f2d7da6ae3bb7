"""The Ray backend on a local Ray instance: same records as locally, lost tasks, resume, stop, shipping.

One Ray instance serves the whole module (``ray_address``); every backend here
connects to it, and the ``rollcage run`` subprocesses connect to it by address.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollcage.controller import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    Controller,
    LocalBackendConfig,
    ModelEndpointConfig,
    RayBackendConfig,
    RunConfig,
    RunSummary,
    rollout_id,
)
from rollcage.protocol import RolloutRecord
from tests.helpers.waiting import alive, processes_mentioning, wait_for, wait_for_records

try:
    import ray

    HAVE_RAY = True
except ImportError:  # pragma: no cover - CI installs the ray extra
    HAVE_RAY = False

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SANDBOX: Any = os.environ.get("ROLLCAGE_TEST_SANDBOX", "bwrap")

needs_ray = pytest.mark.skipif(not HAVE_RAY, reason="needs ray: pip install 'rollcage[ray]' (CI installs it)")
needs_bwrap = pytest.mark.skipif(
    SANDBOX == "bwrap" and shutil.which("bwrap") is None, reason="needs bubblewrap (CI installs it)"
)


def real_rollouts(test: Any) -> Any:
    """Marks of a test that runs real rollouts (bubblewrap, worker, policy) on the module's Ray."""
    for mark in (needs_ray, needs_bwrap, pytest.mark.bwrap, pytest.mark.timeout(90)):
        test = mark(test)
    return pytest.mark.usefixtures("ray_address")(test)


SIX_BY_SEVEN = {
    "tasks": {
        "*": [
            {"tool_calls": [{"name": "python", "arguments": {"code": "print(6 * 7)"}}]},
            {"text": "42"},
        ]
    }
}


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A private local Ray instance (2 CPUs, no dashboard) for the module; its GCS address."""
    if not HAVE_RAY:
        pytest.skip("needs ray")
    previous = os.environ.get("RAY_USAGE_STATS_ENABLED")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # no usage report attempts from a test machine
    try:
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            logging_level="WARNING",
            _node_ip_address="127.0.0.1",  # loopback only
        )
        try:
            yield str(ray.get_runtime_context().gcs_address)
        finally:
            ray.shutdown()
    finally:
        if previous is None:
            os.environ.pop("RAY_USAGE_STATS_ENABLED", None)
        else:
            os.environ["RAY_USAGE_STATS_ENABLED"] = previous


def records(out: Path) -> list[RolloutRecord]:
    return [RolloutRecord.model_validate_json(x) for x in (out / "rollouts.jsonl").read_bytes().splitlines()]


def write_dataset(directory: Path, rows: list[dict[str, Any]], policy: dict[str, Any] | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    if policy is not None:
        (directory / "policy.yaml").write_text(json.dumps(policy))  # JSON is YAML
    path = directory / "dataset.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def layout(directory: Path) -> dict[str, int]:
    """Relative path → permission bits of everything in a rollout directory."""
    return {
        str(p.relative_to(directory)): stat.S_IMODE(p.lstat().st_mode) for p in sorted(directory.rglob("*"))
    }


def wait_until_gone(marker: str, timeout: float = 15) -> None:
    wait_for(
        lambda: not processes_mentioning(marker), timeout=timeout, what=f"no process to mention {marker!r}"
    )


def wait_until_dead(pid: int, timeout: float = 15) -> None:
    wait_for(lambda: not alive(pid), timeout=timeout, what=f"process {pid} to die")


# ------------------------------------------------------------------ no Ray needed


def test_local_run_and_ray_config_never_import_ray(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        from pathlib import Path
        import rollcage.cli, rollcage.commands.run
        from rollcage.controller import Controller, ModelEndpointConfig, RunConfig, RayBackendConfig
        from rollcage.controller.testing import FakeSupervisor

        tmp = Path({str(tmp_path)!r})
        (tmp / "d.jsonl").write_text('{{"id": "a", "input": "q", "expected": "42"}}\\n')
        model = ModelEndpointConfig(base_url="http://127.0.0.1:9/v1", model_name="fake")
        RunConfig(dataset=tmp / "d.jsonl", out=tmp / "o2", model=model, backend={{"type": "ray"}})
        RayBackendConfig(address="h:1", shared_dir=tmp)
        cfg = RunConfig(dataset=tmp / "d.jsonl", out=tmp / "o", model=model, sandbox="none")
        backend = cfg.backend.build(cfg.rollout_settings(), supervise=FakeSupervisor({{"a": "42"}}))
        summary = asyncio.run(Controller(cfg, backend=backend).run())
        assert summary.exit_code == 0 and summary.metrics.mean_reward == 1.0, summary
        print(sorted(m for m in sys.modules if m == "ray" or m.startswith("ray.")))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_backend_config_is_tagged_and_shared_dir_must_hold_out(tmp_path: Path) -> None:
    base = {"dataset": tmp_path / "d.jsonl", "out": tmp_path / "shared" / "out"}
    assert isinstance(RunConfig.model_validate(base).backend, LocalBackendConfig)
    cfg = RunConfig.model_validate({**base, "backend": {"type": "ray", "address": "head:6379"}})
    assert cfg.backend == RayBackendConfig(address="head:6379")
    with pytest.raises(ValueError, match="backend"):
        RunConfig.model_validate({**base, "backend": {"type": "slurm"}})
    with pytest.raises(ValueError, match="num_cpus_per_rollout"):
        RayBackendConfig(num_cpus_per_rollout=-1)
    RunConfig.model_validate({**base, "backend": {"type": "ray", "shared_dir": tmp_path / "shared"}})
    with pytest.raises(ValueError, match="must be inside --shared-dir"):
        RunConfig.model_validate({**base, "backend": {"type": "ray", "shared_dir": tmp_path / "elsewhere"}})


def test_ray_options_need_backend_ray(tmp_path: Path) -> None:
    dataset = write_dataset(tmp_path, [{"id": "a", "input": "q"}])
    done = subprocess.run(
        [sys.executable, "-m", "rollcage", "run", str(dataset), "--ray-address", "head:6379"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert "--ray-address needs --backend ray" in done.stdout + done.stderr


# ------------------------------------------------------------------ artifacts


@needs_ray
def test_packing_keeps_links_as_links_skips_fifos_and_is_bounded(tmp_path: Path) -> None:
    from rollcage.controller._ray import ArtifactsTooLargeError, pack_rollout_dir, unpack_rollout_dir

    source = tmp_path / "src"
    (source / "workspace").mkdir(parents=True)
    (source / "result.json").write_text('{"ok": true}')
    (source / "result.json").chmod(0o600)
    secret = tmp_path / "outside-secret"
    secret.write_text("must not travel")
    (source / "workspace" / "leak").symlink_to(secret)
    os.mkfifo(source / "workspace" / "pipe")
    archive = pack_rollout_dir(source, limit=1024 * 1024)
    assert b"must not travel" not in archive  # gz of a link is its target path, never the content

    target = tmp_path / "out" / "r1"
    unpack_rollout_dir(archive, target)
    assert (target / "result.json").read_text() == '{"ok": true}'
    assert stat.S_IMODE((target / "result.json").stat().st_mode) == 0o600
    assert os.readlink(target / "workspace" / "leak") == str(secret)
    assert not (target / "workspace" / "pipe").exists()
    with pytest.raises(FileExistsError):
        unpack_rollout_dir(archive, target)

    (source / "workspace" / "big").write_bytes(b"x" * 5000)
    with pytest.raises(ArtifactsTooLargeError, match=r"over the 0\.0 MiB limit"):
        pack_rollout_dir(source, limit=4096)


# ------------------------------------------------------------------ real rollouts on Ray


def ancestors(pid: int) -> list[int]:
    chain = []
    while pid > 1:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            break
        pid = int(fields[1])
        chain.append(pid)
    return chain


def read_cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def file_texts(directory: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in directory.rglob("*") if p.is_file() and not p.is_symlink()}


def comparable(record: RolloutRecord) -> tuple[Any, ...]:
    return (
        record.outcome,
        record.graded,
        record.reward,
        record.grader,
        record.termination_reason,
        record.metrics.model_calls,
        record.metrics.tool_calls,
        record.metrics.total_tokens,
    )


def scratch_leftovers(rollout_ids: list[str]) -> list[Path]:
    root = Path("/tmp", "rollcage-ray")
    return [p for rid in rollout_ids for p in root.glob(f"*/{rid}")]


async def run_example(out: Path, name: str, backend: LocalBackendConfig | RayBackendConfig) -> RunSummary:
    config = RunConfig(
        dataset=EXAMPLES / name / "dataset.jsonl",
        out=out,
        sandbox=SANDBOX,
        deadline_s=60,
        concurrency=4,
        backend=backend,
    )
    return await Controller(config).run()


@real_rollouts
@pytest.mark.parametrize("name", ["calc-weather", "code-fn"])
async def test_bundled_dataset_gives_the_same_records_on_ray_as_locally(tmp_path: Path, name: str) -> None:
    local = await run_example(tmp_path / "local", name, LocalBackendConfig())
    remote = await run_example(tmp_path / "ray", name, RayBackendConfig())
    assert (local.exit_code, remote.exit_code) == (EXIT_OK, EXIT_OK)
    on_local = {r.task_id: r for r in records(tmp_path / "local")}
    on_ray = {r.task_id: r for r in records(tmp_path / "ray")}
    assert {t: comparable(r) for t, r in on_ray.items()} == {t: comparable(r) for t, r in on_local.items()}
    for task_id, record in on_ray.items():
        assert Path(record.rollout_dir) == tmp_path / "ray" / "rollouts" / record.rollout_id
        # Laid out exactly as locally: the same files, with the same permissions.
        assert layout(Path(record.rollout_dir)) == layout(Path(on_local[task_id].rollout_dir)), task_id
    assert remote.metrics.mean_reward == local.metrics.mean_reward
    assert remote.metrics.pass_at_1 == local.metrics.pass_at_1
    assert remote.metrics.health == local.metrics.health
    assert scratch_leftovers(list(r.rollout_id for r in on_ray.values())) == []


@real_rollouts
async def test_killing_the_ray_worker_of_a_rollout_is_an_infra_failure_then_retried(tmp_path: Path) -> None:
    from rollcage.controller._ray import RayBackend
    from rollcage.policy import PolicyServer

    task = f"kill{secrets.token_hex(3)}"
    dataset = write_dataset(
        tmp_path / "data", [{"id": task, "input": "6*7?", "tools": ["python"], "expected": "42"}]
    )
    first = rollout_id(task, 0, 0)
    with PolicyServer(SIX_BY_SEVEN, faults=[f"rollout={first}:kind=hang"]) as policy:
        config = RunConfig(
            dataset=dataset,
            out=tmp_path / "out",
            model=ModelEndpointConfig(base_url=policy.base_url, model_name="scripted"),
            sandbox=SANDBOX,
            deadline_s=60,
            max_infra_retries=1,
            retry_backoff_s=0,
            backend=RayBackendConfig(),
        )
        backend = config.backend.build(config.rollout_settings())
        assert isinstance(backend, RayBackend)
        async with asyncio.TaskGroup() as group:
            job = group.create_task(Controller(config, backend=backend).run())
            # The first attempt's model request hangs: the rollout is in flight on its node.
            assert await asyncio.to_thread(policy.state.wait_for_requests, 1, 60, rollout_id=first)
            async with asyncio.timeout(30):
                pid = (await backend.placement(first)).pid
            assert read_cmdline(pid).startswith(f"ray::rollcage:{first}".encode())
            sandboxed = [p for p in processes_mentioning(first) if p != pid]  # bwrap and the worker
            assert sandboxed and all(pid in ancestors(p) for p in sandboxed)  # it runs the supervisor
            os.kill(pid, signal.SIGKILL)
        summary = job.result()
    got = records(config.out)
    assert [(r.try_index, r.outcome, r.reward) for r in got] == [
        (0, "infra_failure", None),
        (1, "completed", 1.0),
    ]
    assert "WorkerCrashedError" in got[0].receipt.outcome_reason
    assert (Path(got[0].rollout_dir) / "input.json").is_file()  # what was attempted, as locally
    assert summary.exit_code == EXIT_OK and summary.metrics.retries == 1
    wait_until_gone(first)  # the sandbox died with its parent, the Ray worker


@real_rollouts
async def test_cancelling_the_run_kills_its_ray_tasks_and_their_sandboxes(tmp_path: Path) -> None:
    from rollcage.controller._ray import RayBackend
    from rollcage.policy import PolicyServer

    task = f"abandon{secrets.token_hex(3)}"
    dataset = write_dataset(tmp_path / "data", [{"id": task, "input": "6*7?", "tools": ["python"]}])
    first = rollout_id(task, 0, 0)
    with PolicyServer(SIX_BY_SEVEN, faults=[f"rollout={first}:kind=hang"]) as policy:
        config = RunConfig(
            dataset=dataset,
            out=tmp_path / "out",
            model=ModelEndpointConfig(base_url=policy.base_url, model_name="scripted"),
            sandbox=SANDBOX,
            deadline_s=60,
            backend=RayBackendConfig(),
        )
        backend = config.backend.build(config.rollout_settings())
        assert isinstance(backend, RayBackend)
        job = asyncio.get_running_loop().create_task(Controller(config, backend=backend).run())
        try:
            assert await asyncio.to_thread(policy.state.wait_for_requests, 1, 60, rollout_id=first)
            async with asyncio.timeout(30):
                pid = (await backend.placement(first)).pid
        finally:
            job.cancel()
            with pytest.raises(asyncio.CancelledError):
                await job
    assert not (config.out / "rollouts.jsonl").read_bytes()  # abandoned: rerun on resume
    wait_until_gone(first)  # the Ray worker was killed, and its sandbox with it
    wait_until_dead(pid)


@real_rollouts
async def test_stop_cancels_in_flight_ray_rollouts_through_their_supervisors(tmp_path: Path) -> None:
    from rollcage.policy import PolicyServer

    task = f"stop{secrets.token_hex(3)}"
    dataset = write_dataset(
        tmp_path / "data", [{"id": task, "input": "6*7?", "tools": ["python"], "expected": "42"}]
    )
    first = rollout_id(task, 0, 0)
    stop = asyncio.Event()
    with PolicyServer(SIX_BY_SEVEN, faults=[f"rollout={first}:kind=hang"]) as policy:
        config = RunConfig(
            dataset=dataset,
            out=tmp_path / "out",
            model=ModelEndpointConfig(base_url=policy.base_url, model_name="scripted"),
            sandbox=SANDBOX,
            deadline_s=60,
            grace_s=2,
            backend=RayBackendConfig(),
        )
        async with asyncio.TaskGroup() as group:
            job = group.create_task(Controller(config, stop=stop).run())
            assert await asyncio.to_thread(policy.state.wait_for_requests, 1, 60, rollout_id=first)
            stop.set()
        summary = job.result()
    assert summary.exit_code == EXIT_INTERRUPTED
    (record,) = records(config.out)
    assert (record.outcome, record.graded, record.receipt.stop_requested) == ("cancelled", False, True)
    assert layout(Path(record.rollout_dir)).keys() >= {"receipt.json", "result.json", "checkpoint.jsonl"}


def slow_dataset(directory: Path, ids: list[str]) -> Path:
    policy = {
        "tasks": {
            "*": [
                {
                    "tool_calls": [
                        {"name": "python", "arguments": {"code": "import time; time.sleep(0.4); print(42)"}}
                    ]
                },
                {"text": "42"},
            ]
        }
    }
    return write_dataset(
        directory, [{"id": i, "input": "42?", "tools": ["python"], "expected": "42"} for i in ids], policy
    )


def rollcage_run(*args: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "rollcage", "run", *args, "--sandbox", SANDBOX],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 90) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out


@real_rollouts
def test_rerun_after_the_driver_is_killed_runs_every_sample_exactly_once(
    tmp_path: Path, ray_address: str
) -> None:
    token = secrets.token_hex(3)
    ids = [f"resume{token}-{i}" for i in range(6)]
    dataset = slow_dataset(tmp_path / "data", ids)
    out = tmp_path / "out"
    args = (str(dataset), "--out", str(out), "--backend", "ray", "--ray-address", ray_address)
    args += ("--concurrency", "2", "--deadline", "60", "--quiet")
    proc = rollcage_run(*args, cwd=tmp_path)
    try:
        wait_for_records(out / "rollouts.jsonl", 2, proc)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        finish(proc)
    # Ray kills the tasks of a dead driver, and each sandbox dies with its Ray worker.
    wait_until_gone(f"resume{token}")
    before = len(records(out))
    code, text = finish(rollcage_run(*args, cwd=tmp_path))
    assert code == 0, text
    assert f"Resuming: {before} earlier attempt(s)" in text
    got = records(out)
    assert Counter((r.task_id, r.sample) for r in got) == {(i, 0): 1 for i in ids}
    assert {r.outcome for r in got} == {"completed"} and all(r.reward == 1.0 for r in got)
    assert scratch_leftovers([r.rollout_id for r in got]) == []


@real_rollouts
async def test_shared_dir_rollouts_are_written_in_place_not_shipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollcage.controller import _ray

    def refuse(archive: bytes, directory: Path) -> None:
        raise AssertionError("nothing is shipped with a shared directory")

    monkeypatch.setattr(_ray, "unpack_rollout_dir", refuse)
    rows = [json.loads(line) for line in (EXAMPLES / "code-fn" / "dataset.jsonl").read_text().splitlines()]
    data = tmp_path / "shared" / "data"
    write_dataset(data, [r for r in rows if r["id"] in ("fizzbuzz", "running-sum")])
    shutil.copy(EXAMPLES / "code-fn" / "policy.yaml", data / "policy.yaml")
    config = RunConfig(
        dataset=data / "dataset.jsonl",
        out=tmp_path / "shared" / "out",
        sandbox=SANDBOX,
        deadline_s=60,
        backend=RayBackendConfig(shared_dir=tmp_path / "shared"),
    )
    summary = await Controller(config).run()
    assert summary.exit_code == EXIT_OK
    got = {r.task_id: r for r in records(config.out)}
    assert {t: r.reward for t, r in got.items()} == {"fizzbuzz": 1.0, "running-sum": 0.25}
    assert all((Path(r.rollout_dir) / "workspace" / "solution.py").is_file() for r in got.values())
    assert all(
        layout(Path(r.rollout_dir)).keys() >= {"receipt.json", "model_capture.jsonl"} for r in got.values()
    )


@real_rollouts
async def test_artifacts_over_the_limit_are_an_infra_failure_that_says_what_to_do(tmp_path: Path) -> None:
    policy = {
        "tasks": {
            "*": [
                {
                    "tool_calls": [
                        {"name": "python", "arguments": {"code": "open('big', 'w').write('x' * 200000)"}}
                    ]
                },
                {"text": "done"},
            ]
        }
    }
    dataset = write_dataset(
        tmp_path / "data", [{"id": "big", "input": "?", "tools": ["python"], "expected": "done"}], policy
    )
    config = RunConfig(
        dataset=dataset,
        out=tmp_path / "out",
        sandbox=SANDBOX,
        deadline_s=60,
        max_infra_retries=0,
        backend=RayBackendConfig(max_artifact_bytes=64 * 1024),
    )
    await Controller(config).run()
    (record,) = records(config.out)
    assert record.outcome == "infra_failure" and not record.graded
    reason = record.receipt.outcome_reason
    assert "over the 0.1 MiB limit" in reason and "completed, reward 1.0" in reason
    assert "--ray-max-artifact-mib" in reason and "--shared-dir" in reason
    assert sorted(layout(Path(record.rollout_dir))) == ["input.json", "workspace"]


@real_rollouts
async def test_api_key_reaches_the_proxy_on_the_node_and_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollcage.controller._servers import AppServer
    from rollcage.policy import PolicyApp, load_script

    variable = f"ROLLCAGE_TEST_KEY_{secrets.token_hex(4).upper()}"
    key = f"sk-canary-{secrets.token_hex(8)}"
    # Set only in this process: the Ray workers were started before it existed, so the key can
    # reach the node's supervisor only through the task's runtime_env.
    monkeypatch.setenv(variable, key)
    seen: list[bytes | None] = []
    policy_app = PolicyApp(load_script(SIX_BY_SEVEN))

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].endswith("/chat/completions"):
            seen.append(dict(scope["headers"]).get(b"authorization"))
        await policy_app(scope, receive, send)

    server = AppServer(app, name="keyed-policy")
    url = await asyncio.to_thread(server.start)
    try:
        dataset = write_dataset(
            tmp_path / "data", [{"id": "keyed", "input": "6*7?", "tools": ["python"], "expected": "42"}]
        )
        config = RunConfig(
            dataset=dataset,
            out=tmp_path / "out",
            model=ModelEndpointConfig(base_url=f"{url}/v1", model_name="scripted", api_key_env=variable),
            sandbox=SANDBOX,
            deadline_s=60,
            max_infra_retries=0,
            backend=RayBackendConfig(),
        )
        await Controller(config).run()
    finally:
        await asyncio.to_thread(server.stop)
    (record,) = records(config.out)
    assert (record.outcome, record.reward) == ("completed", 1.0)
    assert seen and set(seen) == {f"Bearer {key}".encode()}
    leaks = [path for path, data in file_texts(config.out).items() if key.encode() in data]
    assert leaks == []
