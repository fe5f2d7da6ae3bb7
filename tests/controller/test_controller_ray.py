"""The Ray backend on a real two-node cluster: same records as locally, faults, secrets, resume, stop.

One cluster serves the whole session (``ray_cluster``): two ``ray start`` processes on
this machine, 1 CPU each, each with its own Ray temp dir and ``$TMPDIR`` (where the
node scratch lives), started once outside every test's timeout and stopped at the end
even on failure, with no process left behind. This process is its driver; the
``rollcage run`` subprocesses connect to it by address. A token-authenticated head is
started only for the tests that need one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollcage.controller import (
    EXIT_ALL_INFRA,
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
from tests.helpers.paths import EXAMPLES
from tests.helpers.ray_cluster import NodeGate, RayCluster, RayNode, free_port
from tests.helpers.waiting import alive, processes_mentioning, wait_for, wait_for_records

try:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    HAVE_RAY = True
except ImportError:  # pragma: no cover - CI installs the ray extra
    HAVE_RAY = False

# Under pytest-xdist (make test) every test here runs in one worker, which starts the session's
# two-node cluster once: a worker of its own per test would start a cluster each.
pytestmark = pytest.mark.xdist_group("ray")

SANDBOX: Any = os.environ.get("ROLLCAGE_TEST_SANDBOX", "bwrap")

needs_ray = pytest.mark.skipif(not HAVE_RAY, reason="needs ray: pip install 'rollcage[ray]' (CI installs it)")
needs_bwrap = pytest.mark.skipif(
    SANDBOX == "bwrap" and shutil.which("bwrap") is None, reason="needs bubblewrap (CI installs it)"
)


def real_rollouts(test: Any) -> Any:
    """Marks of a test that runs real rollouts (bubblewrap, worker, policy) on the session's cluster.

    The limit covers the test's own call only (``func_only``): starting the cluster is the
    session fixture's, and takes ~35 s on a loaded machine.
    """
    for mark in (needs_ray, needs_bwrap, pytest.mark.bwrap, pytest.mark.timeout(150, func_only=True)):
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


def short_root(prefix: str) -> Path:
    # Ray's Unix sockets live under each node's temp dir, and a socket path is limited to
    # 107 bytes: pytest's tmp_path is too deep for them.
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayCluster]:
    """A head and a worker node (1 CPU each) for the session, this process connected as driver."""
    if not HAVE_RAY:
        pytest.skip("needs ray")
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED", "RAY_ADDRESS")}
    root = short_root("rc-ray-")
    cluster = RayCluster(root)
    try:
        os.environ.pop("RAY_ADDRESS", None)
        os.environ["RAY_AUTH_MODE"] = "disabled"  # set explicitly, as Ray documents it
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # no usage report attempts from a test machine
        cluster.start_head()
        cluster.add_worker()
        ray.init(address=cluster.address, log_to_driver=False, logging_level="WARNING")
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        survivors = cluster.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(root, ignore_errors=True)
        assert survivors == [], f"processes of the test cluster survived its teardown: {survivors}"


@pytest.fixture
def ray_address(ray_cluster: RayCluster) -> str:
    """The session cluster's address, with two live nodes (a node a test killed is replaced)."""
    if sum(node.running() for node in ray_cluster.nodes) < 2:
        ray_cluster.add_worker()
    wait_for(lambda: len([n for n in ray.nodes() if n["Alive"]]) >= 2, timeout=60, what="two live Ray nodes")
    return ray_cluster.address


def scratch_roots(nodes: list[RayNode]) -> list[Path]:
    """Where rollcage's node scratch lives on each node (under the node's ``$TMPDIR``)."""
    return [node.scratch_tmp / "rollcage-ray" for node in nodes]


def scratch_leftovers(nodes: list[RayNode], rollout_ids: list[str]) -> list[Path]:
    return [p for root in scratch_roots(nodes) for rid in rollout_ids for p in root.glob(f"*/{rid}")]


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


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
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240, check=False
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
async def test_bundled_dataset_gives_the_same_records_on_ray_as_locally(
    tmp_path: Path, name: str, ray_cluster: RayCluster
) -> None:
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
    assert scratch_leftovers(ray_cluster.nodes, [r.rollout_id for r in on_ray.values()]) == []


async def run_and_kill_the_first_worker(tmp_path: Path, retries: int) -> tuple[RunSummary, str, int]:
    """Run one task whose first attempt hangs at its model call, SIGKILL that attempt's Ray worker.

    Returns the summary, the first attempt's id and the killed pid.
    """
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
            max_infra_retries=retries,
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
    return job.result(), first, pid


@real_rollouts
async def test_killing_the_ray_worker_of_a_rollout_is_an_infra_failure_then_retried(tmp_path: Path) -> None:
    summary, first, pid = await run_and_kill_the_first_worker(tmp_path, retries=1)
    got = records(tmp_path / "out")
    assert [(r.try_index, r.outcome, r.reward) for r in got] == [
        (0, "infra_failure", None),
        (1, "completed", 1.0),
    ]
    assert "WorkerCrashedError" in got[0].receipt.outcome_reason
    assert f"pid {pid}" in got[0].receipt.outcome_reason  # where it was lost
    assert (Path(got[0].rollout_dir) / "input.json").is_file()  # what was attempted, as locally
    assert summary.exit_code == EXIT_OK and summary.metrics.retries == 1
    wait_until_gone(first)  # the sandbox died with its parent, the Ray worker


@real_rollouts
async def test_a_killed_tasks_scratch_on_its_node_is_swept_when_the_run_ends(
    tmp_path: Path, ray_cluster: RayCluster
) -> None:
    # No retry: no later task on that node sweeps it; only the run's end does.
    _, first, _ = await run_and_kill_the_first_worker(tmp_path, retries=0)
    (record,) = records(tmp_path / "out")
    assert record.outcome == "infra_failure"
    assert scratch_leftovers(ray_cluster.nodes, [first]) == []


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
    tmp_path: Path, ray_address: str, ray_cluster: RayCluster
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
    # What the killed run's tasks left on the nodes is gone after the resumed run.
    assert scratch_leftovers(ray_cluster.nodes, [rollout_id(i, 0, 0) for i in ids]) == []


def _templates_of(pid: int) -> list[int]:
    """The warm worker templates process ``pid`` started that are alive: its children running
    ``rollcage template`` in the host's PID namespace (a worker forked from one carries the template's
    command line until it takes its own, but from inside its cage)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            words = (entry / "cmdline").read_bytes().split(b"\0")
            status = dict(line.split(":", 1) for line in (entry / "status").read_text().splitlines())
        except (OSError, ValueError):
            continue
        template = b"template" in words and words[words.index(b"template") - 1] == b"rollcage"
        if template and int(status["PPid"]) == pid and len(status["NSpid"].split()) == 1:
            found.append(int(entry.name))
    return found


def _started_at(pid: int) -> float:
    """When process ``pid`` started, in Unix time (its start in /proc is in clock ticks since boot)."""
    ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    since_boot = ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME) + since_boot


@real_rollouts
@pytest.mark.parametrize("sandbox", ["bwrap", "none"])
async def test_a_ray_worker_process_forks_all_its_rollouts_from_one_template_that_outlives_them(
    tmp_path: Path, sandbox: str
) -> None:
    """Each rollout runs on a thread and event loop of its own in a Ray worker process; the template it
    forks the worker from is started by the first of them and alive after the last (issue 41: a template
    was started again for every rollout). Under bubblewrap it is the process's (the keeper's); under
    ``--sandbox none`` its thread's, and the process takes the same thread for its next rollout."""
    if sandbox == "bwrap" and (SANDBOX != "bwrap" or os.geteuid() != 0):
        pytest.skip("the warm template of bwrap as root")
    from rollcage.controller._ray import RayBackend, RolloutPlacement

    ran_on: dict[str, RolloutPlacement] = {}

    class Placed(RayBackend):
        """Keeps where each attempt ran (the backend forgets it once the attempt has landed)."""

        async def _follow(self, prepared: Any, generator: Any, group: asyncio.TaskGroup) -> Any:
            outcome = await super()._follow(prepared, generator, group)
            where = self._ran_on.get(prepared.rollout_id)
            if where is not None:
                ran_on[prepared.rollout_id] = where
            return outcome

    rows = [{"id": f"warm{i}", "input": "6*7?", "tools": ["python"], "expected": "42"} for i in range(6)]
    on_ray = RayBackendConfig()
    config = RunConfig(
        dataset=write_dataset(tmp_path / "data", rows, SIX_BY_SEVEN),
        out=tmp_path / "out",
        sandbox=sandbox,
        deadline_s=60,
        concurrency=2,
        backend=on_ray,
    )
    backend = Placed(on_ray, config.rollout_settings())
    began = time.time()
    summary = await Controller(config, backend=backend).run()
    assert summary.exit_code == EXIT_OK
    got = records(config.out)
    assert {r.outcome for r in got} == {"completed"} and len(got) == len(rows)
    by_process: dict[int, list[RolloutRecord]] = {}
    for record in got:
        by_process.setdefault(ran_on[record.rollout_id].pid, []).append(record)
    assert max(len(ran) for ran in by_process.values()) >= 2, "no process ran two rollouts"
    for pid, ran in by_process.items():
        templates = _templates_of(pid)
        if sandbox == "none":
            # The keeper's template of an earlier bubblewrap test may live in the same process; a
            # thread's template started by this run is what is looked for (and dies with its thread).
            templates = [t for t in templates if _started_at(t) >= began - 0.05]
        assert len(templates) == 1, f"Ray worker {pid} holds {len(templates)} live templates"
        first = min(ran, key=lambda r: r.receipt.started_at)
        # Started by the first of its rollouts here (or by an earlier test's, in this same process) and
        # alive after the last: every one of them forked its worker from it.
        assert _started_at(templates[0]) < first.receipt.ended_at, (pid, [r.rollout_id for r in ran])


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


def files_holding(roots: list[Path], needles: list[str]) -> list[str]:
    """Every regular file under ``roots`` that holds any of ``needles``, as ``path: needle``."""
    found = []
    for root in roots:
        for path in root.rglob("*"):
            try:
                if not path.is_file() or path.is_symlink():
                    continue
                data = path.read_bytes()
            except OSError:  # a socket, or a file Ray removed meanwhile
                continue
            found += [f"{path}: {needle}" for needle in needles if needle.encode() in data]
    return found


def keyed_policy(script: Any, seen: list[bytes | None]) -> Any:
    """The scripted policy as an ASGI app that notes each model request's Authorization header."""
    from rollcage.policy import PolicyApp, load_script

    policy_app = PolicyApp(load_script(script))

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].endswith("/chat/completions"):
            seen.append(dict(scope["headers"]).get(b"authorization"))
        await policy_app(scope, receive, send)

    return app


@real_rollouts
async def test_secrets_reach_the_node_and_no_file_of_any_node_or_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ray_cluster: RayCluster
) -> None:
    from types import SimpleNamespace

    from rollcage.controller import _servers
    from rollcage.controller._servers import AppServer

    variable = f"ROLLCAGE_TEST_KEY_{secrets.token_hex(4).upper()}"
    key = f"sk-canary-{secrets.token_hex(8)}"
    verify_token = f"verify-canary-{secrets.token_hex(8)}"
    # Set only in this process: the nodes were started before it existed, so the key can reach
    # a node's supervisor only from the driver.
    monkeypatch.setenv(variable, key)
    # The bundled environment's /verify token, a secret the graders on the nodes need too.
    monkeypatch.setattr(_servers, "secrets", SimpleNamespace(token_urlsafe=lambda n: verify_token))
    seen: list[bytes | None] = []
    server = AppServer(keyed_policy(EXAMPLES / "code-fn" / "policy.yaml", seen), name="keyed-policy")
    url = await asyncio.to_thread(server.start)
    try:
        rows = [
            json.loads(line) for line in (EXAMPLES / "code-fn" / "dataset.jsonl").read_text().splitlines()
        ]
        dataset = write_dataset(tmp_path / "data", [r for r in rows if r["id"] == "fizzbuzz"])
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
    # The proxy on the node sent the key; the grader on the node passed the environment's check.
    assert (record.outcome, record.reward) == ("completed", 1.0), record.receipt.outcome_reason
    assert seen and set(seen) == {f"Bearer {key}".encode()}
    # Ray's temp dirs (logs, runtime-env agent, spill), the node scratch, the run directory.
    assert files_holding([ray_cluster.root, tmp_path], [key, verify_token]) == []


@needs_ray
async def test_a_ticket_gives_its_secrets_once_and_never_after_its_attempt() -> None:
    from rollcage.controller._ray import _redeem, _SecretServer
    from rollcage.errors import RayTaskLostError

    server = _SecretServer()
    await server.start("127.0.0.1")
    try:
        host, port = server.address
        ticket = server.issue({"api_key": "k1"})
        unredeemed = server.issue({"api_key": "k2"})
        assert await asyncio.to_thread(_redeem, (host, port, ticket)) == {"api_key": "k1"}
        with pytest.raises(RayTaskLostError, match="already redeemed"):
            await asyncio.to_thread(_redeem, (host, port, ticket))
        server.revoke(unredeemed)  # its attempt ended
        with pytest.raises(RayTaskLostError, match="its attempt has ended"):
            await asyncio.to_thread(_redeem, (host, port, unredeemed))
        with pytest.raises(RayTaskLostError, match="unknown"):
            await asyncio.to_thread(_redeem, (host, port, secrets.token_urlsafe(32)))
    finally:
        await server.close()
    with pytest.raises(RayTaskLostError, match="cannot fetch this attempt's credentials"):
        await asyncio.to_thread(_redeem, (host, port, ticket))


@needs_ray
def test_the_attempt_handed_to_ray_holds_no_secret() -> None:
    from rollcage.controller._graders import VerifyGrader
    from rollcage.controller._ray import RayBackend
    from rollcage.controller._unit import EnvironmentPlan, GradingPlan, PreparedRollout, RolloutSettings
    from rollcage.protocol import WorkerInput

    worker_input = WorkerInput.model_validate(
        {"rollout_id": "r", "task_id": "t", "input": "q", "model": {"base_url": "http://m/v1", "model": "m"}}
    )
    plan = GradingPlan(grader=VerifyGrader(), verify_url="http://env")
    prepared = PreparedRollout(
        rollout_id="r",
        task_id="t",
        sample=0,
        try_index=0,
        rollout_dir="/x",
        worker_input=worker_input,
        grading=plan,
        environment=EnvironmentPlan(url="http://env", token="tok-secret", run_request={}),
    )
    backend = RayBackend(RayBackendConfig(), RolloutSettings(api_key_env="K"))
    backend._api_key = "sk-secret"
    shipped, values = backend._secrets_of(prepared)
    assert values == {"api_key": "sk-secret", "verify_token": "tok-secret"}
    assert "secret" not in shipped.model_dump_json()
    assert shipped.grading is not None and shipped.grading.verify_url == "http://env"
    assert shipped.environment is not None and shipped.environment.url == "http://env"


@needs_ray
@pytest.mark.timeout(120)
def test_an_address_where_no_ray_answers_fails_fast_saying_what_was_tried(tmp_path: Path) -> None:
    dataset = write_dataset(tmp_path, [{"id": "a", "input": "q"}], SIX_BY_SEVEN)
    address = f"127.0.0.1:{free_port()}"
    done = subprocess.run(
        [sys.executable, "-m", "rollcage", "run", str(dataset), "--backend", "ray", "--ray-address", address],
        capture_output=True,
        text=True,
        timeout=90,  # ray.init alone retries for minutes
        check=False,
        cwd=tmp_path,
    )
    text = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 2, text
    assert f"cannot connect to the Ray cluster at {address} (--ray-address)" in text
    assert "a TCP connection there failed" in text and "Connection refused" in text


@real_rollouts
async def test_a_run_start_sweeps_scratch_of_dead_processes_on_every_node(
    tmp_path: Path, ray_cluster: RayCluster
) -> None:
    from rollcage.controller._ray import RayBackend, _process_start
    from rollcage.controller._unit import RolloutSettings

    host = socket.gethostname()
    dead = await asyncio.to_thread(dead_pid)
    stale, kept = [], []
    for root in scratch_roots(ray_cluster.nodes):
        root.mkdir(parents=True, exist_ok=True)
        (stale_dir := root / f"{dead}.12345@{host}.abc" / "r-1" / "workspace").mkdir(parents=True)
        stale.append(stale_dir.parent.parent)
        # A live process's directory (this one's): a rollout of another run may be using it.
        (live_dir := root / f"{os.getpid()}.{_process_start(os.getpid())}@{host}.def").mkdir()
        kept.append(live_dir)
    backend = RayBackend(RayBackendConfig(), RolloutSettings(sandbox=SANDBOX))
    async with backend:
        pass  # a resumed run with nothing left to do still sweeps
    assert [d for d in stale if d.exists()] == []
    assert all(d.is_dir() for d in kept)
    for directory in kept:
        directory.rmdir()


@pytest.fixture(scope="module")
def token_cluster() -> Iterator[tuple[str, str]]:
    """A one-node cluster with Ray's token authentication on; its address and token."""
    if not HAVE_RAY:
        pytest.skip("needs ray")
    token = secrets.token_hex(16)
    root = short_root("rc-auth-")
    cluster = RayCluster(root, env={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token})
    try:
        cluster.start_head()
        yield cluster.address, token
    finally:
        survivors = cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
        assert survivors == [], f"processes of the token cluster survived its teardown: {survivors}"


def driver_env(tmp_path: Path, **ray: str) -> dict[str, str]:
    """This environment without Ray's settings (and a HOME without ~/.ray), plus ``ray``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    (home := tmp_path / "home").mkdir(exist_ok=True)
    return {**env, "HOME": str(home), "RAY_USAGE_STATS_ENABLED": "0", **ray}


@needs_ray
@pytest.mark.timeout(150, func_only=True)
@pytest.mark.parametrize("auth", ["no token", "wrong token"])
def test_a_token_cluster_refuses_a_driver_without_its_token_naming_authentication(
    tmp_path: Path, token_cluster: tuple[str, str], auth: str
) -> None:
    address, _ = token_cluster
    ray_env = {} if auth == "no token" else {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "not-the-token"}
    dataset = write_dataset(tmp_path, [{"id": "a", "input": "q"}], SIX_BY_SEVEN)
    done = subprocess.run(
        [sys.executable, "-m", "rollcage", "run", str(dataset), "--backend", "ray", "--ray-address", address],
        capture_output=True,
        text=True,
        timeout=90,  # ray.init alone retries for ~2 minutes, then says only "Failed to connect"
        check=False,
        cwd=tmp_path,
        env=driver_env(tmp_path, **ray_env),
    )
    text = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 2, text
    assert f"the Ray cluster at {address} (--ray-address) refused this driver's authentication" in text
    assert "InvalidAuthToken" in text
    if auth == "no token":
        assert "RAY_AUTH_MODE=unset, which sends no token" in text and "set RAY_AUTH_MODE=token" in text
    else:
        assert "the token from RAY_AUTH_TOKEN" in text and "does not accept that token" in text
    assert "not-the-token" not in text  # a token is named by its source, never shown


@needs_ray
def test_what_a_node_could_not_reach_is_read_from_its_attempts_reasons() -> None:
    from rollcage.controller._ray import _unreached_what

    model = (
        "transient (infrastructure) error: TransientModelError: HTTP 502: rollcage egress proxy: "
        "upstream model unreachable: ConnectError: cannot connect to ('10.0.0.9', 8000): "
        "[Errno 113] No route to host"
    )
    environment = (
        "the controller could not run the rollout: ResourceUnavailableError: "
        "environment http://10.0.0.7:9000 could not be reached for /seed_session: "
        "ConnectError: [Errno 111] Connection refused"
    )
    channel = (
        "the controller could not run the rollout: RayTaskLostError: the rollout task failed on n2 (Ray node "
        "ab12, pid 7): RayTaskLostError: cannot fetch this attempt's credentials from the driver at "
        "10.0.0.1:4242: timed out (every node must reach the driver's address on that port)"
    )
    assert _unreached_what(model) == "the model endpoint"
    assert _unreached_what(environment) == "the environment http://10.0.0.7:9000"
    assert _unreached_what(channel) == "the driver's credentials channel"
    assert _unreached_what("the worker was killed by SIGKILL, which the supervisor did not send") is None


@needs_ray
@pytest.mark.parametrize("token", ["nowhere", "unreadable path"])
def test_token_mode_without_a_readable_token_exits_2_in_one_line(tmp_path: Path, token: str) -> None:
    """Ray's C++ client aborts the process (a stack trace, exit 1) in token mode without a token; the
    driver says so first. Something listens at the address (a bare socket), so only the missing token
    stands between the driver and Ray's handshake."""
    dataset = write_dataset(tmp_path, [{"id": "a", "input": "q"}], SIX_BY_SEVEN)
    ray_env = {"RAY_AUTH_MODE": "token"}
    if token == "unreadable path":
        ray_env["RAY_AUTH_TOKEN_PATH"] = str(tmp_path / "no-such-token")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "rollcage",
                "run",
                str(dataset),
                "--backend",
                "ray",
                "--ray-address",
                address,
            ],
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
            cwd=tmp_path,
            env=driver_env(tmp_path, **ray_env),
        )
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert f"cannot connect to the Ray cluster at {address}" in lines[0]
    assert "RAY_AUTH_MODE=token but no token" in lines[0]
    if token == "unreadable path":
        assert f"RAY_AUTH_TOKEN_PATH names {tmp_path / 'no-such-token'}" in lines[0]


@real_rollouts
def test_a_token_cluster_runs_when_the_driver_has_its_token_as_ray_documents(
    tmp_path: Path, token_cluster: tuple[str, str]
) -> None:
    address, token = token_cluster
    dataset = write_dataset(
        tmp_path / "data", [{"id": "t", "input": "6*7?", "tools": ["python"], "expected": "42"}], SIX_BY_SEVEN
    )
    out = tmp_path / "out"
    command = [sys.executable, "-m", "rollcage", "run", str(dataset), "--out", str(out), "--sandbox", SANDBOX]
    proc = subprocess.run(
        [*command, "--backend", "ray", "--ray-address", address, "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
        env=driver_env(tmp_path, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (record,) = records(out)
    assert (record.outcome, record.reward) == ("completed", 1.0)


class GatedPolicy:
    """The scripted policy behind a gate: model requests of the gated rollouts wait until ``release``."""

    def __init__(self, script: Any, gated: set[str]) -> None:
        from rollcage.policy import PolicyApp, load_script

        self._app = PolicyApp(load_script(script))
        self._gated = gated
        self._arrived: set[str] = set()
        self._changed = threading.Condition()
        self._released = threading.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].endswith("/chat/completions"):
            rid = dict(scope["headers"]).get(b"x-rollout-id", b"").decode()
            if rid in self._gated:
                with self._changed:
                    self._arrived.add(rid)
                    self._changed.notify_all()
                await asyncio.to_thread(self._released.wait, 120)
        await self._app(scope, receive, send)

    def wait_arrived(self, rollout_ids: set[str], timeout: float = 90) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: rollout_ids <= self._arrived, timeout)

    def release(self) -> None:
        self._released.set()


@real_rollouts
async def test_losing_a_node_mid_run_is_an_infra_failure_retried_on_the_other_node(
    tmp_path: Path, ray_cluster: RayCluster
) -> None:
    from rollcage.controller._ray import RayBackend
    from rollcage.controller._servers import AppServer

    token = secrets.token_hex(3)
    tasks = [f"node{token}-a", f"node{token}-b"]
    firsts = {rollout_id(t, 0, 0) for t in tasks}
    gate = GatedPolicy(SIX_BY_SEVEN, firsts)
    server = AppServer(gate, name="gated-policy")
    url = await asyncio.to_thread(server.start)
    try:
        dataset = write_dataset(
            tmp_path / "data",
            [{"id": t, "input": "6*7?", "tools": ["python"], "expected": "42"} for t in tasks],
        )
        config = RunConfig(
            dataset=dataset,
            out=tmp_path / "out",
            model=ModelEndpointConfig(base_url=f"{url}/v1", model_name="scripted"),
            sandbox=SANDBOX,
            deadline_s=60,
            concurrency=2,
            max_infra_retries=1,
            retry_backoff_s=0,
            backend=RayBackendConfig(),
        )
        backend = config.backend.build(config.rollout_settings())
        assert isinstance(backend, RayBackend)
        driver_node = ray.get_runtime_context().get_node_id()
        try:
            async with asyncio.TaskGroup() as group:
                job = group.create_task(Controller(config, backend=backend).run())
                # Both first attempts are mid-flight, one on each node (1 CPU each).
                assert await asyncio.to_thread(gate.wait_arrived, firsts)
                async with asyncio.timeout(30):
                    where = {rid: await backend.placement(rid) for rid in firsts}
                (lost,) = [rid for rid, w in where.items() if w.node_id != driver_node]
                (info,) = [n for n in ray.nodes() if n["NodeID"] == where[lost].node_id]
                (node,) = [n for n in ray_cluster.nodes if n.owns(info)]
                os.kill(node.raylet_pid(), signal.SIGKILL)
                # Its Ray worker, the rollout's supervisor, dies with the raylet; the sandbox with it.
                await asyncio.to_thread(wait_until_dead, where[lost].pid, 60)
                gate.release()
            summary = job.result()
        finally:
            gate.release()
    finally:
        await asyncio.to_thread(server.stop)
    got = records(config.out)
    by_attempt = {r.rollout_id: r for r in got}
    assert len(got) == 3 and len(by_attempt) == 3  # exactly once each
    lost_record = by_attempt[lost]
    assert (lost_record.outcome, lost_record.graded, lost_record.reward) == ("infra_failure", False, None)
    reason = lost_record.receipt.outcome_reason
    assert "was lost" in reason and f"pid {where[lost].pid}" in reason, reason
    assert Counter((r.task_id, r.outcome) for r in got if r.outcome == "completed") == {
        (t, "completed"): 1 for t in tasks
    }
    assert all(r.reward == 1.0 for r in got if r.outcome == "completed")
    assert summary.exit_code == EXIT_OK and summary.metrics.retries == 1
    for rid in firsts:
        wait_until_gone(rid)  # no sandbox of either first attempt survives
    live = [n for n in ray_cluster.nodes if n.running() and n is not node]
    assert scratch_leftovers(live, [r.rollout_id for r in got]) == []


def hold_cpu_of(node_id: str) -> Any:
    """An actor holding one CPU of the node ``node_id`` (each test node has one), once it is placed."""

    @ray.remote(num_cpus=1)
    class CpuHold:
        def ready(self) -> bool:
            return True

    strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
    hold = CpuHold.options(scheduling_strategy=strategy).remote()  # type: ignore[attr-defined]
    ray.get(hold.ready.remote(), timeout=120)
    return hold


async def release_on(event: asyncio.Event, hold: Any) -> None:
    """Give the CPU ``hold`` holds back once ``event`` is set."""
    await event.wait()  # the caller cancels this when its run ends first
    ray.kill(hold)


@real_rollouts
async def test_an_environment_unreachable_from_a_node_is_recorded_as_such_and_named_at_the_end(
    tmp_path: Path, ray_cluster: RayCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """The environment answers the driver's node only: an attempt on the other node fails before its
    rollout directory exists. Its record names that cause (not an artifact limit), and the end of the
    run names the node and what it could not reach."""
    from rollcage.controller._ray import RayBackend
    from rollcage.controller._servers import AppServer
    from rollcage.environments import create_app

    driver_node = ray.get_runtime_context().get_node_id()
    owners = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
    (other,) = [node for node in ray_cluster.nodes if node.running() and not node.owns(owners[driver_node])]
    (other_id,) = [nid for nid, info in owners.items() if other.owns(info)]
    server = AppServer(create_app("calc-weather"), name="calc-weather")
    url = await asyncio.to_thread(server.start)
    try:
        async with NodeGate(int(url.rsplit(":", 1)[1]), refused=[other]) as gate:
            token = secrets.token_hex(3)
            tasks = [f"reach{token}-{i}" for i in range(3)]
            dataset = write_dataset(
                tmp_path / "data",
                [
                    {"id": t, "input": "6*7?", "tools": ["python"], "environment": gate.url, "expected": "42"}
                    | {"grader": {"type": "exact"}}
                    for t in tasks
                ],
                SIX_BY_SEVEN,
            )
            config = RunConfig(
                dataset=dataset,
                out=tmp_path / "out",
                sandbox=SANDBOX,
                deadline_s=60,
                concurrency=2,
                max_infra_retries=2,
                retry_backoff_s=0,
                backend=RayBackendConfig(),
            )
            backend = config.backend.build(config.rollout_settings())
            assert isinstance(backend, RayBackend)
            # Ray would place every attempt on the driver's node while its CPU is free (all three did,
            # once templates stayed warm): hold that CPU until an attempt has met the gate.
            hold = await asyncio.to_thread(hold_cpu_of, driver_node)
            try:
                with caplog.at_level(logging.ERROR, logger="rollcage.controller"):
                    async with asyncio.TaskGroup() as group:
                        release = group.create_task(release_on(gate.refused, hold))
                        summary = await Controller(config, backend=backend).run()
                        release.cancel()
            finally:
                ray.kill(hold)
    finally:
        await asyncio.to_thread(server.stop)
    got = records(config.out)
    assert gate.refused_connections, ("no attempt ran on the refused node", other.scratch_tmp, gate.seen)
    failed = [r for r in got if r.outcome == "infra_failure"]
    assert failed, [(r.rollout_id, r.outcome) for r in got]
    for record in failed:
        reason = record.receipt.outcome_reason
        assert f"environment {gate.url} could not be reached for /seed_session" in reason, reason
        assert "ray-max-artifact-mib" not in reason and "ArtifactsTooLarge" not in reason, reason
        assert (Path(record.rollout_dir) / "input.json").is_file()  # what was attempted, laid out
    assert any(r.outcome == "completed" for r in got)
    assert backend.unreached == {other_id: {f"the environment {gate.url}": len(failed)}}
    said = [m for m in caplog.messages if "could not reach" in m]
    assert len(said) == 1 and other_id[:12] in said[0] and gate.url in said[0], caplog.messages
    assert summary.exit_code in (EXIT_OK, EXIT_ALL_INFRA), summary


def stop_flag_actors(cluster: RayCluster) -> list[int]:
    """The processes of live stop-flag actors on ``cluster``'s nodes (Ray titles an actor's process
    ``ray::CLASS``; a node's raylet starts its worker processes): not another run's on this machine."""
    raylets = {node.raylet_pid() for node in cluster.nodes if node.running()}
    return [
        pid for pid in processes_mentioning("ray::_StopFlag") if alive(pid) and _parent_of(pid) in raylets
    ]


def _parent_of(pid: int) -> int | None:
    """Process ``pid``'s parent, or ``None`` once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return next((int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid:")), None)


@real_rollouts
async def test_a_stop_whose_flag_is_gone_kills_the_tasks_and_starts_no_retry(
    tmp_path: Path, ray_address: str, ray_cluster: RayCluster
) -> None:
    """The run's stop flag is lost with its process (as with its node) while rollouts wait on the model;
    then Ctrl-C. The driver cannot tell the tasks through the flag: it kills them and exits at once,
    instead of letting them run to their deadlines, and starts no retry."""
    from rollcage.controller._servers import AppServer

    token = secrets.token_hex(3)
    tasks = [f"flag{token}-{i}" for i in range(2)]
    firsts = {rollout_id(t, 0, 0) for t in tasks}
    gate = GatedPolicy(SIX_BY_SEVEN, firsts)
    server = AppServer(gate, name="gated-policy")
    url = await asyncio.to_thread(server.start)
    assert stop_flag_actors(ray_cluster) == []
    try:
        dataset = write_dataset(
            tmp_path / "data",
            [{"id": t, "input": "6*7?", "tools": ["python"], "expected": "42"} for t in tasks],
        )
        out = tmp_path / "out"
        args = [str(dataset), "--out", str(out), "--backend", "ray", "--ray-address", ray_address]
        args += [
            "--model",
            f"{url}/v1",
            "--model-name",
            "scripted",
            "--concurrency",
            "2",
            "--deadline",
            "120",
        ]
        args += ["--max-infra-retries", "2", "--retry-backoff", "0", "--quiet"]
        proc = rollcage_run(*args, cwd=tmp_path)
        try:
            assert await asyncio.to_thread(gate.wait_arrived, firsts), "the rollouts never asked the model"
            (flag,) = stop_flag_actors(ray_cluster)
            os.kill(flag, signal.SIGKILL)
            await asyncio.to_thread(wait_until_dead, flag)
            proc.send_signal(signal.SIGINT)
            # Not the rollouts' deadlines (120 s; the model never answers): the driver's own stop.
            code = await asyncio.to_thread(proc.wait, 10)
        finally:
            gate.release()
            _, text = await asyncio.to_thread(finish, proc, 30)
    finally:
        await asyncio.to_thread(server.stop)
    assert code == EXIT_INTERRUPTED, text
    got = records(out)
    assert {r.rollout_id for r in got} == firsts, text
    assert all(r.try_index == 0 for r in got)
    assert not any((out / "rollouts").glob("*-t1")), "a retry was started after the stop"
    for record in got:
        assert "stop flag could not tell the rollout task" in record.receipt.outcome_reason, record
    for rid in firsts:
        wait_until_gone(rid)  # no sandbox of a killed task survives


# ------------------------------------------------------------------ task images on the nodes


def _stores_holding(nodes: list[RayNode], name: str) -> list[Path]:
    """The nodes' image stores (the default: under each node's Ray temp dir) holding image ``name``."""
    held = []
    for node in nodes:
        refs = node.temp_dir / "rollcage-images" / "refs"
        if refs.is_dir() and any(name in p.read_text() for p in refs.glob("*.json")):
            held.append(refs.parent)
    return held


@real_rollouts
@pytest.mark.skipif(os.geteuid() != 0, reason="an image rollout mounts its root: root only")
@pytest.mark.skipif(shutil.which("docker-registry") is None, reason="needs docker-registry")
async def test_image_rows_run_and_are_graded_on_ray_pulling_each_image_once_per_node(
    tmp_path: Path, ray_cluster: RayCluster
) -> None:
    from rollcage.controller._servers import AppServer
    from tests.helpers.oci import Registry, push
    from tests.helpers.task_images import task_image

    registry = Registry(short_root("rc-reg-"))
    try:
        names = {which: f"tests/ray-{which}-{secrets.token_hex(4)}" for which in ("a", "b")}
        for which, name in names.items():
            image = task_image(python=False, programs=["/bin/bash"], env=[f"WHICH={which}"])
            push(registry.base, name, "v1", image)
        grader = {
            "type": "tests",
            # Runs in the image (its os-release, its Env) over the agent's changes.
            "command": 'grep -q rollcage-task-image /etc/os-release && test "$(cat fixed.txt)" = "$WHICH"',
            "timeout_s": 60,
        }
        rows, script = [], {}
        for which, name in names.items():
            for n in range(4):
                task = f"{which}{n}"
                fix = which if n else "not-it"  # each image's first row leaves the tests failing
                rows.append(
                    {
                        "id": task,
                        "input": "fix it",
                        "tools": ["bash"],
                        "sandbox": {"image": f"docker://{registry.host}/{name}:v1"},
                        "grader": grader,
                    }
                )
                script[task] = [
                    {"tool_calls": [{"name": "bash", "arguments": {"command": f"echo {fix} > fixed.txt"}}]},
                    {"text": "done"},
                ]
        dataset = write_dataset(tmp_path / "data", rows)
        # Each attempt is held at its first model call until all eight are in flight: with four at once
        # on a node (a quarter CPU each), both nodes run rows, whatever Ray's placement prefers.
        firsts = {rollout_id(str(row["id"]), 0, 0) for row in rows}
        gate = GatedPolicy({"tasks": script}, firsts)
        server = AppServer(gate, name="gated-policy")
        url = await asyncio.to_thread(server.start)
        try:
            config = RunConfig(
                dataset=dataset,
                out=tmp_path / "out",
                model=ModelEndpointConfig(base_url=f"{url}/v1", model_name="scripted"),
                sandbox=SANDBOX,
                deadline_s=90,
                concurrency=8,
                max_infra_retries=0,
                # Up to four attempts at once on each node, each in its own Ray worker process.
                backend=RayBackendConfig(num_cpus_per_rollout=0.25),
            )
            async with asyncio.TaskGroup() as group:
                job = group.create_task(Controller(config).run())
                try:
                    assert await asyncio.to_thread(gate.wait_arrived, firsts, 80), "not all eight in flight"
                finally:
                    gate.release()
            summary = job.result()
        finally:
            await asyncio.to_thread(server.stop)
        got = {r.task_id: r for r in records(tmp_path / "out")}
        assert {t: (r.outcome, r.reward) for t, r in got.items()} == {
            row["id"]: ("completed", 0.0 if row["id"].endswith("0") else 1.0) for row in rows
        }, {t: r.receipt.outcome_reason for t, r in got.items()}
        assert summary.exit_code == EXIT_OK
        for record in got.values():  # the change as evidence, made on the node from its image
            diff = (Path(record.rollout_dir) / "workspace.diff").read_text()
            assert "+++ b/work/fixed.txt" in diff, (record.task_id, diff)
        log = registry.log.read_text(errors="replace").splitlines()
        used = set()
        for which, name in names.items():
            holding = _stores_holding(ray_cluster.nodes, name)
            used.update(holding)
            manifest_gets = [line for line in log if f"GET /v2/{name}/manifests/" in line]
            # Each node that ran the image's rows pulled it once (concurrent prepares in one store:
            # tests/images/test_pull.py).
            assert len(manifest_gets) == len(holding) >= 1, (which, manifest_gets, holding)
        assert len(used) == 2  # both nodes ran image rows, each from its own store
    finally:
        registry.stop()
        shutil.rmtree(registry.directory, ignore_errors=True)


def test_the_node_image_store_must_be_an_absolute_path() -> None:
    with pytest.raises(ValueError, match="must be an absolute path"):
        RayBackendConfig(image_store=Path("images"))


@real_rollouts
@pytest.mark.skipif(os.geteuid() != 0, reason="an image rollout mounts its root: root only")
async def test_an_image_without_a_tools_program_fails_its_rows_on_the_node_saying_which(
    tmp_path: Path,
) -> None:
    from rollcage.policy import PolicyServer
    from tests.helpers.task_images import make_task_image

    image = make_task_image(tmp_path / "image", python=False)  # busybox: no bash
    rows = [{"id": "nobash", "input": "x", "tools": ["bash"], "sandbox": {"image": image.ref}}]
    dataset = write_dataset(tmp_path / "data", rows)
    store = tmp_path / "node-store"
    with PolicyServer({"tasks": {"*": [{"text": "done"}]}}) as policy:
        config = RunConfig(
            dataset=dataset,
            out=tmp_path / "out",
            model=ModelEndpointConfig(base_url=policy.base_url, model_name="scripted"),
            sandbox=SANDBOX,
            deadline_s=60,
            max_infra_retries=0,
            backend=RayBackendConfig(image_store=store),
        )
        await Controller(config).run()
    (record,) = records(tmp_path / "out")
    assert record.outcome == "infra_failure"
    assert f"image {image.ref} has no /bin/bash" in record.receipt.outcome_reason
    assert (store / "roots").is_dir()  # prepared in the configured store, not the node's default
    assert (Path(record.rollout_dir) / "input.json").is_file()  # what was attempted, as for a lost task
