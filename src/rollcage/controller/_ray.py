"""The Ray backend: each rollout is a Ray task that supervises and grades it on a node.

One attempt, end to end::

    driver (RayBackend.run)                     node (a Ray worker process)
    ───────────────────────                     ───────────────────────────
    submit _rollout_task ─────────────────────► yield its placement (node, pid)
      PreparedRollout + settings as JSON;       lay out the rollout directory: a private
      the API key in the task's runtime_env       scratch directory, or in place (shared_dir)
                                                run_rollout: supervisor, sandbox and egress
    on stop: set the _StopFlag actor ◄────────►   proxy here; the task long-polls the flag
                                                  and stops the supervisor when it is set;
                                                  grading here, outside the sandbox
    unpack under --out/rollouts/<id>/ ◄──────── yield the record and the packed directory
    return the record; the Controller             (tar.gz, size-bounded; none with shared_dir)
    appends it, as with the local backend

A task lost to a dead worker process or node (any ``ray.exceptions.RayError``), or
one overdue, becomes an ``infra_failure`` record whose receipt says why, and the
controller retries it like any other; Ray itself never retries (``max_retries=0``),
so no attempt runs twice behind the controller's back.

Ray is imported at the top of this module, which only ``RayBackendConfig.build``
imports: the local backend never loads Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import ipaddress
import logging
import os
import shutil
import signal
import socket
import stat
import tarfile
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePath
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any, Literal, Self

import ray
from pydantic import ValidationError
from ray.exceptions import RayError, RayTaskError

from rollcage import __version__
from rollcage.controller._unit import (
    PreparedRollout,
    RolloutSettings,
    _failed_receipt,
    _lay_out,
    build_supervisor_config,
    run_rollout,
)
from rollcage.errors import (
    ArtifactsTooLargeError,
    ConfigError,
    RayTaskLostError,
    RayTaskOverdueError,
    RollcageError,
)
from rollcage.protocol import RolloutMetrics, RolloutRecord

if TYPE_CHECKING:
    from rollcage.controller._config import RayBackendConfig

__all__ = [
    "ArtifactsTooLargeError",
    "RayBackend",
    "RayTaskLostError",
    "RayTaskOverdueError",
    "RolloutPlacement",
    "lost_record",
    "pack_rollout_dir",
    "unpack_rollout_dir",
]

logger = logging.getLogger("rollcage.controller")

_FINISH_SLACK_S = 120.0
"""Beyond deadline + grace: the supervisor's kill waits, grading (plus a verify grader's own
timeout), packing and shipping. Past it the task is presumed hung and is killed."""
_STOP_POLL_S = 5.0
"""How long one long-poll of the stop flag waits on the actor before it is asked again."""
_RPC_TIMEOUT_S = 30.0
"""Bound on one call to the stop flag actor, beyond its own wait."""
_STOP_FLAG_CONCURRENCY = 10_000
"""Long-polls the stop flag serves at once: one per rollout in flight, plus stragglers."""
_MAX_FORWARDED_LOGS = 50
"""Warnings of one rollout's node-side run forwarded to the driver's log."""
_SCRATCH_NAME = "rollcage-ray"

_ray: Any = ray
"""Ray's untyped corners (``ray.nodes``, ``ray.util``), called without a per-call ignore that
would go stale wherever Ray's annotations change."""


@dataclass(frozen=True)
class RolloutPlacement:
    """Where a rollout's Ray task runs.

    Attributes:
        node_id: The Ray node id.
        node_ip: The node's address, as Ray knows it.
        hostname: The node's host name.
        pid: The Ray worker process running the task: the supervisor's process, parent of
            the sandbox (killing it kills the sandbox, which dies with its parent).
    """

    node_id: str
    node_ip: str
    hostname: str
    pid: int


# ---------------------------------------------------------------------------- artifacts


def _content_size(directory: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(directory):  # never follows symlinks
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                info = os.lstat(os.path.join(root, name))
                if stat.S_ISREG(info.st_mode):
                    total += info.st_size
    return total


def _packable(member: tarfile.TarInfo) -> tarfile.TarInfo | None:
    # The sandbox could leave a FIFO or device node in its workspace; only the kinds of
    # file a rollout directory is made of travel.
    if member.isreg() or member.isdir() or member.issym() or member.islnk():
        return member
    return None


def _mib(size: int) -> str:
    return f"{size / (1024 * 1024):.1f} MiB"


def pack_rollout_dir(directory: Path, *, limit: int) -> bytes:
    """Pack a rollout directory as gzip-compressed tar bytes (blocking).

    Symlinks are packed as links, never followed: a link the agent made to a file
    outside its workspace must not ship that file. Only regular files, directories
    and links are packed.

    Args:
        directory: The rollout directory.
        limit: Most bytes of file content (and of the archive) allowed.

    Raises:
        ArtifactsTooLargeError: The files hold more than ``limit`` bytes.
        OSError: A file could not be read.
    """
    size = _content_size(directory)
    if size > limit:
        raise ArtifactsTooLargeError(
            f"the rollout directory holds {_mib(size)}, "
            f"over the {_mib(limit)} limit for shipping it to the driver"
        )
    buffer = io.BytesIO()
    # Level 1: captures and checkpoints are repetitive JSON and shrink a lot even so, for
    # little CPU on a node that is also running rollouts.
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=1) as tar:
        for entry in sorted(os.listdir(directory)):
            tar.add(directory / entry, arcname=entry, filter=_packable)
    if buffer.tell() > limit:
        raise ArtifactsTooLargeError(
            f"the packed rollout directory is {_mib(buffer.tell())}, over the {_mib(limit)} limit"
        )
    return buffer.getvalue()


def _unpackable(member: tarfile.TarInfo, destination: str) -> tarfile.TarInfo | None:
    # tarfile's "tar" filter keeps every member inside the destination, also through a
    # link unpacked earlier; uid/gid None: no chown to a node's ids, files are ours.
    checked = tarfile.tar_filter(member, destination)
    return checked.replace(uid=None, gid=None, uname=None, gname=None, deep=False)  # type: ignore[arg-type]


def unpack_rollout_dir(archive: bytes, directory: Path) -> None:
    """Unpack ``pack_rollout_dir`` bytes into ``directory``, which must not exist (blocking).

    Raises:
        FileExistsError: ``directory`` exists.
        OSError: Writing failed.
        tarfile.TarError: The archive is damaged, or a member would land outside ``directory``.
    """
    directory.mkdir(parents=True, exist_ok=False)
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        tar.extractall(directory, filter=_unpackable)


# ---------------------------------------------------------------------------- records


def lost_record(
    prepared: PreparedRollout, settings: RolloutSettings, reason: BaseException, started: float
) -> RolloutRecord:
    """The ``infra_failure`` record of an attempt whose task produced no record of its own.

    Built like ``run_rollout``'s record when the supervisor raises: the same receipt
    (``_failed_receipt``, whose reason names ``reason``), no grading, no result.

    Args:
        prepared: The attempt.
        settings: Its settings (the receipt repeats the deadline and sandbox).
        reason: Why there is no record (a Ray error, an overdue task, unshippable artifacts).
        started: Unix time the attempt was submitted.
    """
    logger.warning("rollout %s: infrastructure failure in the Ray backend: %s", prepared.rollout_id, reason)
    receipt = _failed_receipt(prepared, settings, reason, started)
    return RolloutRecord(
        rollout_id=prepared.rollout_id,
        task_id=prepared.task_id,
        sample=prepared.sample,
        try_index=prepared.try_index,
        outcome=receipt.outcome,
        graded=False,
        reward=None,
        receipt=receipt,
        metrics=RolloutMetrics(duration_s=receipt.duration_s),
        rollout_dir=prepared.rollout_dir,
    )


# ---------------------------------------------------------------------------- node side


class _StopFlag:
    """A run's stop, set by the driver and long-polled by its tasks (a Ray actor)."""

    def __init__(self) -> None:
        self._stopped = asyncio.Event()

    async def set(self) -> None:
        """Stop every rollout of the run."""
        self._stopped.set()

    async def wait(self, timeout_s: float) -> bool:
        """Whether the run is stopped, waiting up to ``timeout_s`` for it to be."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._stopped.wait()
        return self._stopped.is_set()


_StopFlagActor: Any = ray.remote(_StopFlag)


async def _watch_stop(flag: Any, stop: asyncio.Event) -> None:
    """Set ``stop`` once the driver sets the run's stop flag.

    **Cancellation:** the pending poll is abandoned (it ends on the actor within
    ``_STOP_POLL_S``).
    """
    while not stop.is_set():
        try:
            async with asyncio.timeout(_STOP_POLL_S + _RPC_TIMEOUT_S):
                stopped = await flag.wait.remote(_STOP_POLL_S)
        except TimeoutError:
            continue  # a busy actor; ask again
        except RayError as exc:
            # The flag lives with the driver: if it is gone, so is the driver, and Ray
            # kills this task as its owner's. Stopping the rollout on a transient error
            # would record it as cancelled for nothing, so only stop listening.
            logger.warning("the run's stop flag is unreachable (%s); this rollout runs to its end", exc)
            return
        if stopped:
            stop.set()


class _RolloutThread:
    """``run_rollout`` on its own thread and event loop, inside a Ray task."""

    def __init__(self, prepared: PreparedRollout, settings: RolloutSettings, flag: Any) -> None:
        self._prepared = prepared
        self._settings = settings
        self._flag = flag
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stop_requested = threading.Event()
        self._record: RolloutRecord | None = None
        self._error: BaseException | None = None

    def run(self) -> RolloutRecord:
        """Run the rollout and return its record (blocking).

        Raises:
            RayTaskOverdueError: The rollout outlived its deadline by far; its thread is
                asked to stop and left to end with the process.

        **Cancellation:** an exception in the waiting thread (Ray's ``KeyboardInterrupt``
        of a non-forced cancel) stops the rollout through its supervisor, waits for it
        (bounded) and propagates.
        """
        thread = threading.Thread(
            target=self._main, name=f"rollcage-{self._prepared.rollout_id}", daemon=True
        )
        thread.start()
        # Longer than the driver's bound on the same task, so a live driver kills this
        # process (and the rollout with it) first; this one guards a driverless task.
        bound = self._settings.deadline_s + self._settings.grace_s + 2 * _FINISH_SLACK_S
        if self._prepared.grading is not None and self._prepared.grading.grader.type == "verify":
            bound += float(self._prepared.grading.grader.timeout_s)
        try:
            thread.join(bound)
        except BaseException:
            self._request_stop()
            thread.join(self._settings.grace_s + _FINISH_SLACK_S)
            raise
        if thread.is_alive():
            self._request_stop()
            raise RayTaskOverdueError(f"the rollout did not end within {bound:.0f} s of its start")
        if self._error is not None:
            raise self._error
        assert self._record is not None
        return self._record

    def _request_stop(self) -> None:
        self._stop_requested.set()
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nothing left to stop
                loop.call_soon_threadsafe(stop.set)

    def _main(self) -> None:
        # Ray blocks SIGINT in its worker processes, and a blocked signal stays blocked in
        # every child. The Python executor interrupts a runaway cell with SIGINT, so this
        # thread, which starts the rollout's processes, unblocks it: they then behave as
        # under the local backend.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        try:
            self._record = asyncio.run(self._supervise())
        except BaseException as exc:
            self._error = _unwrap(exc)

    async def _supervise(self) -> RolloutRecord:
        self._loop = asyncio.get_running_loop()
        self._stop = stop = asyncio.Event()
        if self._stop_requested.is_set():
            stop.set()
        async with asyncio.TaskGroup() as group:
            watcher = group.create_task(_watch_stop(self._flag, stop))
            try:
                return await run_rollout(self._prepared, self._settings, stop=stop)
            finally:
                watcher.cancel()


class _LogBuffer(logging.Handler):
    """Collects a rollout's warnings on the node, to be logged again by the driver."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[tuple[str, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.records) < _MAX_FORWARDED_LOGS:
            try:
                self.records.append((record.name, record.levelno, record.getMessage()))
            except (TypeError, ValueError):  # a malformed format string: skip, never raise
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _scratch_dir() -> Path:
    """A fresh private directory for one rollout on this node; sweeps ones left by dead workers."""
    root = Path(tempfile.gettempdir()) / _SCRATCH_NAME
    root.mkdir(mode=0o700, exist_ok=True)
    host = socket.gethostname()
    # A worker process runs one task at a time and removes its directory when the task
    # ends, so a directory named for a dead process (killed with its task, or its task
    # force-cancelled) is garbage, and one named for this process is a leftover.
    for entry in os.scandir(root):
        pid_text, _, rest = entry.name.partition("-")
        if pid_text.isdigit() and rest.startswith(f"{host}-"):
            pid = int(pid_text)
            if pid == os.getpid() or not _alive(pid):
                shutil.rmtree(entry.path, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-{host}-", dir=root))


def _unshippable(exc: BaseException, record: RolloutRecord) -> ArtifactsTooLargeError:
    reward = f", reward {record.reward}" if record.graded else ""
    return ArtifactsTooLargeError(
        f"{exc} (the rollout itself ended {record.outcome}{reward}); nothing was shipped: raise "
        "--ray-max-artifact-mib or run with --shared-dir"
    )


def _run_on_node(
    prepared: PreparedRollout, settings: RolloutSettings, node_dir: str | None, limit: int, flag: Any
) -> dict[str, Any]:
    started = time.time()
    scratch = _scratch_dir() if node_dir is None else None
    local_dir = scratch / prepared.rollout_id if scratch is not None else Path(str(node_dir))
    try:
        here = prepared.model_copy(update={"rollout_dir": str(local_dir)})
        record = _RolloutThread(here, settings, flag).run()
        record = record.model_copy(update={"rollout_dir": prepared.rollout_dir})
        archive: bytes | None = None
        if scratch is not None:
            try:
                archive = pack_rollout_dir(local_dir, limit=limit)
            except (ArtifactsTooLargeError, OSError, tarfile.TarError) as exc:
                record = lost_record(prepared, settings, _unshippable(exc, record), started)
        return {"record": record.model_dump_json(), "archive": archive}
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _rollout_task(
    prepared: PreparedRollout,
    settings: RolloutSettings,
    node_dir: str | None,
    max_artifact_bytes: int,
    flag: Any,
    driver_version: str,
) -> Iterator[dict[str, Any]]:
    """The Ray task of one attempt: yields its placement, then its outcome.

    Args:
        prepared: The attempt (its ``rollout_dir`` is the driver's path). Pickled by Ray,
            not sent as JSON: its grading plan holds typed grader specs.
        settings: The supervision and grading settings.
        node_dir: Where to lay out the rollout directory in place (shared file system);
            ``None``: a private scratch directory, packed and shipped back.
        max_artifact_bytes: Limit on what is shipped back.
        flag: The run's ``_StopFlag`` actor.
        driver_version: The driver's rollcage version; a different one here is refused.

    Yields:
        ``{node_id, node_ip, hostname, pid}``, then ``{record, archive}``: the record as
        JSON (``rollout_dir`` the driver's path) and the packed directory or ``None``.
    """
    context = ray.get_runtime_context()
    yield {
        "node_id": context.get_node_id(),
        "node_ip": _ray.util.get_node_ip_address(),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
    }
    if driver_version != __version__:
        raise RuntimeError(
            f"rollcage {__version__} on node {socket.gethostname()}, but {driver_version} on the driver: "
            "install the same version everywhere"
        )
    buffer = _LogBuffer()
    source = logging.getLogger("rollcage")
    source.addHandler(buffer)
    try:
        outcome = _run_on_node(prepared, settings, node_dir, max_artifact_bytes, flag)
    finally:
        source.removeHandler(buffer)
    outcome["logs"] = buffer.records
    yield outcome


_rollout_remote: Any = ray.remote(_rollout_task)


# ---------------------------------------------------------------------------- driver side


async def _next_item(generator: Any) -> object:
    """The task's next yielded value, or the exception that ended it.

    Returned rather than raised, so a lost task never fails the task group waiting on it.

    **Cancellation:** the wait is abandoned; the Ray task is not touched.
    """
    try:
        ref = await anext(generator)
        return await ref
    except Exception as exc:  # RayError, StopAsyncIteration, anything Ray raises for a lost task
        return exc


def _is_loopback(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _DropSigtermNotice(logging.Filter):
    """Drops ray.init's notice that it left SIGTERM alone (called on a thread, it must)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("SIGTERM handler is not set")


def _quiet_sigterm_notice() -> None:
    # ray.init runs on a thread here so that the driver's own SIGINT/SIGTERM handling stays
    # in place; Ray then warns that it did not install its SIGTERM handler, which is the point.
    worker_logger = logging.getLogger("ray._private.worker")
    if not any(isinstance(f, _DropSigtermNotice) for f in worker_logger.filters):
        worker_logger.addFilter(_DropSigtermNotice())


class RayBackend:
    """Runs each rollout as a Ray task on whichever node has room (see the module docstring).

    Lifecycle: ``async with backend:`` connects to the cluster (or starts a private
    local instance) and creates the run's stop flag; leaving disconnects (stopping an
    instance it started). At most one Ray task per ``run`` call is in flight, so the
    controller's ``concurrency`` bounds the tasks in flight.
    """

    def __init__(self, config: RayBackendConfig, settings: RolloutSettings) -> None:
        """Prepare; nothing is contacted before ``async with``.

        Args:
            config: Which cluster, CPUs per rollout, shared directory, artifact limit.
            settings: How rollouts are supervised and graded (on the nodes).
        """
        self._config = config
        self._settings = settings
        self._state: Literal["unopened", "opened", "closed"] = "unopened"
        self._owns_ray = False
        self._flag: Any = None
        self._stop_sent = False
        self._runtime_env: dict[str, Any] | None = None
        self._placements: dict[str, RolloutPlacement] = {}
        self._placed = asyncio.Event()  # replaced, after being set, at every new placement
        self._last_progress = time.monotonic()
        self._nodes = 0
        self._warned: set[str] = set()
        self._cwd = "/"
        # Nothing started or finished for this long means nothing can: every task that ran
        # would have ended by now, so a task still waiting for a node waits for one that
        # does not exist (e.g. no node has num_cpus_per_rollout CPUs).
        self._stall_s = settings.deadline_s + settings.grace_s + _FINISH_SLACK_S

    @property
    def placements(self) -> Mapping[str, RolloutPlacement]:
        """Where each rollout in flight runs, by rollout id (a read-only live view)."""
        return MappingProxyType(self._placements)

    async def placement(self, rollout_id: str) -> RolloutPlacement:
        """Where ``rollout_id`` runs, once its task has started on a node (for tools and tests).

        **Cancellation:** the wait ends; bound it with ``asyncio.timeout``, since a rollout
        that is never run is never placed.
        """
        while (where := self._placements.get(rollout_id)) is None:
            await self._placed.wait()
        return where

    async def __aenter__(self) -> Self:
        """Connect to the cluster, check the settings, create the run's stop flag.

        Raises:
            ConfigError: The cluster cannot be reached, the shared directory is missing,
                or the supervisor refuses the settings.

        **Cancellation:** a connection being made completes on its thread and is then closed.
        """
        if self._state != "unopened":
            raise RuntimeError(f"RayBackend cannot be entered when {self._state}")
        shared = self._config.shared_dir
        if shared is not None and not await asyncio.to_thread(shared.is_dir):
            raise ConfigError(f"--shared-dir {shared} is not a directory here")
        try:
            build_supervisor_config(self._settings)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"the supervisor refused the settings: {exc}") from exc
        connecting = asyncio.ensure_future(asyncio.to_thread(self._connect))
        try:
            await asyncio.shield(connecting)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await connecting
            await asyncio.shield(asyncio.to_thread(self._disconnect))
            raise
        self._state = "opened"
        self._last_progress = time.monotonic()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Remove the stop flag; stop the local instance if this backend started it.

        **Cancellation:** shielded: the instance is stopped even when the run is cancelled.
        """
        self._state = "closed"
        await asyncio.shield(asyncio.to_thread(self._disconnect))

    def _connect(self) -> None:
        self._cwd = os.getcwd()
        if not ray.is_initialized():
            address = self._config.address or os.environ.get("RAY_ADDRESS") or "local"
            options: dict[str, Any] = {
                "address": address,
                # Task output would interleave with the progress bar; warnings come back
                # with each record instead (see _LogBuffer).
                "log_to_driver": False,
                "logging_level": logging.WARNING,
                "include_dashboard": False,
            }
            if address == "local":
                options["num_cpus"] = self._config.local_num_cpus
            _quiet_sigterm_notice()
            try:
                ray.init(**options)
            except Exception as exc:  # Ray raises ConnectionError, RuntimeError, ValueError...
                raise ConfigError(f"cannot connect to the Ray cluster at {address}: {exc}") from exc
            self._owns_ray = True
        try:
            nodes = [node for node in _ray.nodes() if node.get("Alive")]
            self._nodes = len(nodes)
            largest = max((float(n.get("Resources", {}).get("CPU", 0.0)) for n in nodes), default=0.0)
            if largest < self._config.num_cpus_per_rollout:
                logger.warning(
                    "no node of the Ray cluster has %s CPUs for a rollout (the largest has %s): rollouts "
                    "wait until such a node joins",
                    self._config.num_cpus_per_rollout,
                    largest,
                )
            self._flag = _StopFlagActor.options(num_cpus=0, max_concurrency=_STOP_FLAG_CONCURRENCY).remote()
            self._runtime_env = self._credentials()
        except BaseException:
            self._disconnect()
            raise

    def _credentials(self) -> dict[str, Any] | None:
        name = self._settings.api_key_env
        if name is None:
            return None
        value = os.environ.get(name)
        if not value:
            logger.warning(
                "%s is not set here: every node's Ray workers must have it in their environment", name
            )
            return None
        # An environment variable of the task's worker process: the supervisor there reads it
        # and its egress proxy adds it to upstream requests. input.json never holds it, and
        # the sandbox's environment is an allow-list that cannot name it.
        return {"env_vars": {name: value}}

    def _disconnect(self) -> None:
        flag, self._flag = self._flag, None
        if flag is not None:
            with contextlib.suppress(Exception):
                ray.kill(flag)
        if self._owns_ray:
            self._owns_ray = False
            ray.shutdown()

    def _warn_unreachable(self, prepared: PreparedRollout) -> None:
        if self._nodes <= 1:
            return
        urls = [prepared.worker_input.model.base_url]
        urls += [endpoint.base_url for endpoint in prepared.worker_input.resources.values()]
        if prepared.grading is not None and prepared.grading.verify_url is not None:
            urls.append(prepared.grading.verify_url)
        for url in urls:
            if url not in self._warned and _is_loopback(url):
                self._warned.add(url)
                logger.warning(
                    "the Ray cluster has %d nodes but %s is a loopback address of the driver: rollouts on "
                    "other nodes cannot reach it (use --model URL and environments by URL that every node "
                    "reaches)",
                    self._nodes,
                    url,
                )

    async def run(self, prepared: PreparedRollout, *, stop: asyncio.Event) -> RolloutRecord:
        """Run one attempt as a Ray task and return its record, its directory under ``--out``.

        A lost task (dead worker process or node, overdue, artifacts that cannot be
        shipped or unpacked) is returned as an ``infra_failure`` record, never raised.

        **Cancellation:** the Ray task is killed (``ray.cancel(force=True)``; the
        sandbox dies with its parent process) and no record is returned; without a
        shared directory its node-side files are swept by the next task on that node.
        """
        if self._state != "opened":
            raise RuntimeError("RayBackend.run outside 'async with backend:'")
        self._warn_unreachable(prepared)
        started = time.time()
        # The same path on every node (shared_dir's contract), made absolute with the driver's cwd.
        node_dir = str(PurePath(self._cwd, prepared.rollout_dir)) if self._config.shared_dir else None
        options: dict[str, Any] = {
            "num_cpus": self._config.num_cpus_per_rollout,
            "num_returns": "streaming",
            "max_retries": 0,  # the controller retries, and records every attempt
            "name": f"rollcage:{prepared.rollout_id}",
        }
        if self._runtime_env is not None:
            options["runtime_env"] = self._runtime_env
        generator = _rollout_remote.options(**options).remote(
            prepared,
            self._settings,
            node_dir,
            self._config.max_artifact_bytes,
            self._flag,
            __version__,
        )
        async with asyncio.TaskGroup() as group:
            # The relay waits on the run's stop for as long as this attempt lasts, no longer.
            relay = group.create_task(self._relay_stop(stop))
            outcome = await self._follow(prepared, generator, group)
            relay.cancel()
        if isinstance(outcome, BaseException):
            return await asyncio.to_thread(self._record_lost, prepared, outcome, started)
        record = await asyncio.to_thread(self._land, prepared, outcome, started)
        for name, level, message in outcome.get("logs", []):
            logging.getLogger(name).log(level, "%s", message)
        return record

    async def _follow(
        self, prepared: PreparedRollout, generator: Any, group: asyncio.TaskGroup
    ) -> dict[str, Any] | BaseException:
        """Wait for the task's placement, then its outcome; an exception says why there is none.

        **Cancellation:** the Ray task is killed, then the cancellation propagates.
        """
        rid = prepared.rollout_id
        try:
            first = group.create_task(_next_item(generator))
            if not await self._wait_started(first):
                first.cancel()
                await self._kill(generator)
                return RayTaskOverdueError(
                    f"the rollout task did not start: no task of this run started or ended for "
                    f"{self._stall_s:.0f} s (does any node have {self._config.num_cpus_per_rollout} CPUs?)"
                )
            placement = first.result()
            if isinstance(placement, BaseException):
                return _lost_reason(placement)
            assert isinstance(placement, dict)
            self._placements[rid] = where = RolloutPlacement(**placement)
            placed, self._placed = self._placed, asyncio.Event()
            placed.set()
            self._last_progress = time.monotonic()
            try:
                second = group.create_task(_next_item(generator))
                bound = self._finish_bound(prepared)
                done, _ = await asyncio.wait({second}, timeout=bound)
                if not done:
                    second.cancel()
                    await self._kill(generator)
                    return RayTaskOverdueError(
                        f"the rollout task on {where.hostname} (pid {where.pid}) did not return within "
                        f"{bound:.0f} s of its start; it was killed"
                    )
                outcome = second.result()
                if isinstance(outcome, BaseException):
                    return _lost_reason(outcome)
                assert isinstance(outcome, dict)
                return outcome
            finally:
                self._placements.pop(rid, None)
                self._last_progress = time.monotonic()
        except asyncio.CancelledError:
            await asyncio.shield(self._kill(generator))
            raise

    async def _wait_started(self, first: asyncio.Task[object]) -> bool:
        """Wait until the task starts; False once the whole run has stalled (see ``_stall_s``).

        **Cancellation:** the wait is abandoned; ``first`` is left to its group.
        """
        while True:
            remaining = self._last_progress + self._stall_s - time.monotonic()
            if remaining <= 0:
                return False
            done, _ = await asyncio.wait({first}, timeout=remaining)
            if done:
                return True

    def _finish_bound(self, prepared: PreparedRollout) -> float:
        bound = self._settings.deadline_s + self._settings.grace_s + _FINISH_SLACK_S
        grader = prepared.grading.grader if prepared.grading is not None else None
        if grader is not None and grader.type == "verify":
            bound += float(grader.timeout_s)
        return bound

    async def _kill(self, generator: Any) -> None:
        """Kill the task's worker process (the sandbox dies with it); never raises.

        **Cancellation:** the cancel request, once on its thread, is still sent.
        """
        with contextlib.suppress(Exception):
            await asyncio.to_thread(ray.cancel, generator, force=True)

    async def _relay_stop(self, stop: asyncio.Event) -> None:
        """Once ``stop`` is set, set the run's stop flag (once for all rollouts); never raises.

        **Cancellation:** ends the wait; a flag being set is abandoned.
        """
        await stop.wait()
        if self._stop_sent or self._flag is None:
            return
        self._stop_sent = True
        try:
            async with asyncio.timeout(_RPC_TIMEOUT_S):
                await self._flag.set.remote()
        except (RayError, TimeoutError) as exc:
            logger.warning("could not tell the Ray tasks to stop (%s); they run to their deadlines", exc)

    def _lay_out_if_missing(self, prepared: PreparedRollout) -> None:
        # As when the local supervisor raises: the directory holds what was attempted
        # (input.json, an empty workspace), so the record's rollout_dir exists.
        directory = Path(prepared.rollout_dir)
        if directory.exists():
            return
        try:
            _lay_out(directory, prepared.worker_input, self._settings.input_mode)
        except (OSError, RollcageError) as exc:
            logger.warning("cannot lay out %s for a lost rollout: %s", directory, exc)

    def _record_lost(self, prepared: PreparedRollout, reason: BaseException, started: float) -> RolloutRecord:
        self._lay_out_if_missing(prepared)
        return lost_record(prepared, self._settings, reason, started)

    def _land(self, prepared: PreparedRollout, outcome: dict[str, Any], started: float) -> RolloutRecord:
        """Unpack the shipped directory under --out and parse the record (blocking)."""
        try:
            record = RolloutRecord.model_validate_json(outcome["record"])
        except (KeyError, ValidationError) as exc:
            return self._record_lost(
                prepared, RayTaskLostError(f"the task's record is malformed: {exc}"), started
            )
        archive = outcome.get("archive")
        if archive is not None:
            try:
                unpack_rollout_dir(archive, Path(prepared.rollout_dir))
            except (OSError, tarfile.TarError) as exc:
                reason = RayTaskLostError(
                    f"cannot unpack the rollout's artifacts into {prepared.rollout_dir}: {exc}"
                )
                return self._record_lost(prepared, reason, started)
        elif self._config.shared_dir is None:
            self._lay_out_if_missing(prepared)  # nothing shipped: the record says why
        return record


def _unwrap(exc: BaseException) -> BaseException:
    """The first leaf of an exception group (what a task group wraps a failure in)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _lost_reason(exc: BaseException) -> BaseException:
    """Why a task produced no record, in a line (a ``RayTaskError`` carries a whole traceback)."""
    if isinstance(exc, StopAsyncIteration):
        return RayTaskLostError("the rollout task ended without a result")
    if isinstance(exc, RayTaskError):
        cause = _unwrap(exc.cause) if isinstance(exc.cause, BaseException) else exc
        first_line = (str(cause).strip().splitlines() or [""])[0]
        return RayTaskLostError(f"the rollout task failed on its node: {type(cause).__name__}: {first_line}")
    return exc
