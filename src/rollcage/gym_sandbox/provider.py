"""``RollcageProvider``: NeMo Gym's ``SandboxProvider`` on rollcage's cage (entry point ``rollcage``).

Select it in NeMo Gym's config with one line (every key optional)::

    sandbox:
      rollcage:
        state_dir: /var/lib/rollcage/gym-sandboxes   # the default; or $ROLLCAGE_GYM_SANDBOX_DIR
        image_store: /var/cache/rollcage/images       # default: $ROLLCAGE_IMAGE_STORE or ~/.cache/...
        default_timeout_s: 180

What a ``SandboxSpec`` means here:

* ``image``: a bare ``[registry/]name:tag`` as docker reads it, or any reference rollcage's image
  store takes (``docker://...``, ``oci:PATH[:TAG]``, ``docker-archive:PATH``, ``dir:PATH``); required.
* ``env``, ``workdir``: over the image's ``Env`` and ``WorkingDir`` (made if missing).
* ``resources``: ``memory_mib`` and ``disk_gib`` are the sandbox's budgets (a cgroup; the bounded
  file system its writes land on); ``cpu`` is recorded and not enforced; a ``gpu`` is refused.
* network: none. ``provider_options: {allow_hosts: [...]}`` (or ``ports``) is refused, naming the
  field: a sandbox's commands have no network namespace of the host's.
* ``provider_options``: ``max_processes``, ``output_bytes`` (kept of each stream of each command),
  ``file_bytes`` (largest download).

Sessions (NeMo Gym's ``SupportsSandboxPty``): :meth:`RollcageProvider.create_pty` starts
``spec.command`` (or the image's ``/bin/sh -i``) on a terminal made in the cage's own ``devpts``,
its controlling terminal, sized ``rows`` x ``cols`` before it executes; ``pty=False`` gives pipes,
stderr apart. Each session is journaled in ``execs.jsonl`` when it closes; closing the sandbox
ends its sessions (their reads then raise ``SandboxPtyError``). See
:mod:`rollcage.gym_sandbox._session`.

Errors: a sandbox that cannot be made raises ``SandboxCreateError`` (its cause in the message:
not root, the image, bubblewrap); one made but not ready ``SandboxCreateVerificationError``. A command
past its time bound returns exit status 125 with ``error_type="timeout"``, a cage that could not be
built for a command 125 with ``error_type="sandbox"`` (as NeMo Gym's own providers report them).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

try:
    from nemo_gym.sandbox.providers.base import (
        SandboxCreateError,
        SandboxCreateVerificationError,
        SandboxExecResult,
        SandboxHandle,
        SandboxPtyError,
        SandboxPtySpec,
        SandboxResources,
        SandboxSpec,
        SandboxStatus,
    )
except ImportError as exc:  # pragma: no cover - only without the extra
    raise ImportError(
        f"rollcage's NeMo Gym sandbox provider needs NeMo Gym ({exc}): pip install 'rollcage[nemo-gym]'"
    ) from exc

from rollcage.durable import publish_bytes
from rollcage.errors import RollcageError
from rollcage.gym_sandbox._cage import (
    CAGE_FAILED,
    DEFAULT_OWNER,
    CagedSandbox,
    SandboxBudgets,
    attach_sandbox,
    open_sandbox,
    release_abandoned,
)
from rollcage.gym_sandbox._joiner import Joiner
from rollcage.gym_sandbox._session import CageSession
from rollcage.images import ImageStore

__all__ = ["DEFAULT_STATE_DIR", "STATE_ENV", "RollcageProvider", "image_ref"]

LOGGER = logging.getLogger(__name__)

STATE_ENV = "ROLLCAGE_GYM_SANDBOX_DIR"
"""Where sandboxes keep their state when the provider's config names no ``state_dir``."""

_TRANSPORTS = ("docker://", "oci:", "docker-archive:", "dir:")


def image_ref(image: str) -> str:
    """The image store's reference for a spec's ``image``: a bare ``name:tag`` is docker's (``docker://``)."""
    return image if image.startswith(_TRANSPORTS) else f"docker://{image}"


_OPTIONS = frozenset({"max_processes", "output_bytes", "file_bytes", "allow_hosts"})


DEFAULT_STATE_DIR = Path("/var/lib/rollcage/gym-sandboxes")
"""The default state directory: the sandboxes' unprivileged uid must pass through every parent
(a home directory, mode 0700, would not do)."""


def _default_state_dir() -> Path:
    return Path(os.environ[STATE_ENV]) if os.environ.get(STATE_ENV) else DEFAULT_STATE_DIR


class RollcageProvider:
    """NeMo Gym sandboxes in rollcage's cage: image roots copy-on-write, budgets, an exec journal each."""

    name = "rollcage"

    def __init__(
        self,
        state_dir: str | None = None,
        image_store: str | None = None,
        default_timeout_s: float = 180.0,
        run_as_uid: int = DEFAULT_OWNER[0],
        run_as_gid: int = DEFAULT_OWNER[1],
        bwrap_path: str | None = None,
    ) -> None:
        if run_as_uid < 1 or run_as_gid < 1:
            raise ValueError(
                "rollcage provider: run_as_uid and run_as_gid must name an unprivileged uid and gid"
            )
        self._state_dir = Path(state_dir).expanduser() if state_dir else _default_state_dir()
        self._store = ImageStore(Path(image_store).expanduser()) if image_store else ImageStore()
        self._default_timeout_s = default_timeout_s
        self._owner = (run_as_uid, run_as_gid)
        self._bwrap_path = bwrap_path
        self._open: dict[str, CagedSandbox] = {}
        self._swept = False
        # One fork server for all this provider's sandboxes: a command costs a fork, not an interpreter.
        self._joiner = Joiner()

    @staticmethod
    def _budgets(spec: SandboxSpec) -> SandboxBudgets:
        options: dict[str, Any] = dict(spec.provider_options or {})
        unknown = set(options) - _OPTIONS
        if unknown:
            raise SandboxCreateError(
                f"rollcage provider: unknown provider_options {', '.join(sorted(unknown))}; "
                f"expected some of {', '.join(sorted(_OPTIONS))}"
            )
        if options.get("allow_hosts"):
            raise SandboxCreateError(
                "rollcage provider: provider_options.allow_hosts asks for network access, and a rollcage "
                "sandbox has none; drop it or pick another provider"
            )
        if spec.ports:
            raise SandboxCreateError(
                f"rollcage provider: ports {list(spec.ports)} ask for network services, and a rollcage "
                "sandbox has no network; drop them or pick another provider"
            )
        resources = spec.resources
        assert isinstance(resources, SandboxResources)  # SandboxSpec converts a mapping
        if resources.gpu:
            raise SandboxCreateError(
                f"rollcage provider: resources.gpu={resources.gpu} asks for a GPU, which a rollcage sandbox "
                "cannot give"
            )
        defaults = SandboxBudgets()
        processes = options.get("max_processes", defaults.max_processes)
        try:
            return SandboxBudgets(
                memory_bytes=resources.memory_mib << 20 if resources.memory_mib else None,
                disk_bytes=resources.disk_gib << 30 if resources.disk_gib else defaults.disk_bytes,
                max_processes=None if processes is None else int(processes),
                output_bytes=int(options.get("output_bytes", defaults.output_bytes)),
                file_bytes=int(options.get("file_bytes", defaults.file_bytes)),
            )
        except (TypeError, ValueError) as exc:
            raise SandboxCreateError(f"rollcage provider: provider_options: {exc}") from exc

    async def create(self, spec: SandboxSpec) -> SandboxHandle:
        """Make a sandbox of ``spec.image``; return once its cage is ready.

        **Cancellation:** whatever was made is undone before it propagates.
        """
        if not spec.image:
            raise SandboxCreateError(
                "rollcage provider: SandboxSpec.image is required (a rollcage sandbox is an image)"
            )
        budgets = self._budgets(spec)
        if not self._swept and os.geteuid() == 0:
            # Sandboxes of a provider process that died (killed, crashed) hold mounts and cgroups
            # until someone releases them: the first create of each provider does.
            self._swept = True
            released = await asyncio.to_thread(release_abandoned, self._state_dir)
            if released:
                LOGGER.warning(
                    "rollcage provider: released %d abandoned sandbox(es): %s", len(released), released
                )
        resources = spec.resources
        if isinstance(resources, SandboxResources) and resources.cpu:
            LOGGER.warning("rollcage provider: resources.cpu=%s is recorded, not enforced", resources.cpu)
        try:
            async with asyncio.timeout(spec.ready_timeout_s):
                sandbox = await open_sandbox(
                    image_ref(spec.image),
                    state_dir=self._state_dir,
                    store=self._store,
                    env=dict(spec.env),
                    workdir=spec.workdir,
                    budgets=budgets,
                    owner=self._owner,
                    bwrap_path=self._bwrap_path,
                    joiner=self._joiner,
                )
        except TimeoutError as exc:
            raise SandboxCreateVerificationError(
                f"rollcage provider: sandbox of {spec.image} not ready within "
                f"ready_timeout_s={spec.ready_timeout_s}"
            ) from exc
        except RollcageError as exc:
            raise SandboxCreateError(
                f"rollcage provider: cannot create a sandbox of {spec.image}: {exc}"
            ) from exc
        self._open[sandbox.sandbox_id] = sandbox
        return SandboxHandle(sandbox_id=sandbox.sandbox_id, provider_name=self.name, raw=sandbox)

    @staticmethod
    def _sandbox(handle: SandboxHandle) -> CagedSandbox:
        sandbox = handle.raw
        if not isinstance(sandbox, CagedSandbox):
            raise TypeError(f"sandbox handle {handle.sandbox_id!r} was not made by the rollcage provider")
        return sandbox

    async def exec(
        self,
        handle: SandboxHandle,
        command: str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: int | float | None = None,
        user: str | int | None = None,
    ) -> SandboxExecResult:
        """Run ``command`` with ``/bin/sh -c`` in the sandbox, journaled; its group dies at the bound.

        **Cancellation:** the command's group is killed and reaped.
        """
        sandbox = self._sandbox(handle)
        timeout = float(timeout_s) if timeout_s is not None else self._default_timeout_s
        try:
            result = await sandbox.run(command, cwd=cwd, env=env, timeout_s=timeout, user=user)
        except RollcageError as exc:
            return SandboxExecResult(
                stdout=None, stderr=f"rollcage sandbox: {exc}", return_code=CAGE_FAILED, error_type="sandbox"
            )
        stdout = result.stdout.decode("utf-8", "replace")
        stderr = result.stderr.decode("utf-8", "replace")
        if result.timed_out:
            return SandboxExecResult(
                stdout=stdout,
                stderr=stderr + f"rollcage sandbox: command timed out after {timeout:g}s",
                return_code=CAGE_FAILED,
                error_type="timeout",
            )
        if result.cage_failed:
            return SandboxExecResult(
                stdout=None, stderr=stderr, return_code=CAGE_FAILED, error_type="sandbox"
            )
        return SandboxExecResult(stdout=stdout, stderr=stderr, return_code=result.exit_code, error_type=None)

    async def exec_with_background_services(
        self,
        handle: SandboxHandle,
        command: str,
        *,
        cwd: str | None = None,
        timeout_s: int | float | None = None,
    ) -> SandboxExecResult:
        """As :meth:`exec`: a rollcage sandbox keeps every detached process until it is closed.

        **Cancellation:** as :meth:`exec`.
        """
        return await self.exec(handle, command, cwd=cwd, timeout_s=timeout_s)

    async def create_pty(self, handle: SandboxHandle, spec: SandboxPtySpec) -> CageSession:
        """Start a live session in the sandbox: ``spec.command`` (or ``/bin/sh -i``) on a terminal of
        ``spec.rows`` x ``spec.cols``, or with ``spec.pty=False`` on pipes, stderr apart.

        The session is journaled like an exec when it closes; closing the sandbox ends it.

        Raises:
            ValueError: ``spec.user`` is not the image's user, or a size out of range.
            SandboxPtyError: The session could not be started (the message says why).

        **Cancellation:** a command already started is killed and reaped.
        """
        sandbox = self._sandbox(handle)
        try:
            return await sandbox.open_session(
                spec.command,
                cwd=spec.cwd,
                env=spec.env,
                user=spec.user,
                rows=spec.rows,
                cols=spec.cols,
                pty=spec.pty,
                error=SandboxPtyError,
            )
        except RollcageError as exc:
            raise SandboxPtyError(f"rollcage provider: cannot start a session: {exc}") from exc

    async def upload_file(self, handle: SandboxHandle, source_path: Path, target_path: str) -> None:
        """Copy a host file to ``target_path`` in the sandbox (relative: to its working directory).

        **Cancellation:** the copy is killed; the file may be partly written.
        """
        data = await asyncio.to_thread(Path(source_path).read_bytes)
        await self._sandbox(handle).upload(data, target_path)

    async def download_file(self, handle: SandboxHandle, source_path: str, target_path: Path) -> None:
        """Copy the sandbox's regular file ``source_path`` to ``target_path`` on the host.

        **Cancellation:** the copy is killed; ``target_path`` is untouched (written whole or not at all).
        """
        data = await self._sandbox(handle).download(source_path)
        target = Path(target_path)
        await asyncio.to_thread(target.parent.mkdir, parents=True, exist_ok=True)
        await asyncio.to_thread(publish_bytes, target, data, mode=0o644)

    async def status(self, handle: SandboxHandle) -> SandboxStatus:
        """``running`` while open and mounted, ``stopped`` once closed, ``error`` if its cage is gone.

        **Cancellation:** nothing to undo.
        """
        sandbox = self._sandbox(handle)
        if sandbox.closed:
            return SandboxStatus.STOPPED
        return SandboxStatus.RUNNING if sandbox.is_running() else SandboxStatus.ERROR

    async def close(self, handle: SandboxHandle) -> None:
        """Kill its processes, remove its cgroups, unmount its root; idempotent.

        **Cancellation:** as :meth:`rollcage.gym_sandbox._cage.CagedSandbox.close`.
        """
        sandbox = self._sandbox(handle)
        self._open.pop(sandbox.sandbox_id, None)
        await sandbox.close()

    async def aclose(self) -> None:
        """Close every sandbox this provider made and did not close.

        **Cancellation:** the sandboxes not yet closed stay open; call again.
        """
        for sandbox in list(self._open.values()):
            await sandbox.close()
        self._open.clear()
        await self._joiner.close()

    async def serialize_handle(self, handle: SandboxHandle, *, scope: str | None = None) -> dict[str, Any]:
        """A descriptor :meth:`connect` rebuilds the handle from, in any process on this host (as root).

        **Cancellation:** nothing to undo.
        """
        sandbox = self._sandbox(handle)
        return {"provider": self.name, "sandbox_id": sandbox.sandbox_id, "workdir": sandbox.workdir}

    async def connect(self, descriptor: Mapping[str, Any]) -> SandboxHandle:
        """Attach to a sandbox another ``rollcage`` provider made on this host, from its descriptor.

        Its commands run in the same cage and are journaled with the creator's; closing the handle
        only detaches (the creator closes the sandbox).

        Raises:
            ValueError: The descriptor names no open rollcage sandbox under this provider's state_dir.

        **Cancellation:** nothing to undo.
        """
        sandbox_id = str(descriptor.get("sandbox_id", ""))
        if not sandbox_id.startswith("rollcage-") or "/" in sandbox_id or sandbox_id in (".", ".."):
            raise ValueError(f"rollcage provider: {sandbox_id!r} is not a rollcage sandbox id")
        try:
            sandbox = await attach_sandbox(self._state_dir / sandbox_id, joiner=self._joiner)
        except RollcageError as exc:
            raise ValueError(f"rollcage provider: cannot connect to {sandbox_id}: {exc}") from exc
        return SandboxHandle(sandbox_id=sandbox.sandbox_id, provider_name=self.name, raw=sandbox)

    def describe(self) -> Mapping[str, Any]:
        """Where this provider keeps its sandboxes (for logs)."""
        return {"state_dir": str(self._state_dir), "image_store": str(self._store.path)}
