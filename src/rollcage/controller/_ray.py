"""The Ray backend: each rollout is a Ray task that supervises and grades it on a node.

One attempt, end to end::

    driver (RayBackend.run)                     node (a Ray worker process)
    ───────────────────────                     ───────────────────────────
    issue a one-time ticket for the attempt's
      secrets (API key, verify token)
    submit _rollout_task ─────────────────────► yield its placement (node, pid)
      PreparedRollout without its secrets,
      settings, the ticket
    _SecretServer (TCP, on the driver) ◄──────► present the ticket, receive the secrets (memory only)
                                                lay out the rollout directory: a private
                                                  scratch directory, or in place (shared_dir)
                                                run_rollout: supervisor, sandbox and egress
    on stop: set the _StopFlag actor ◄────────►   proxy here, the key handed to the supervisor
                                                  in memory; the task long-polls the flag and
                                                  stops the supervisor when it is set; grading
                                                  here, outside the sandbox
    unpack under --out/rollouts/<id>/ ◄──────── yield the record and the packed directory
    return the record; the Controller             (tar.gz, size-bounded; none with shared_dir)
    appends it, as with the local backend

**Lost tasks.** A task lost to a dead worker process or node (any ``ray.exceptions.RayError``),
or one overdue, becomes an ``infra_failure`` record whose receipt says why and where, and the
controller retries it like any other; Ray itself never retries (``max_retries=0``), so no
attempt runs twice behind the controller's back.

**Secrets never reach a disk.** Whatever Ray is handed may be written down by Ray: a
``runtime_env`` is logged whole by every node's runtime-env agent and kept in the GCS, the
dashboard and the task events; task arguments are kept in the owner's lineage and, past
100 KiB, put in the object store, which spills to disk under memory pressure. So nothing
secret is handed to Ray. The driver serves each attempt's secrets (the model API key named by
``--api-key-env``, an environment's verify token) from ``_SecretServer``, a small TCP server
in the driver process on the address Ray registered for the driver's node (every node
already reaches the driver there; that is how Ray's own workers reach their owner). The task
gets only a *ticket*: 32 random bytes, valid for that one attempt, redeemable once, and
forgotten by the server when the attempt ends, so a ticket that Ray does write down is worth
nothing by the time anyone reads it. The task redeems it before anything else, keeps the
secrets in memory and hands the key to its supervisor as a mapping (``supervise(...,
credentials=...)``), never through an environment variable that child processes would
inherit; the egress proxy adds it upstream, the sandbox never sees it. On the wire the
channel is as private as Ray's own RPCs (plain TCP, like Ray without TLS): it keeps secrets
off disks, not off a network a hostile party can read. A key unset on the driver is not
served: each node's supervisor then reads it from that node's own environment (set it
before ``ray start``).

**Connecting.** ``ray.init`` against an address where no Ray answers, or one whose cluster
rejects this driver's token, retries for minutes and ends with "Failed to connect". Before
it, ``_probe_cluster`` opens a TCP connection and does one GCS handshake, both bounded by
``_CONNECT_TIMEOUT_S``, and fails with what was tried: nothing listening, no Ray answering,
or Ray's authentication refusal with how to give the driver the cluster's token
(``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN`` / ``RAY_AUTH_TOKEN_PATH`` /
``~/.ray/auth_token``, as Ray documents).

**Node scratch.** Without a shared directory a task works in a private scratch directory
under the node's ``$TMPDIR/rollcage-ray/`` named for its process, and removes it when it
ends. A task whose process was killed (with its node's raylet, by ``ray.cancel``, with its
driver) leaves its directory behind; the scratch of dead processes is swept by every task
that starts on the node (so a resumed run cleans what its killed predecessor left wherever
it runs a task), and at the end of a run by a sweep task on each node that lost one of its
tasks or ran none that swept it (a resumed run with nothing left to do sweeps every node). No
sweep task runs at the start: next to the run's first rollouts it would start a Ray worker
process of its own on each node (it needs no CPU slot, so it takes no idle one), ~1 s of
CPU each.

**Task images.** An image row's attempt carries the image's reference (``node_image``), not a
root: before the rollout is laid out, the node prepares the image in its own store
(``--ray-image-store``, else the node's ``$ROLLCAGE_IMAGE_STORE``, else ``rollcage-images`` under
its Ray temp dir), leases it for the attempt and checks the programs the tools run there
(``rollcage.controller._node_images``). Concurrent attempts on a node pull an image once (the
store's locks); an image that cannot be used there is the attempt's ``infra_failure``, naming it.
The rollout, its ``workspace.diff`` and the tests grader then run on the node as locally.

Ray is imported at the top of this module, which only ``RayBackendConfig.build``
imports: the local backend never loads Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import ipaddress
import json
import logging
import os
import queue
import re
import secrets
import shutil
import signal
import socket
import stat
import tarfile
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any, Literal, Self

import ray
from pydantic import ValidationError
from ray.exceptions import RayError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rollcage import __version__
from rollcage.controller._unit import (
    PreparedRollout,
    RolloutSettings,
    SuperviseFn,
    build_supervisor_config,
    lay_out,
    record_without_result,
    run_rollout,
)
from rollcage.errors import (
    ArtifactsTooLargeError,
    ConfigError,
    RayTaskLostError,
    RayTaskOverdueError,
    RollcageError,
)
from rollcage.procs import pid_exists, read_proc, shielded
from rollcage.protocol import RolloutRecord

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
_STOP_SET_TIMEOUT_S = 3.0
"""Bound on setting the stop flag once the run is stopped: past it (or if the flag is gone) the
driver kills the run's tasks instead, so a stop never waits for the rollouts' deadlines."""
_STOP_FLAG_CONCURRENCY = 10_000
"""Long-polls the stop flag serves at once: one per rollout in flight, plus stragglers."""
_MAX_FORWARDED_LOGS = 50
"""Warnings of one rollout's node-side run forwarded to the driver's log."""
_CONNECT_TIMEOUT_S = 20.0
"""Bound on each step of ``_probe_cluster``: the TCP connection, then the GCS handshake."""
_SECRET_TIMEOUT_S = 30.0
"""Bound on one redemption of a ticket, on either side of the connection."""
_SECRET_MESSAGE_LIMIT = 64 * 1024
"""Longest line either side of the secret channel reads."""
_SECRET_CONNECTIONS = 1024
"""Connections the secret channel serves at once; more are closed unanswered (retried as lost tasks)."""
_SWEEP_TIMEOUT_S = 60.0
"""Bound on sweeping the nodes' scratch at the end of a run."""
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

    Built like ``run_rollout``'s record when the supervisor raises
    (``record_without_result``, whose receipt names ``reason``): no grading, no result.

    Args:
        prepared: The attempt.
        settings: Its settings (the receipt repeats the deadline and sandbox).
        reason: Why there is no record (a Ray error, an overdue task, unshippable artifacts).
        started: Unix time the attempt was submitted.
    """
    logger.warning("rollout %s: infrastructure failure in the Ray backend: %s", prepared.rollout_id, reason)
    return record_without_result(prepared, settings, reason, started, where="the controller")


# ---------------------------------------------------------------------------- secrets


def _digest(ticket: str) -> bytes:
    return hashlib.sha256(ticket.encode()).digest()


class _SecretServer:
    """Hands each attempt's secrets to its Ray task, once, over TCP (driver side).

    A ticket is 32 random bytes issued for one attempt. The server keeps only the
    ticket's SHA-256 and the secrets in memory, answers the first connection that
    presents the ticket, and forgets it then, or when the attempt ends unredeemed
    (``revoke``). Each connection carries one request line and one answer line,
    both bounded in size and time.

    Lifecycle: ``start`` then ``close``; ``issue`` and ``revoke`` in between.
    """

    def __init__(self) -> None:
        self._pending: dict[bytes, dict[str, str]] = {}
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[Any]] = set()
        self.address: tuple[str, int] = ("", 0)

    async def start(self, host: str) -> None:
        """Listen on ``host`` (an ephemeral port; see ``address``).

        Raises:
            OSError: ``host`` cannot be bound.

        **Cancellation:** nothing is left listening.
        """
        self._server = await asyncio.start_server(self._serve, host, 0, limit=_SECRET_MESSAGE_LIMIT)
        bound = self._server.sockets[0].getsockname()
        self.address = (str(bound[0]), int(bound[1]))

    def issue(self, values: Mapping[str, str]) -> str:
        """A new one-time ticket for ``values``."""
        ticket = secrets.token_urlsafe(32)
        self._pending[_digest(ticket)] = dict(values)
        return ticket

    def revoke(self, ticket: str) -> None:
        """Forget ``ticket`` whether or not it was redeemed."""
        self._pending.pop(_digest(ticket), None)

    async def close(self) -> None:
        """Stop listening, end every open connection and forget every ticket.

        **Cancellation:** the connections are cancelled all the same.
        """
        self._pending.clear()
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for handler in list(self._handlers):
            handler.cancel()
        if self._handlers:
            await asyncio.gather(*self._handlers, return_exceptions=True)
        if server is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_SECRET_TIMEOUT_S):
                    await server.wait_closed()

    def _answer(self, line: bytes) -> dict[str, Any]:
        try:
            request = json.loads(line)
            ticket = request["ticket"]
            if not isinstance(ticket, str):
                raise TypeError("ticket")
        except (ValueError, KeyError, TypeError):
            return {"error": "the request is not a ticket"}
        values = self._pending.pop(_digest(ticket), None)
        if values is None:
            return {"error": "the ticket is unknown, already redeemed, or its attempt has ended"}
        return {"secrets": values}

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        peer = writer.get_extra_info("peername")
        try:
            if len(self._handlers) > _SECRET_CONNECTIONS:
                # Someone holding connections open (each waits up to _SECRET_TIMEOUT_S) must
                # not exhaust the driver's file descriptors.
                return
            async with asyncio.timeout(_SECRET_TIMEOUT_S):
                answer = self._answer(await reader.readuntil(b"\n"))
                if "error" in answer:
                    # Never the ticket itself: a refused one may be a replay, worth a line in the log.
                    logger.warning("secret channel: refused a request from %s: %s", peer, answer["error"])
                writer.write(json.dumps(answer).encode() + b"\n")
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass  # a peer that does not finish its request gets nothing
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1):
                    await writer.wait_closed()
            if task is not None:
                self._handlers.discard(task)


def _redeem(channel: tuple[str, int, str]) -> dict[str, str]:
    """Fetch this attempt's secrets from the driver's ``_SecretServer`` (node side, blocking).

    Raises:
        RayTaskLostError: The driver cannot be reached or refuses the ticket.
    """
    host, port, ticket = channel
    where = f"{host}:{port}"
    deadline = time.monotonic() + _SECRET_TIMEOUT_S
    data = b""
    try:
        with socket.create_connection((host, port), timeout=_SECRET_TIMEOUT_S) as conn:
            conn.sendall(json.dumps({"ticket": ticket}).encode() + b"\n")
            while not data.endswith(b"\n") and len(data) <= _SECRET_MESSAGE_LIMIT:
                conn.settimeout(max(deadline - time.monotonic(), 0.001))
                chunk = conn.recv(4096)
                if not chunk:
                    break
                data += chunk
    except OSError as exc:
        raise RayTaskLostError(
            f"cannot fetch this attempt's credentials from the driver at {where}: "
            f"{exc or type(exc).__name__} (every node must reach the driver's address on that port)"
        ) from exc
    try:
        answer = json.loads(data)
        if "secrets" in answer:
            values = answer["secrets"]
            if isinstance(values, dict) and all(isinstance(v, str) for v in values.values()):
                return values
        reason = str(answer.get("error", "a malformed answer"))
    except (ValueError, AttributeError):
        reason = "a malformed answer" if data else "no answer"
    raise RayTaskLostError(f"the driver at {where} did not hand over this attempt's credentials: {reason}")


# ---------------------------------------------------------------------------- connecting


_DEFAULT_TOKEN_PATH = Path("~/.ray/auth_token")


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _is_auth_refusal(exc: BaseException) -> bool:
    auth_error: Any = getattr(ray.exceptions, "AuthenticationError", ())
    return isinstance(exc, auth_error) or any(
        word in str(exc) for word in ("InvalidAuthToken", "Unauthenticated", "UNAUTHENTICATED")
    )


def _token_source() -> str:
    """Where Ray would read this driver's token from (never the token itself)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN"
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return f"RAY_AUTH_TOKEN_PATH ({os.environ['RAY_AUTH_TOKEN_PATH']})"
    if _DEFAULT_TOKEN_PATH.expanduser().is_file():
        return str(_DEFAULT_TOKEN_PATH)
    return "none found"


def _readable_token(path: Path) -> bool:
    try:
        return bool(path.expanduser().read_text(encoding="utf-8", errors="replace").strip())
    except OSError:
        return False


def _check_token(address: str, source: str) -> None:
    """With ``RAY_AUTH_MODE=token``, refuse to connect without a token Ray can read.

    Ray aborts the whole process in its C++ client (a stack trace, exit 1) when token mode is on
    and it finds no token; this says so in a line first. Ray reads ``RAY_AUTH_TOKEN``, else the
    file ``RAY_AUTH_TOKEN_PATH`` names, else ``~/.ray/auth_token``.

    Raises:
        ConfigError: Token mode is on and no token is readable where Ray looks.
    """
    if os.environ.get("RAY_AUTH_MODE", "").strip().lower() != "token" or os.environ.get("RAY_AUTH_TOKEN"):
        return
    named = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if named:
        if _readable_token(Path(named)):
            return
        where = f"RAY_AUTH_TOKEN_PATH names {named}, which is missing, unreadable or empty"
    elif _readable_token(_DEFAULT_TOKEN_PATH):
        return
    else:
        where = (
            f"RAY_AUTH_TOKEN and RAY_AUTH_TOKEN_PATH are unset and {_DEFAULT_TOKEN_PATH} is missing or empty"
        )
    raise ConfigError(
        f"cannot connect to the Ray cluster at {address} ({source}): RAY_AUTH_MODE=token but no token to "
        f"send ({where}); give this driver the cluster's token in RAY_AUTH_TOKEN, in a file named by "
        f"RAY_AUTH_TOKEN_PATH or in {_DEFAULT_TOKEN_PATH} (`ray get-auth-token` on the head prints it)"
    )


def _auth_refused(address: str, source: str, exc: BaseException) -> ConfigError:
    mode = os.environ.get("RAY_AUTH_MODE")
    said = _first_line(exc).split(". ")[0]
    found = _token_source()
    if (mode or "").lower() == "token":
        tried = f"RAY_AUTH_MODE=token and the token from {found}"
        fix = "the cluster does not accept that token: give this driver the cluster's token"
    else:
        tried = f"RAY_AUTH_MODE={mode or 'unset'}, which sends no token"
        fix = (
            "the cluster uses token authentication: set RAY_AUTH_MODE=token (Ray reads a token for an "
            "explicit address only then) and give this driver the cluster's token"
        )
    return ConfigError(
        f"the Ray cluster at {address} ({source}) refused this driver's authentication ({said}). "
        f"Tried: a TCP connection (accepted), then a GCS handshake with {tried}. "
        f"Fix: {fix} in RAY_AUTH_TOKEN, in a file named by RAY_AUTH_TOKEN_PATH, or in {_DEFAULT_TOKEN_PATH} "
        "(`ray get-auth-token` on the head prints it), as Ray's token authentication guide says"
    )


def _probe_cluster(address: str, source: str) -> None:
    """Fail fast, naming the cause, where ``ray.init(address)`` would retry for minutes (blocking).

    Two steps, each bounded by ``_CONNECT_TIMEOUT_S``: a TCP connection to the address,
    then one handshake with the GCS there (Ray's own client, with this process's
    authentication settings, as ``ray.init`` would use them). An address that is not
    ``HOST:PORT`` is left to Ray.

    Raises:
        ConfigError: Nothing accepts connections there, no GCS answers, or the cluster
            refuses this driver's authentication.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return
    prefix = f"cannot connect to the Ray cluster at {address} ({source})"
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=_CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        raise ConfigError(
            f"{prefix}: a TCP connection there failed ({exc or type(exc).__name__}; tried for up to "
            f"{_CONNECT_TIMEOUT_S:.0f} s); is the head running (`ray status` there), and is this its GCS "
            "port (`ray start --head --port`, default 6379)?"
        ) from exc
    client = getattr(_ray._raylet, "GcsClient", None)
    if client is None:  # a Ray without it: ray.init will say what it says
        return
    outcome: list[BaseException | None] = []

    def handshake() -> None:
        try:
            client(address=address)
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    # A daemon thread: a GCS that never answers keeps it, not this process, waiting.
    thread = threading.Thread(target=handshake, name="rollcage-ray-probe", daemon=True)
    thread.start()
    thread.join(_CONNECT_TIMEOUT_S)
    if not outcome:
        raise ConfigError(
            f"{prefix}: it accepts TCP connections but no Ray GCS answered within {_CONNECT_TIMEOUT_S:.0f} s "
            "(is this the head's GCS port, `ray start --head --port`?)"
        )
    error = outcome[0]
    if error is None:
        return
    if _is_auth_refusal(error):
        raise _auth_refused(address, source, error) from error
    raise ConfigError(f"{prefix}: the GCS handshake failed: {_first_line(error)}") from error


# ---------------------------------------------------------------------------- node side


def _stop_flag_class() -> type:
    """The class of a run's stop flag actor, made in a function so that Ray ships it by value.

    An actor runs in a Ray worker process of its own, started for each run, which loads its
    class as Ray pickled it. A class of this module would be pickled by reference, and that
    process would import this module: rollcage's controller, supervisor and protocol models,
    ~0.5 s of CPU, for an object that holds one event. One made here is pickled whole (by
    cloudpickle, with the standard modules it names), so the process imports only those. Its
    process is still titled ``ray::_StopFlag``.
    """

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

    return _StopFlag


_StopFlagActor: Any = ray.remote(_stop_flag_class())


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


def _supervise_with(credentials: Mapping[str, str]) -> SuperviseFn:
    """The supervisor's entry point, reading credentials from ``credentials``, not the environment."""
    from rollcage.supervisor import Supervised, supervise_rollout

    async def supervise_here(
        rollout_dir: Path, config: Any, *, stop: asyncio.Event | None = None
    ) -> Supervised:
        return await supervise_rollout(rollout_dir, config, stop=stop, credentials=credentials)

    return supervise_here


class _Runner:
    """A daemon thread of this Ray worker process that runs rollouts, one at a time (:data:`_runners`)."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], threading.Event]] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def run(self, job: Callable[[], None]) -> threading.Event:
        """Hand ``job`` to the thread; the event is set once it has returned."""
        done = threading.Event()
        self._jobs.put((job, done))
        return done

    def _serve(self) -> None:
        while True:
            job, done = self._jobs.get()
            try:
                job()  # never raises: a rollout's errors are kept for the task that waits
            finally:
                done.set()
                _runners.put_back(self)


class _Runners:
    """The threads rollouts run on in this Ray worker process, kept between rollouts.

    A rollout's thread starts its processes, and ``--sandbox none``'s warm template is its
    starting thread's (the uncaged worker's parent-death signal is that thread's, see
    :mod:`rollcage.supervisor.warm`): a thread per rollout started a template per rollout.
    A thread is taken again once its rollout has ended, as the local backend's threads
    are; one still running an overdue rollout is not, and a new one is started beside it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[_Runner] = []
        self._started = 0

    def take(self) -> _Runner:
        """An idle thread, or a new one."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
            self._started += 1
            name = f"rollcage-rollouts-{self._started}"
        return _Runner(name)

    def put_back(self, runner: _Runner) -> None:
        """Called by ``runner``'s thread when its rollout has ended."""
        with self._lock:
            self._idle.append(runner)


_runners = _Runners()


class _RolloutThread:
    """``run_rollout`` on a thread and event loop of its own, inside a Ray task (:class:`_Runners`)."""

    def __init__(
        self,
        prepared: PreparedRollout,
        settings: RolloutSettings,
        flag: Any,
        credentials: Mapping[str, str] | None,
    ) -> None:
        self._prepared = prepared
        self._settings = settings
        self._flag = flag
        self._credentials = credentials
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
        done = _runners.take().run(self._main)
        # Longer than the driver's bound on the same task, so a live driver kills this
        # process (and the rollout with it) first; this one guards a driverless task.
        bound = self._settings.deadline_s + self._settings.grace_s + 2 * _FINISH_SLACK_S
        if self._prepared.grading is not None and self._prepared.grading.grader.type == "verify":
            bound += float(self._prepared.grading.grader.timeout_s)
        try:
            done.wait(bound)
        except BaseException:
            self._request_stop()
            done.wait(self._settings.grace_s + _FINISH_SLACK_S)
            raise
        if not done.is_set():
            self._request_stop()
            raise RayTaskOverdueError(f"the rollout did not end within {bound:.0f} s of its start")
        if self._error is not None:
            raise self._error
        assert self._record is not None
        # The driver gets the record and the rollout directory; the parsed result stays here.
        return self._record.with_result(None)

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
        supervise: SuperviseFn | None = None
        config: Any = None
        if self._credentials is not None:
            supervise, config = _supervise_with(self._credentials), build_supervisor_config(self._settings)
        async with asyncio.TaskGroup() as group:
            watcher = group.create_task(_watch_stop(self._flag, stop))
            try:
                return await run_rollout(
                    self._prepared, self._settings, stop=stop, supervise=supervise, supervisor_config=config
                )
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


def _process_start(pid: int) -> str:
    """When process ``pid`` started (clock ticks since boot, from /proc), "" if it is gone or a
    zombie, "?" where /proc cannot tell.

    With the pid, it names a process for good: a pid reused by a later process has
    another start time.
    """
    info = read_proc(pid)
    if info is None:
        return "" if os.path.exists("/proc/self/stat") else "?"  # gone, or no /proc here
    return str(info.starttime) if info.alive else ""


def _owner_alive(pid: int, start: str) -> bool:
    now = _process_start(pid)
    return pid_exists(pid) if now == "?" else bool(now) and now == start


def _scratch_root() -> Path:
    root = Path(tempfile.gettempdir()) / _SCRATCH_NAME
    root.mkdir(mode=0o700, exist_ok=True)
    return root


def _sweep_scratch(root: Path) -> int:
    """Remove the scratch directories under ``root`` whose process is gone; returns how many.

    A directory is named ``PID.START@HOST.RANDOM`` for the worker process that made it. A
    worker runs one task at a time and its task removes its directory when it ends, so
    one named for a process that is gone (killed with its task, its node's raylet or its
    driver) is garbage, and so is one named for this process, which runs no task now.
    Directories of other hosts (a shared ``$TMPDIR``) and of live processes are kept.
    """
    host = socket.gethostname()
    me = (os.getpid(), _process_start(os.getpid()))
    removed = 0
    with os.scandir(root) as entries:
        for entry in entries:
            owner, at, rest = entry.name.partition("@")
            pid_text, _, start = owner.partition(".")
            if not at or not pid_text.isdigit() or rest.rpartition(".")[0] != host:
                continue
            pid = int(pid_text)
            if (pid, start) == me or not _owner_alive(pid, start):
                _release_rollouts(Path(entry.path))
                shutil.rmtree(entry.path, ignore_errors=True)
                removed += 1
    return removed


def _release_rollouts(scratch: Path) -> None:
    """What a killed supervisor left for the rollouts in ``scratch``: its processes, mounts and cgroups."""
    from rollcage.supervisor import kill_leftovers

    with contextlib.suppress(OSError):
        for rollout in scratch.iterdir():
            kill_leftovers(rollout)


def _scratch_dir() -> Path:
    """A fresh private directory for one rollout on this node; sweeps ones left by dead workers."""
    root = _scratch_root()
    _sweep_scratch(root)
    pid = os.getpid()
    return Path(tempfile.mkdtemp(prefix=f"{pid}.{_process_start(pid)}@{socket.gethostname()}.", dir=root))


def _sweep_task() -> int:
    """The Ray task that sweeps one node's scratch (see ``_sweep_scratch``)."""
    return _sweep_scratch(_scratch_root())


_sweep_remote: Any = ray.remote(_sweep_task)


def _unshippable(exc: BaseException, record: RolloutRecord) -> ArtifactsTooLargeError:
    reward = f", reward {record.reward}" if record.graded else ""
    return ArtifactsTooLargeError(
        f"{exc} (the rollout itself ended {record.outcome}{reward}); nothing was shipped: raise "
        "--ray-max-artifact-mib or run with --shared-dir"
    )


def _with_secrets(
    prepared: PreparedRollout, settings: RolloutSettings, values: Mapping[str, str]
) -> tuple[PreparedRollout, dict[str, str] | None]:
    """Put the redeemed secrets back: the environment's token into its plan, the key aside."""
    token = values.get("verify_token")
    if token is not None and prepared.environment is not None:
        environment = prepared.environment.model_copy(update={"token": token})
        prepared = prepared.model_copy(update={"environment": environment})
    key = values.get("api_key")
    credentials = {settings.api_key_env: key} if key is not None and settings.api_key_env else None
    return prepared, credentials


def _run_on_node(
    prepared: PreparedRollout,
    settings: RolloutSettings,
    node_dir: str | None,
    limit: int,
    flag: Any,
    credentials: Mapping[str, str] | None,
    image_store: str | None = None,
) -> dict[str, Any]:
    started = time.time()
    scratch = _scratch_dir() if node_dir is None else None
    local_dir = scratch / prepared.rollout_id if scratch is not None else Path(str(node_dir))
    try:
        with contextlib.ExitStack() as held:
            try:
                here = _with_node_image(prepared, image_store, held)
            except RollcageError as exc:
                # The attempt never started: its record says why (the registry down, an unusable
                # image), as a lost task's does; the driver lays out what was attempted.
                logger.warning(
                    "rollout %s: its image on node %s: %s", prepared.rollout_id, socket.gethostname(), exc
                )
                record = lost_record(prepared, settings, exc, started)
                return {"record": record.model_dump_json(), "archive": None}
            here = here.model_copy(update={"rollout_dir": str(local_dir)})
            record = _RolloutThread(here, settings, flag, credentials).run()
        record = record.model_copy(update={"rollout_dir": prepared.rollout_dir})
        archive: bytes | None = None
        # An attempt that failed before its directory was made (its environment unreachable from
        # here, say) ships nothing: its record says why, and the driver lays out what was attempted.
        if scratch is not None and local_dir.is_dir():
            try:
                archive = pack_rollout_dir(local_dir, limit=limit)
            except ArtifactsTooLargeError as exc:
                record = lost_record(prepared, settings, _unshippable(exc, record), started)
            except (OSError, tarfile.TarError) as exc:
                reason = RayTaskLostError(
                    f"cannot pack the rollout directory on {socket.gethostname()}: {exc} (the rollout "
                    f"itself ended {record.outcome}); nothing was shipped"
                )
                record = lost_record(prepared, settings, reason, started)
        return {"record": record.model_dump_json(), "archive": archive}
    finally:
        if scratch is not None:
            # A task given up on (its driver gone) may leave a supervisor behind: its processes, mounts
            # and cgroups go first, or the mounted workspace would keep the directory.
            _release_rollouts(scratch)
            shutil.rmtree(scratch, ignore_errors=True)


def _with_node_image(
    prepared: PreparedRollout, image_store: str | None, held: contextlib.ExitStack
) -> PreparedRollout:
    """The attempt with its task image prepared in this node's store and leased until ``held`` closes.

    Raises:
        RollcageError: The image cannot be prepared here, or lacks a program the attempt runs.
    """
    if prepared.node_image is None:
        return prepared
    from rollcage.controller._node_images import node_image, node_image_store

    store = node_image_store(Path(image_store) if image_store is not None else None)
    worker_input = prepared.worker_input
    harness = worker_input.agent.harness
    sandbox = held.enter_context(
        node_image(
            prepared.node_image,
            store,
            mode=worker_input.agent.mode,
            tools=worker_input.tools,
            builtin=harness is None or harness.type == "builtin",
        )
    )
    update = {"worker_input": worker_input.model_copy(update={"image": sandbox}), "node_image": None}
    return prepared.model_copy(update=update)


def _rollout_task(
    prepared: PreparedRollout,
    settings: RolloutSettings,
    node_dir: str | None,
    max_artifact_bytes: int,
    flag: Any,
    channel: tuple[str, int, str] | None,
    driver_version: str,
    image_store: str | None = None,
) -> Iterator[dict[str, Any]]:
    """The Ray task of one attempt: yields its placement, then its outcome.

    Args:
        prepared: The attempt (its ``rollout_dir`` is the driver's path) without its
            secrets. Pickled by Ray, not sent as JSON: its grading plan holds typed grader
            specs.
        settings: The supervision and grading settings.
        node_dir: Where to lay out the rollout directory in place (shared file system);
            ``None``: a private scratch directory, packed and shipped back.
        max_artifact_bytes: Limit on what is shipped back.
        flag: The run's ``_StopFlag`` actor.
        channel: ``(host, port, ticket)`` of the driver's ``_SecretServer`` holding this
            attempt's secrets; ``None``: it has none.
        driver_version: The driver's rollcage version; a different one here is refused.
        image_store: The image store on every node (``--ray-image-store``); ``None``: each node's
            own default (``rollcage.controller._node_images.node_image_store``).

    Yields:
        ``{node_id, node_ip, hostname, pid}``, then ``{record, archive, logs}``: the record
        as JSON (``rollout_dir`` the driver's path), the packed directory or ``None``, and
        the node's warnings.
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
    credentials: dict[str, str] | None = None
    if channel is not None:
        prepared, credentials = _with_secrets(prepared, settings, _redeem(channel))
    buffer = _LogBuffer()
    source = logging.getLogger("rollcage")
    source.addHandler(buffer)
    try:
        outcome = _run_on_node(
            prepared, settings, node_dir, max_artifact_bytes, flag, credentials, image_store
        )
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
    local instance), creates the run's stop flag and opens its secret channel; leaving
    sweeps the scratch of the nodes that need it, closes the channel and disconnects
    (stopping an instance it started). At most one Ray task per ``run`` call is in flight, so the
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
        self._stop_unrelayed = asyncio.Event()
        """Set when the run's stop could not be relayed through the stop flag: tasks are killed instead."""
        self._api_key: str | None = None
        self._driver_node = ""
        self._driver_ip = ""
        self._secrets = _SecretServer()
        self._dirty_nodes: set[str] = set()
        self._swept_nodes: set[str] = set()
        """Nodes where a task of this run made its scratch directory, sweeping the node's scratch."""
        self._placements: dict[str, RolloutPlacement] = {}
        self._placed = asyncio.Event()  # replaced, after being set, at every new placement
        self._last_progress = time.monotonic()
        self._nodes = 0
        self._warned: set[str] = set()
        self._ran_on: dict[str, RolloutPlacement] = {}
        self._unreached: dict[str, _Unreached] = {}
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
        """Connect to the cluster, check the settings, create the run's stop flag, open its
        secret channel.

        Raises:
            ConfigError: The cluster cannot be reached or refuses this driver (the message
                says what was tried), the shared directory is missing, the supervisor
                refuses the settings, or the secret channel cannot listen.

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
        try:
            # A connection being made completes (on its thread) before a cancellation propagates.
            await shielded(asyncio.to_thread(self._connect))
            await self._secrets.start(self._driver_ip)
        except OSError as exc:
            await shielded(self._release())
            raise ConfigError(
                f"cannot serve this run's credentials to the nodes on {self._driver_ip}, the driver's "
                f"address in the Ray cluster: {exc}"
            ) from exc
        except asyncio.CancelledError:
            await shielded(self._release())
            raise
        # What a killed predecessor (a resumed run) left on a node is swept by this run's first
        # task there, or at the end (see the module docstring): not by a task now.
        self._state = "opened"
        self._last_progress = time.monotonic()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Sweep the scratch of the nodes that lost a task or that no task of this run swept,
        stop serving secrets, remove the stop flag, and stop the local instance if this
        backend started it.

        **Cancellation:** no sweep (the next run sweeps); the rest is shielded and runs to its
        end, then the cancellation propagates.
        """
        self._state = "closed"
        self._report_unreached()
        try:
            if not isinstance(exc, asyncio.CancelledError):
                await self._sweep(skip=self._swept_nodes - self._dirty_nodes)
        finally:
            await shielded(self._release())

    async def _release(self) -> None:
        await self._secrets.close()
        await asyncio.to_thread(self._disconnect)

    async def _sweep(self, *, skip: set[str]) -> None:
        """Sweep the scratch of dead processes on every live node but those of ``skip``.

        Bounded by ``_SWEEP_TIMEOUT_S``; a node that cannot be swept is logged, never raised.

        **Cancellation:** the sweep tasks are cancelled on their nodes.
        """
        try:
            nodes = await asyncio.to_thread(_ray.nodes)
        except Exception as exc:  # Ray's errors for a cluster going away vary
            logger.warning("cannot list the Ray nodes to sweep their scratch: %s", exc)
            return
        alive = sorted(n["NodeID"] for n in nodes if n.get("Alive") and n["NodeID"] not in skip)
        refs = [
            _sweep_remote.options(
                num_cpus=0,
                max_retries=0,
                name="rollcage:sweep",
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote()
            for node_id in alive
        ]
        try:
            async with asyncio.timeout(_SWEEP_TIMEOUT_S):
                results = await asyncio.gather(*refs, return_exceptions=True)
        except (TimeoutError, asyncio.CancelledError) as exc:
            for ref in refs:
                with contextlib.suppress(Exception):
                    ray.cancel(ref, force=True)  # only sends the request: never blocks
            if isinstance(exc, asyncio.CancelledError):
                raise
            logger.warning(
                "sweeping the Ray nodes' scratch took over %.0f s; left to the next run", _SWEEP_TIMEOUT_S
            )
            return
        for node_id, result in zip(alive, results, strict=True):
            if isinstance(result, BaseException):
                logger.warning("cannot sweep the scratch of Ray node %s: %s", node_id, _first_line(result))
            elif result:
                logger.info(
                    "swept %d scratch directories of dead rollout tasks on Ray node %s", result, node_id
                )

    def _address(self) -> tuple[str, str]:
        """The cluster's address, and where it came from (for messages)."""
        if self._config.address:
            return self._config.address, "--ray-address"
        if os.environ.get("RAY_ADDRESS"):
            return os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
        return "local", "no address given: a private local instance"

    def _connect(self) -> None:
        self._cwd = os.getcwd()
        if not ray.is_initialized():
            address, source = self._address()
            if address != "local":
                _check_token(address, source)
            if address not in ("local", "auto") and "://" not in address:
                _probe_cluster(address, source)
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
                if _is_auth_refusal(exc):
                    raise _auth_refused(address, source, exc) from exc
                raise ConfigError(
                    f"cannot connect to the Ray cluster at {address} ({source}): {exc}"
                ) from exc
            self._owns_ray = True
        try:
            nodes = [node for node in _ray.nodes() if node.get("Alive")]
            self._driver_node = str(ray.get_runtime_context().get_node_id())
            self._driver_ip = next(
                (str(n["NodeManagerAddress"]) for n in nodes if n.get("NodeID") == self._driver_node),
                str(_ray.util.get_node_ip_address()),
            )
            self._nodes = len(nodes)
            largest = max((float(n.get("Resources", {}).get("CPU", 0.0)) for n in nodes), default=0.0)
            if largest < self._config.num_cpus_per_rollout:
                logger.warning(
                    "no node of the Ray cluster has %s CPUs for a rollout (the largest has %s): rollouts "
                    "wait until such a node joins",
                    self._config.num_cpus_per_rollout,
                    largest,
                )
            # With the driver, never on another node that may be lost mid-run (a soft affinity let it
            # move): every task polls it, and the driver's node is lost only with the driver.
            self._flag = _StopFlagActor.options(
                num_cpus=0,
                max_concurrency=_STOP_FLAG_CONCURRENCY,
                scheduling_strategy=NodeAffinitySchedulingStrategy(self._driver_node, soft=False),
            ).remote()
            self._api_key = self._driver_api_key()
        except BaseException:
            self._disconnect()
            raise

    def _driver_api_key(self) -> str | None:
        name = self._settings.api_key_env
        if name is None:
            return None
        value = os.environ.get(name)
        if not value:
            logger.warning(
                "%s is not set here: every node's Ray workers must have it in their environment", name
            )
            return None
        # Served to each task over the secret channel (see the module docstring), never
        # handed to Ray: the supervisor on the node gets it in memory, its egress proxy adds
        # it upstream, and neither input.json nor the sandbox ever holds it.
        return value

    def _secrets_of(self, prepared: PreparedRollout) -> tuple[PreparedRollout, dict[str, str]]:
        """The attempt as shipped to Ray (no secret in it), and the secrets it needs on its node."""
        values: dict[str, str] = {}
        if self._api_key is not None:
            values["api_key"] = self._api_key
        plan = prepared.environment
        if plan is not None and plan.token is not None:
            values["verify_token"] = plan.token
            prepared = prepared.model_copy(update={"environment": plan.model_copy(update={"token": None})})
        return prepared, values

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
        if prepared.environment is not None:
            urls.append(prepared.environment.url)
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
        shipped, values = self._secrets_of(prepared)
        ticket = self._secrets.issue(values) if values else None
        channel = (*self._secrets.address, ticket) if ticket is not None else None
        try:
            generator = _rollout_remote.options(**options).remote(
                shipped,
                self._settings,
                node_dir,
                self._config.max_artifact_bytes,
                self._flag,
                channel,
                __version__,
                None if self._config.image_store is None else str(self._config.image_store),
            )
            async with asyncio.TaskGroup() as group:
                # The relay waits on the run's stop for as long as this attempt lasts, no longer.
                relay = group.create_task(self._relay_stop(stop))
                outcome = await self._follow(prepared, generator, group)
                relay.cancel()
        finally:
            if ticket is not None:
                self._secrets.revoke(ticket)
        where = self._ran_on.pop(prepared.rollout_id, None)
        if isinstance(outcome, BaseException):
            record = await asyncio.to_thread(self._record_lost, prepared, outcome, started)
        else:
            record = await asyncio.to_thread(self._land, prepared, outcome, started)
            for name, level, message in outcome.get("logs", []):
                logging.getLogger(name).log(level, "%s", message)
        self._note_unreached(record, where)
        return record

    def _note_unreached(self, record: RolloutRecord, where: RolloutPlacement | None) -> None:
        """Keep what a node could not reach (the model, an environment, the credentials channel):
        its attempts are retried elsewhere and the run may end well, so the end of the run says it."""
        if where is None or record.outcome != "infra_failure":
            return
        what = _unreached_what(record.receipt.outcome_reason)
        if what is None:
            return
        seen = self._unreached.setdefault(where.node_id, _Unreached(where.hostname, where.node_ip))
        seen.attempts[what] = seen.attempts.get(what, 0) + 1
        seen.example.setdefault(what, record.receipt.outcome_reason)

    def _report_unreached(self) -> None:
        for node_id, seen in sorted(self._unreached.items()):
            for what, count in sorted(seen.attempts.items()):
                logger.error(
                    "Ray node %s (%s, node %s) could not reach %s: %d attempt(s) failed there and were "
                    "retried (first: %s); check that node's network before the next run",
                    seen.hostname,
                    seen.node_ip,
                    node_id[:12],
                    what,
                    count,
                    seen.example[what],
                )

    @property
    def unreached(self) -> Mapping[str, Mapping[str, int]]:
        """What each node could not reach this run, by node id: ``{what: attempts}`` (read-only)."""
        return MappingProxyType({node: dict(seen.attempts) for node, seen in self._unreached.items()})

    async def _follow(
        self, prepared: PreparedRollout, generator: Any, group: asyncio.TaskGroup
    ) -> dict[str, Any] | BaseException:
        """Wait for the task's placement, then its outcome; an exception says why there is none.

        **Cancellation:** the Ray task is killed, then the cancellation propagates.
        """
        rid = prepared.rollout_id
        try:
            first = group.create_task(_next_item(generator))
            started = await self._wait_started(first)
            if started is not True:
                first.cancel()
                await self._kill(generator)
                if started == "stopped":
                    return _killed_on_stop(None)
                return RayTaskOverdueError(
                    f"the rollout task did not start: no task of this run started or ended for "
                    f"{self._stall_s:.0f} s (does any node have {self._config.num_cpus_per_rollout} CPUs?)"
                )
            placement = first.result()
            if isinstance(placement, BaseException):
                return _lost_reason(placement, None)
            assert isinstance(placement, dict)
            self._placements[rid] = self._ran_on[rid] = where = RolloutPlacement(**placement)
            placed, self._placed = self._placed, asyncio.Event()
            placed.set()
            self._last_progress = time.monotonic()
            try:
                second = group.create_task(_next_item(generator))
                bound = self._finish_bound(prepared)
                unrelayed = group.create_task(self._stop_unrelayed.wait())
                try:
                    await asyncio.wait(
                        {second, unrelayed}, timeout=bound, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    unrelayed.cancel()
                if not second.done():
                    second.cancel()
                    self._dirty_nodes.add(where.node_id)
                    await self._kill(generator)
                    if self._stop_unrelayed.is_set():
                        return _killed_on_stop(where)
                    return RayTaskOverdueError(
                        f"the rollout task on {where.hostname} (pid {where.pid}) did not return within "
                        f"{bound:.0f} s of its start; it was killed"
                    )
                outcome = second.result()
                if isinstance(outcome, BaseException):
                    # Its process may be dead with its scratch still on the node.
                    self._dirty_nodes.add(where.node_id)
                    return _lost_reason(outcome, where)
                assert isinstance(outcome, dict)
                if self._config.shared_dir is None:
                    # Its task made its scratch directory first thing, sweeping the node's scratch.
                    self._swept_nodes.add(where.node_id)
                return outcome
            finally:
                self._placements.pop(rid, None)
                self._last_progress = time.monotonic()
        except asyncio.CancelledError:
            await shielded(self._kill(generator))
            raise

    async def _wait_started(self, first: asyncio.Task[object]) -> bool | Literal["stopped"]:
        """Wait until the task starts; False once the whole run has stalled (see ``_stall_s``),
        ``"stopped"`` once the run is stopped and the stop flag cannot say so to the task.

        **Cancellation:** the wait is abandoned; ``first`` is left to its group.
        """
        unrelayed = asyncio.ensure_future(self._stop_unrelayed.wait())
        try:
            while True:
                remaining = self._last_progress + self._stall_s - time.monotonic()
                if remaining <= 0:
                    return False
                await asyncio.wait({first, unrelayed}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
                if first.done():
                    return True
                if unrelayed.done():
                    return "stopped"
        finally:
            unrelayed.cancel()

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
        if self._stop_sent:
            return
        self._stop_sent = True
        if self._flag is None:
            self._stop_unrelayed.set()
            return
        try:
            async with asyncio.timeout(_STOP_SET_TIMEOUT_S):
                await self._flag.set.remote()
        except (RayError, TimeoutError) as exc:
            # Its tasks would run to their deadlines (minutes): the stop is the driver's to enforce.
            logger.warning(
                "could not tell the Ray tasks to stop through the run's stop flag (%s): they are killed",
                _first_line(exc) if isinstance(exc, RayError) else f"no answer in {_STOP_SET_TIMEOUT_S:g} s",
            )
            self._stop_unrelayed.set()

    def _lay_out_if_missing(self, prepared: PreparedRollout) -> None:
        # As when the local supervisor raises: the directory holds what was attempted
        # (input.json, an empty workspace), so the record's rollout_dir exists.
        directory = Path(prepared.rollout_dir)
        if directory.exists():
            return
        try:
            lay_out(directory, prepared.worker_input, self._settings.input_mode)
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


@dataclass
class _Unreached:
    """What one node could not reach during a run."""

    hostname: str
    node_ip: str
    attempts: dict[str, int] = field(default_factory=dict)
    """Attempts that failed for it, by what was not reached."""
    example: dict[str, str] = field(default_factory=dict)
    """The first such attempt's reason, by what was not reached."""


_ENVIRONMENT_UNREACHED = re.compile(
    r"environment (\S+) (?:could not be reached for|gave no answer to) /(?:seed_session|verify)"
)
_CONNECT_WORDS = (
    "ConnectError",
    "ConnectTimeout",
    "cannot connect",
    "Connection refused",
    "could not be reached",
)


def _unreached_what(reason: str) -> str | None:
    """What an ``infra_failure``'s reason says its node could not reach, in words; ``None``: nothing."""
    if "cannot fetch this attempt's credentials from the driver" in reason:
        return "the driver's credentials channel"
    found = _ENVIRONMENT_UNREACHED.search(reason)
    if found is not None:
        return f"the environment {found.group(1)}"
    if "upstream model unreachable" in reason or (
        "model" in reason and any(w in reason for w in _CONNECT_WORDS)
    ):
        return "the model endpoint"
    return None


def _killed_on_stop(where: RolloutPlacement | None) -> RayTaskLostError:
    on = f" on {where.hostname} (Ray node {where.node_id[:12]}, pid {where.pid})" if where is not None else ""
    return RayTaskLostError(
        f"the run was stopped and its stop flag could not tell the rollout task{on}: the task was killed "
        "(no evidence of the rollout came back)"
    )


def _unwrap(exc: BaseException) -> BaseException:
    """The first leaf of an exception group (what a task group wraps a failure in)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _lost_reason(exc: BaseException, where: RolloutPlacement | None) -> BaseException:
    """Why a task produced no record, in a line (a ``RayTaskError`` carries a whole traceback)."""
    on = f" on {where.hostname} (Ray node {where.node_id[:12]}, pid {where.pid})" if where is not None else ""
    if isinstance(exc, StopAsyncIteration):
        return RayTaskLostError(f"the rollout task{on} ended without a result")
    if isinstance(exc, RayTaskError):
        cause = _unwrap(exc.cause) if isinstance(exc.cause, BaseException) else exc
        return RayTaskLostError(
            f"the rollout task failed{on or ' on its node'}: {type(cause).__name__}: {_first_line(cause)}"
        )
    if isinstance(exc, RayError):
        # A dead worker process or node: Ray's message is a paragraph; its first line names it.
        return RayTaskLostError(f"the rollout task was lost{on}: {type(exc).__name__}: {_first_line(exc)}")
    return exc
