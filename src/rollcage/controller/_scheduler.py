"""The scheduler: stream the dataset, run samples with bounded concurrency, record, resume, report.

One ``Controller`` drives one output directory. Its life, in order:

1. say which model it uses (the first line of output);
2. validate the whole dataset as a stream (every bad row reported by line; with
   ``strict`` a bad row stops the run before anything runs), and try the sandbox
   once (a machine that cannot contain agent code is refused before anything is written);
3. take the output directory's lock, kill what an earlier killed run left running,
   sweep the temporary files it left (``metrics.json``'s, and those in rollout
   directories set aside in ``interrupted/``), read ``rollouts.jsonl`` (repairing a
   torn last line) into the ledger: finished samples are skipped, unfinished ones rerun;
4. start the model (embedded policy) and the bundled environments on loopback;
5. stream the dataset again, keeping at most ``concurrency`` samples in flight;
   each sample runs attempts until one is final or the infrastructure retry
   budget is spent, every attempt appended to ``rollouts.jsonl`` (fsynced) before
   the next;
6. on ``stop`` (first Ctrl-C/SIGTERM): no new rollouts, in-flight ones are stopped
   through their supervisors (outcome ``cancelled``) and recorded; on cancellation
   (second Ctrl-C) in-flight ones are abandoned, their directories set aside on the
   next run; either way metrics.json is published and the servers stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import itertools
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rollcage.cage import release_launcher
from rollcage.controller._backend import Backend
from rollcage.controller._config import EmbeddedPolicyConfig, LocalBackendConfig, RunConfig
from rollcage.controller._dataset import (
    DatasetSource,
    EnvironmentRef,
    InvalidRow,
    Task,
    detect_format,
    iter_dataset,
    open_dataset,
    tasks_from_rows,
)
from rollcage.controller._formats import DatasetFormat
from rollcage.controller._ids import rollout_id
from rollcage.controller._ledger import RunLedger
from rollcage.controller._node_images import missing_program, programs_needed
from rollcage.controller._records import RecordLog, load_records
from rollcage.controller._servers import EmbeddedPolicy, EnvironmentPool
from rollcage.controller._unit import (
    Endpoints,
    ResumeSource,
    prepare_rollout,
    record_without_result,
    set_aside,
    set_aside_earlier,
    task_image,
)
from rollcage.errors import (
    ConfigError,
    DurableWriteError,
    ModelEndpointNotFoundError,
    RollcageError,
    SandboxError,
)
from rollcage.procs import shielded
from rollcage.protocol import (
    CommandHarness,
    HarnessEnvironment,
    ImageSandbox,
    ModelEndpoint,
    RolloutRecord,
    RunMetrics,
)

__all__ = [
    "EXIT_ALL_GRADER_ERRORS",
    "EXIT_ALL_INFRA",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "Controller",
    "NullReporter",
    "RecordSink",
    "Reporter",
    "RunSummary",
]

logger = logging.getLogger("rollcage.controller")

EXIT_OK = 0
"""The run finished: every sample has a final record (whatever the rewards)."""
EXIT_FAILED = 1
"""The controller itself failed (e.g. rollouts.jsonl could not be written)."""
EXIT_USAGE = 2
"""Bad command line, dataset or configuration; nothing (more) was run."""
EXIT_ALL_INFRA = 3
"""Every sample that ended, ended in infra_failure after its retries: the setup is broken."""
EXIT_ALL_GRADER_ERRORS = 4
"""Rollouts were up for grading and the grader failed on every one (grader_error): the grader is broken."""
EXIT_INTERRUPTED = 130
"""Stopped by Ctrl-C/SIGTERM; rerun the same command to resume."""

_READ_BATCH = 256
_MAX_INVALID_KEPT = 1000
_SLOT_POLL_S = 0.25
_FDS_PER_ROLLOUT = 16
"""Open files one supervised rollout holds besides its proxy connections (log, capture, pidfds, pipes)."""


class Reporter(Protocol):
    """What the controller tells the user; the CLI's is a rich progress bar, tests use ``NullReporter``."""

    def notice(self, message: str) -> None:
        """A line of information (the first one says which model is used)."""
        ...

    def invalid_row(self, row: InvalidRow) -> None:
        """A malformed dataset row."""
        ...

    def start(self, *, out_dir: Path, pending: int, done: int) -> None:
        """Rollouts are about to run: ``pending`` samples to go, ``done`` finished earlier."""
        ...

    def record(self, record: RolloutRecord, *, sample_done: bool) -> None:
        """An attempt finished and is on disk; ``sample_done``: its sample needs no other attempt."""
        ...

    def stop(self) -> None:
        """The run stops: end any live display (called once, however the run ends)."""
        ...


class NullReporter:
    """A reporter that says nothing."""

    def notice(self, message: str) -> None:
        """Ignore."""

    def invalid_row(self, row: InvalidRow) -> None:
        """Ignore."""

    def start(self, *, out_dir: Path, pending: int, done: int) -> None:
        """Ignore."""

    def record(self, record: RolloutRecord, *, sample_done: bool) -> None:
        """Ignore."""

    def stop(self) -> None:
        """Ignore."""


@dataclass
class RunSummary:
    """How a run ended.

    Attributes:
        out_dir: The output directory.
        metrics: The final metrics (also in ``metrics.json``).
        interrupted: A stop or cancellation ended it before every sample finished.
        invalid_rows: Malformed rows (the first 1000).
        attempts_run: Attempts finished by this invocation.
        error: Why the controller failed, if it did.
        all_infra: Every sample that ended, ended in ``infra_failure``.
        all_grader_errors: Every rollout up for grading hit ``grader_error``.
    """

    out_dir: Path
    metrics: RunMetrics
    interrupted: bool = False
    invalid_rows: list[InvalidRow] = field(default_factory=list)
    attempts_run: int = 0
    error: str | None = None
    all_infra: bool = False
    all_grader_errors: bool = False

    @property
    def exit_code(self) -> int:
        """The process exit code (see the ``EXIT_*`` constants)."""
        if self.error is not None:
            return EXIT_FAILED
        if self.interrupted:
            return EXIT_INTERRUPTED
        if self.all_infra:
            return EXIT_ALL_INFRA
        if self.all_grader_errors:
            return EXIT_ALL_GRADER_ERRORS
        return EXIT_OK


def _endpoint_not_found(record: RolloutRecord) -> str | None:
    """The not-found answer that ended the attempt, or ``None`` (``ModelEndpointNotFoundError``)."""
    error = record.receipt.result_error
    if (
        record.outcome != "infra_failure"
        or error is None
        or error.type != ModelEndpointNotFoundError.__name__
    ):
        return None
    return error.message


@dataclass
class _Scan:
    tasks: int = 0
    pending: int = 0
    invalid: list[InvalidRow] = field(default_factory=list)
    invalid_count: int = 0
    environments: dict[str, EnvironmentRef] = field(default_factory=dict)
    harnesses: set[str] = field(default_factory=set)
    images: dict[str, Task] = field(default_factory=dict)
    """Each task image the rows use, with the first row using it (named when it is refused)."""
    image_needs: dict[tuple[str, str], tuple[Task, str]] = field(default_factory=dict)
    """(image, program) -> the first row that runs the program in the image, and what for."""
    image_jupyter: Task | None = None
    """The first row that asks for the jupyter executor in an image (which has no ipykernel)."""
    commands: dict[str, Task] = field(default_factory=dict)
    """Each command harness program (argv[0]) run outside a task image, with the first row running it."""
    notices: dict[str, tuple[Task, int]] = field(default_factory=dict)
    """What rows written for another harness do not run as it would: the first such row, and how many."""


def _programs_needed(task: Task) -> list[tuple[str, str]]:
    """The programs the builtin loop runs in a task's image for its tools: (program, what for)."""
    return programs_needed(task.row.agent.mode, task.tools)


class _Slots:
    """Bounded concurrency for the producer: acquire waits for a free slot or the stop."""

    def __init__(self, size: int) -> None:
        self._free = size
        self._freed = asyncio.Event()

    async def acquire(self, stop: asyncio.Event) -> bool:
        while self._free <= 0:
            if stop.is_set():
                return False
            self._freed.clear()
            # Woken by a release; the short timeout only bounds how late a stop is noticed.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_SLOT_POLL_S):
                    await self._freed.wait()
        if stop.is_set():
            return False
        self._free -= 1
        return True

    def release(self) -> None:
        self._free += 1
        self._freed.set()


async def _wait_or_stop(stop: asyncio.Event, delay: float) -> bool:
    """Wait ``delay`` seconds; True if ``stop`` was set meanwhile."""
    if stop.is_set():
        return True
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(delay):
            await stop.wait()
    return stop.is_set()


RecordSink = Callable[[RolloutRecord], Awaitable[None]]
"""Receives each record once it is on disk; the sample waits for it (``rollcage.collect``'s backpressure)."""


class Controller:
    """Runs one dataset (a file, or tasks in memory) into one output directory.

    ``summary`` is readable however ``run`` ended.
    """

    def __init__(
        self,
        config: RunConfig,
        *,
        reporter: Reporter | None = None,
        backend: Backend | None = None,
        stop: asyncio.Event | None = None,
        tasks: Sequence[Any] | None = None,
        sink: RecordSink | None = None,
    ) -> None:
        """Prepare a run.

        Args:
            config: The run's configuration.
            reporter: Where progress goes; default: nowhere.
            backend: Where rollouts execute; default: ``config.backend.build(...)``.
            stop: Set it to stop gracefully (in-flight rollouts are stopped and recorded).
            tasks: The rows to run, parsed (dataset rows in ``config.dataset_format``), instead
                of ``config.dataset``; exactly one of the two is given.
            sink: Awaited with each record once it is on disk, before its sample goes on.

        Raises:
            ConfigError: Both or neither of ``tasks`` and ``config.dataset`` are given.
        """
        if (tasks is None) == (config.dataset is None):
            raise ConfigError("give the run either a dataset file or tasks in memory, not both or neither")
        self.config = config
        self.stop = stop if stop is not None else asyncio.Event()
        self._reporter: Reporter = reporter if reporter is not None else NullReporter()
        self._backend = backend
        self._sink = sink
        self._given: list[Task | InvalidRow] | None = None
        self._dataset: DatasetSource | None = None
        if tasks is not None:
            self._given = tasks_from_rows(tasks, format=config.dataset_format, environment=config.environment)
        self._source = (
            str(config.dataset) if config.dataset is not None else f"<{len(tasks or [])} tasks in memory>"
        )
        self._ledger = RunLedger(
            dataset=self._source,
            k=config.attempts,
            max_infra_retries=config.max_infra_retries,
            pass_threshold=config.pass_threshold,
        )
        self._scan = _Scan()
        self._format: DatasetFormat = "rollcage" if config.dataset_format == "auto" else config.dataset_format
        self._started = time.monotonic()
        self._attempts_run = 0
        self._error: str | None = None
        self._last_publish = 0.0
        self._endpoints: Endpoints | None = None
        self._harness_envs: dict[str, HarnessEnvironment | None] = {}
        self._images: dict[str, ImageSandbox] = {}
        self._images_on_nodes = False
        """The run's images are prepared where its rollouts run (the Ray backend's nodes), not here."""
        self._image_leases = contextlib.ExitStack()
        """The store leases of the run's images: held until the run ends, so no prune removes one."""
        self._log: RecordLog | None = None
        self._out = config.out
        # metrics.json is written only once earlier records are folded in: before that a
        # snapshot would overwrite a previous run's metrics with an empty ledger.
        self._loaded = False

    # ------------------------------------------------------------------ public

    @property
    def out_dir(self) -> Path:
        """The output directory."""
        return self._out

    def summary(self, *, interrupted: bool | None = None) -> RunSummary:
        """The run as it stands (final once ``run`` has returned or been cancelled)."""
        return RunSummary(
            out_dir=self._out,
            metrics=self._ledger.snapshot(time.monotonic() - self._started),
            interrupted=self.stop.is_set() if interrupted is None else interrupted,
            invalid_rows=list(self._scan.invalid),
            attempts_run=self._attempts_run,
            error=self._error,
            all_infra=self._ledger.all_infra_failures(),
            all_grader_errors=self._ledger.all_grader_errors(),
        )

    async def run(self) -> RunSummary:
        """Run the dataset to completion or until stopped; return the summary.

        Raises:
            ConfigError: The dataset, model or output directory is unusable (nothing ran),
                or ``strict`` is set and a row is malformed.

        **Cancellation:** in-flight rollouts are cancelled (their supervisors reap the
        workers); records already appended stay; metrics.json is published and every
        server stopped before the cancellation propagates, however often the caller is
        cancelled meanwhile.
        """
        self._started = time.monotonic()
        self._reporter.notice(self._model_line())
        lock_fd: int | None = None
        try:
            if self.config.dataset is not None:
                # Read where it is, or (a pipe) copied once: every pass below reads the same rows.
                self._dataset = await asyncio.to_thread(open_dataset, self.config.dataset)
            if self._dataset is not None and self.config.dataset_format == "auto":
                self._format = await asyncio.to_thread(detect_format, self._dataset.path)
                self._reporter.notice(f"Dataset format: {self._format} (detected; --format to choose)")
            self._scan = await asyncio.to_thread(self._prescan_rows)
            for bad in self._scan.invalid:
                self._reporter.invalid_row(bad)
            for message, (row, count) in self._scan.notices.items():
                self._reporter.notice(f"{message} ({count} row(s), first line {row.line}, id {row.id})")
            self._ledger.invalid_rows = self._scan.invalid_count
            if self.config.strict and self._scan.invalid_count:
                first = self._scan.invalid[0]
                raise ConfigError(
                    f"{self._scan.invalid_count} malformed row(s) in {self._source} "
                    f"(first: line {first.line}: {first.reason}); fix them or run without --strict"
                )
            if self._scan.tasks == 0:
                raise ConfigError(f"{self._source} has no valid rows to run")
            if isinstance(self.config.backend, LocalBackendConfig):
                self._check_open_files()
            self._harness_envs = await asyncio.to_thread(self._resolve_harnesses)
            await asyncio.to_thread(self._check_sandbox)
            await asyncio.to_thread(self._prepare_images)
            lock_fd = await asyncio.to_thread(self._lock_out_dir)
            await asyncio.to_thread(self._kill_leftovers)
            await asyncio.to_thread(self._sweep_leftovers)
            await asyncio.to_thread(self._load_ledger)
            self._loaded = True
            self._scan.pending = await asyncio.to_thread(self._count_pending)
            await self._run_with_servers()
        finally:
            if self._loaded:
                final = self._ledger.snapshot(time.monotonic() - self._started)
                await shielded(asyncio.to_thread(self._publish_metrics_quietly, final))
            self._reporter.stop()
            # The warm worker template (rollcage.warm) is this run's helper: it goes with the run.
            warm = sys.modules.get("rollcage.supervisor.warm")
            if warm is not None:
                await shielded(asyncio.to_thread(warm.stop_templates))
            # So are the namespaces its sandboxes were started from (rollcage.cage's launcher; the thread
            # stays, parked, for any other run of this process).
            await shielded(asyncio.to_thread(release_launcher))
            if lock_fd is not None:
                os.close(lock_fd)
            if self._dataset is not None:
                self._dataset.close()
            self._image_leases.close()
        return self.summary()

    # ------------------------------------------------------------------ stages

    def _model_line(self) -> str:
        model = self.config.model
        if isinstance(model, EmbeddedPolicyConfig):
            script = self._policy_script(model)
            return (
                f"Model: the embedded scripted policy (in-process, loopback) playing {script}; "
                "no --model given. Use --model URL --model-name NAME for a real endpoint."
            )
        return f"Model: {model.model_name} at {model.base_url}"

    def _prescan_rows(self) -> _Scan:
        scan = _Scan()
        for item in self._rows():
            if isinstance(item, InvalidRow):
                scan.invalid_count += 1
                if len(scan.invalid) < _MAX_INVALID_KEPT:
                    scan.invalid.append(item)
                continue
            scan.tasks += 1
            for notice in item.notices:
                first, count = scan.notices.get(notice, (item, 0))
                scan.notices[notice] = (first, count + 1)
            if item.environment is not None:
                scan.environments.setdefault(item.environment.key, item.environment)
            harness = item.row.agent.harness or self.config.harness
            scan.harnesses.add("builtin" if harness is None else harness.type)
            image = task_image(item, self.config.image)
            if isinstance(harness, CommandHarness) and image is None:
                scan.commands.setdefault(harness.argv[0], item)
            if image is not None:
                scan.images.setdefault(image, item)
                if harness is None or harness.type == "builtin":
                    for program, what in _programs_needed(item):
                        scan.image_needs.setdefault((image, program), (item, what))
                        if program == "python3" and item.row.executor.backend == "jupyter":
                            scan.image_jupyter = scan.image_jupyter or item
        return scan

    def _resolve_harnesses(self) -> dict[str, HarnessEnvironment | None]:
        """The environment of each harness the rows use, checked once before anything runs (blocking).

        Raises:
            ConfigError: One is missing or unusable, or a command harness's program cannot be found
                (as NOOA's missing environment is, up front rather than once per attempt): one line
                that says what to do, naming the first row concerned; nothing is ever downloaded here.
        """
        from rollcage.harness import missing_program, resolve_environment

        envs: dict[str, HarnessEnvironment | None] = {}
        for kind in ("nooa", "command"):
            if kind in self._scan.harnesses:
                envs[kind] = resolve_environment(kind, self.config.harness_env)
        for program, item in self._scan.commands.items():
            problem = missing_program(program, envs.get("command"))
            if problem is not None:
                raise ConfigError(
                    f"line {item.line} (task {item.id}): the command harness cannot start: {problem}; "
                    "install it, give its path, or give --harness-env PATH (a virtualenv whose bin has it)"
                )
        return envs

    def _check_sandbox(self) -> None:
        """Try the sandbox once, before anything is written.

        A machine that cannot contain agent code is refused with one line (exit 2), instead of
        every rollout ending in ``infra_failure``. Only for rollouts supervised here: a Ray node
        checks its own sandbox.
        """
        if self._backend is not None or not isinstance(self.config.backend, LocalBackendConfig):
            return
        if self.config.sandbox != "bwrap":
            return
        from rollcage.controller._unit import build_supervisor_config

        try:
            build_supervisor_config(self.config.rollout_settings()).sandbox.launcher().check()
        except SandboxError as exc:
            raise ConfigError(str(exc)) from exc

    def _prepare_images(self) -> None:
        """Pull and unpack each task image the rows use, once, and lease it for the run (blocking).

        Raises:
            ConfigError: An image cannot be used here, or a row runs a tool in an image that lacks
                its program (the python tool, codeact and the editor need ``python3``, bash
                ``/bin/bash``): one line naming the first row concerned; nothing has run.
        """
        if not self._scan.images:
            return
        first = next(iter(self._scan.images.values()))
        if self.config.sandbox != "bwrap":
            raise ConfigError(
                f"line {first.line} (task {first.id}): a task image needs the bwrap sandbox, not --sandbox "
                f"{self.config.sandbox}"
            )
        on_nodes = not isinstance(self.config.backend, LocalBackendConfig)
        if not on_nodes and os.geteuid() != 0:
            raise ConfigError(
                f"line {first.line} (task {first.id}): a task image needs rollcage to run as root, which "
                "mounts each rollout's copy-on-write root (bubblewrap 0.8 has no --overlay); run as root"
            )
        if self.config.bwrap.executor_cage != "bwrap":
            raise ConfigError(
                f"line {first.line} (task {first.id}): a task image needs agent code in a cage of its own "
                f"(executor_cage 'bwrap', not {self.config.bwrap.executor_cage!r})"
            )
        jupyter = self._scan.image_jupyter
        if jupyter is not None:
            raise ConfigError(
                f"line {jupyter.line} (task {jupyter.id}): the jupyter executor cannot run in a task image "
                "(it needs ipykernel there); use the repl executor, which needs only the image's python3"
            )
        if on_nodes:
            # Each node prepares the image in its own store when a rollout first needs it there
            # (rollcage.controller._node_images); its programs are checked there too.
            self._images_on_nodes = True
            return
        from rollcage.images import ImageStore, image_sandbox

        store = ImageStore()
        for ref, task in self._scan.images.items():
            where = f"line {task.line} (task {task.id}): image {ref}"
            try:
                prepared = store.prepare(ref)
                self._image_leases.enter_context(store.lease(prepared))
                sandbox = image_sandbox(prepared)
            except RollcageError as exc:
                raise ConfigError(f"{where}: {exc}") from exc
            for (image, program), (needer, what) in self._scan.image_needs.items():
                if image != ref:
                    continue
                where_found = missing_program(sandbox, program)
                if where_found is not None:
                    raise ConfigError(
                        f"line {needer.line} (task {needer.id}): image {ref} has no {program} "
                        f"(looked in {where_found}), so {what} cannot run in it"
                    )
            self._images[ref] = sandbox
            self._reporter.notice(f"Image {ref}: {prepared.root}")

    def _rows(self) -> Iterator[Task | InvalidRow]:
        if self._given is not None:
            return iter(self._given)
        assert self._dataset is not None
        return iter_dataset(self._dataset.path, format=self._format, environment=self.config.environment)

    def _policy_script(self, model: EmbeddedPolicyConfig) -> Path:
        """The embedded policy's script: the configured one, else ``policy.yaml`` beside the dataset."""
        if model.script is not None:
            return model.script
        if self.config.dataset is None:
            raise ConfigError(
                "the embedded scripted policy needs a script for tasks in memory: give its path"
            )
        return self.config.dataset.parent / "policy.yaml"

    def _lock_out_dir(self) -> int:
        try:
            (self._out / "rollouts").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create output directory {self._out}: {exc.strerror or exc}") from exc
        fd = os.open(self._out / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                f"another rollcage run is writing to {self._out}; wait for it to end or choose another --out"
            ) from None
        return fd

    def _kill_leftovers(self) -> None:
        """Kill what a killed earlier run left running (we hold the lock: nothing else owns these)."""
        from rollcage.supervisor import kill_leftovers

        killed = sum(
            kill_leftovers(token.parent.parent) for token in self._out.glob("rollouts/*/.sandbox/token")
        )
        if killed:
            self._reporter.notice(f"Killed {killed} process(es) left running by an earlier, interrupted run")

    def _check_open_files(self) -> None:
        """Raise the open-file limit; refuse a concurrency whose rollouts' own files exceed the reserve.

        Proxy connections never use the reserve (``rollcage.supervisor.fds``), so
        what the rollouts open themselves must fit in it for no rollout to starve
        another of descriptors.
        """
        from rollcage.supervisor.fds import raise_open_file_limit, reserve_for

        limit = raise_open_file_limit()
        reserve = reserve_for(limit)
        need = self.config.concurrency * _FDS_PER_ROLLOUT
        if need > reserve:
            raise ConfigError(
                f"--concurrency {self.config.concurrency} needs about {need} open files besides proxy "
                f"connections, and this process may open {limit} (ulimit -n), of which {reserve} are kept "
                f"for them: raise the hard limit (ulimit -Hn) or lower --concurrency to "
                f"{max(1, reserve // _FDS_PER_ROLLOUT)}"
            )

    def _sweep_leftovers(self) -> None:
        """Remove the temporary files a killed earlier run left (never a published artifact)."""
        from rollcage.durable import sweep_temp_artifacts

        attic = self._out / "interrupted"
        swept = sweep_temp_artifacts(self._out)
        if attic.is_dir():
            swept += sum(sweep_temp_artifacts(entry) for entry in attic.iterdir() if entry.is_dir())
        if swept:
            self._reporter.notice(f"Removed {swept} temporary file(s) left by an earlier, interrupted run")

    def _load_ledger(self) -> None:
        # Each record carries its health and metrics: resuming reads no rollout directory.
        report = load_records(self._out / "rollouts.jsonl", self._ledger.add)
        if report.records:
            self._reporter.notice(
                f"Resuming: {report.records} earlier attempt(s) in {self._out}/rollouts.jsonl"
            )
        if report.repaired_bytes:
            self._reporter.notice(
                f"Repaired a torn last line ({report.repaired_bytes} bytes) of rollouts.jsonl"
            )

    def _count_pending(self) -> int:
        pending = 0
        for item in self._rows():
            if isinstance(item, Task):
                pending += sum(1 for s in range(self.config.attempts) if not self._ledger.is_done(item.id, s))
        return pending

    async def _run_with_servers(self) -> None:
        policy: EmbeddedPolicy | None = None
        pool = EnvironmentPool()
        try:
            model = self.config.model
            if isinstance(model, EmbeddedPolicyConfig):
                policy = EmbeddedPolicy(self._policy_script(model))
                base_url = await asyncio.to_thread(policy.start)
                name = model.model_name
                self._reporter.notice(f"Scripted policy serving on {base_url}")
            else:
                base_url, name = model.base_url, model.model_name
            environments = await asyncio.to_thread(pool.start, self._scan.environments.values())
            for key, endpoint in environments.items():
                self._reporter.notice(f"Environment {key}: {endpoint.url}")
            self._endpoints = Endpoints(
                model=ModelEndpoint(base_url=base_url, model=name, api=self.config.api),
                environments=environments,
                harness=self.config.harness,
                harness_envs=self._harness_envs,
                images=self._images,
                image=self.config.image,
                images_on_nodes=self._images_on_nodes,
            )
            backend = self._backend or self.config.backend.build(self.config.rollout_settings())
            async with backend, RecordLog(self._out / "rollouts.jsonl") as log:
                self._log = log
                self._reporter.start(
                    out_dir=self._out,
                    pending=self._scan.pending,
                    done=self._scan.tasks * self.config.attempts - self._scan.pending,
                )
                await self._schedule(backend)
        finally:
            self._log = None
            # Shielded and in a thread: stopping the servers must finish even when the run is
            # cancelled (once or again), and must not block the loop.
            await shielded(_stop_servers(pool, policy))

    async def _tasks(self) -> AsyncIterator[Task]:
        rows: Iterator[Task | InvalidRow] = self._rows()
        while True:
            # The file is read on a thread, a batch at a time: no blocking read on the loop,
            # and never more than one batch of rows in memory.
            batch = await asyncio.to_thread(lambda: list(itertools.islice(rows, _READ_BATCH)))
            if not batch:
                return
            for item in batch:
                if isinstance(item, Task):
                    yield item

    async def _schedule(self, backend: Backend) -> None:
        slots = _Slots(self.config.concurrency)
        async with asyncio.TaskGroup() as group:
            async for task in self._tasks():
                if self.stop.is_set():
                    break
                for sample in range(self.config.attempts):
                    if self._ledger.is_done(task.id, sample):
                        continue
                    if not await slots.acquire(self.stop):
                        break
                    group.create_task(self._run_sample(backend, task, sample, slots))

    async def _run_sample(self, backend: Backend, task: Task, sample: int, slots: _Slots) -> None:
        assert self._endpoints is not None and self._log is not None
        previous: ResumeSource | None = None
        try:
            while not self.stop.is_set():
                try_index = self._ledger.next_try(task.id, sample)
                prepared = prepare_rollout(
                    task, sample, try_index, out_dir=self._out, endpoints=self._endpoints
                )
                try:
                    moved = await asyncio.to_thread(
                        set_aside, Path(prepared.rollout_dir), self._out / "interrupted"
                    )
                except DurableWriteError as exc:
                    self._stop_for(str(exc))
                    return
                if moved is not None:
                    logger.info(
                        "set aside the unfinished %s from an earlier run: %s", prepared.rollout_id, moved
                    )
                resume = task.row.resume
                if resume if resume is not None else self.config.resume_rollouts:
                    aside = await asyncio.to_thread(
                        set_aside_earlier, prepared.rollout_id, self._out / "interrupted"
                    )
                    source = self._resume_source(
                        task,
                        sample,
                        try_index,
                        prepared.rollout_id,
                        [p for p in aside if p != moved],
                        moved,
                        previous,
                    )
                    prepared = prepared.model_copy(update={"resume_from": source})
                record = await self._attempt(backend, prepared)
                try:
                    await self._log.append(record)
                except DurableWriteError as exc:
                    self._stop_for(f"cannot record rollouts: {exc}")
                    return
                state = self._ledger.add(record)
                self._attempts_run += 1
                self._reporter.record(record, sample_done=self._ledger.is_done(task.id, sample))
                await self._maybe_publish()
                if self._sink is not None:
                    await self._sink(record)
                missing = _endpoint_not_found(record)
                if missing is not None:
                    # Every attempt would meet the same 404: stop (NOOA fails on it too) rather than
                    # retry it as infrastructure; what completed is kept, nothing is graded on it.
                    self._error = (
                        f"the model endpoint has no such route or model ({missing}): check --model and "
                        "--model-name"
                    )
                    self._reporter.notice(f"Stopping: {self._error}")
                    self.stop.set()
                    return
                if record.outcome != "infra_failure" or self._ledger.is_done(task.id, sample):
                    return
                if prepared.resume_from is None:
                    previous = ResumeSource(rollout_id=record.rollout_id, directory=record.rollout_dir)
                else:
                    previous = prepared.resume_from.then(record.rollout_id, record.rollout_dir)
                delay = min(
                    self.config.retry_backoff_s * 2 ** max(0, state.infra_failures - 1),
                    self.config.retry_backoff_max_s,
                )
                if await _wait_or_stop(self.stop, delay):
                    return
        finally:
            slots.release()

    def _stop_for(self, error: str) -> None:
        """Stop the run for a fault of the run's own files: no new attempt, the summary says why."""
        self._error = error
        self._reporter.notice(f"Stopping: {error}")
        self.stop.set()

    async def _attempt(self, backend: Backend, prepared: Any) -> RolloutRecord:
        """Run one attempt; whatever it raises is that attempt's infra_failure, never its neighbours' loss.

        An exception here would end the task group and every sample in flight with it, so the
        failure of one attempt's machinery (a bug, a grader or backend raising) is recorded as
        its own ``infra_failure`` (retried within the budget), with the exception in its reason.
        """
        started = time.time()
        try:
            return await backend.run(prepared, stop=self.stop)
        except Exception as exc:
            logger.exception("rollout %s: the controller failed running it", prepared.rollout_id)
            return record_without_result(
                prepared, self.config.rollout_settings(), exc, started, where="the controller"
            )

    def _resume_source(
        self,
        task: Task,
        sample: int,
        try_index: int,
        rollout: str,
        aside: list[Path],
        moved: Path | None,
        previous: ResumeSource | None,
    ) -> ResumeSource | None:
        """The earlier attempt a new one continues: the one a killed run interrupted, else the last retried.

        An attempt interrupted by a killed controller has no record and keeps its id (its
        directory was set aside in ``interrupted/``: ``moved`` now, ``aside`` by earlier
        runs, latest first; a run killed while staging it again leaves one that never ran,
        passed over for the one before); an attempt this run retried after ``infra_failure``
        is the previous try, in this run or an earlier one.
        """
        if previous is not None:
            return previous
        interrupted = [
            ResumeSource(rollout_id=rollout, directory=str(path))
            for path in [*([moved] if moved else []), *aside]
        ]
        # Tries before this one ran in an earlier run: only infra_failure attempts are retried.
        tries = [rollout_id(task.id, sample, t) for t in range(try_index - 1, max(-1, try_index - 9), -1)]
        earlier = [ResumeSource(rollout_id=rid, directory=str(self._out / "rollouts" / rid)) for rid in tries]
        chain = [*interrupted, *earlier]
        if not chain:
            return None
        return chain[0].model_copy(update={"earlier": chain[1:]})

    async def _maybe_publish(self) -> None:
        now = time.monotonic()
        if now - self._last_publish >= self.config.metrics_interval_s:
            self._last_publish = now
            # The snapshot is taken here, on the loop that owns the ledger; only the write
            # goes to a thread.
            metrics = self._ledger.snapshot(now - self._started)
            await asyncio.to_thread(self._publish_metrics_quietly, metrics)

    def _publish_metrics_quietly(self, metrics: RunMetrics) -> None:
        from rollcage.durable import publish_json

        try:
            publish_json(self._out / "metrics.json", metrics, mode=0o644)
        except DurableWriteError as exc:
            logger.warning("cannot publish metrics.json: %s", exc)


async def _stop_servers(pool: EnvironmentPool, policy: EmbeddedPolicy | None) -> None:
    """Stop the environments, then the policy server, each on a thread; the second even if the first fails."""
    try:
        await asyncio.to_thread(pool.close)
    finally:
        if policy is not None:
            await asyncio.to_thread(policy.stop)
