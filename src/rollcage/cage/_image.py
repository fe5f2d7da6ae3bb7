"""The executor's cage over a task image: agent code sees the rollout's image root, not the worker's view.

An image rollout (``WorkerInput.image``) has its copy-on-write root mounted by the supervisor and
bound into the worker's sandbox at :data:`IMAGE_ROOT`. Every place agent code runs (the Python
executor, the bash tool, the editor, a ``command`` harness) is then started under
:func:`image_prefix` instead of :func:`~rollcage.cage.nested_prefix`: a nested bubblewrap whose ``/``
is that root, so nothing of the worker's view (rollcage's package, the worker's files, the Python
environment, the host's ``/usr``) is there at all. What stays from the worker's sandbox: its bounded
``/tmp`` and ``/dev`` (``/dev/shm`` included), a fresh ``/proc`` of the cage's own processes.

The image's ``Env`` is set over the worker's environment (variables the worker marks its processes
with stay), ``WorkingDir`` is the working directory, ``User`` is the uid and gid agent code has (the
supervisor's id-mapped root makes the image's files of that user the sandbox's own), every
capability is dropped, and the entrypoint is never run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

from rollcage.errors import SandboxError

if TYPE_CHECKING:
    from rollcage.protocol import ImageSandbox

__all__ = [
    "DEFAULT_PATH",
    "IMAGE_ROOT",
    "image_cage_env",
    "image_environment",
    "image_prefix",
]

IMAGE_ROOT: Final = "/run/rollcage-image"
"""Where the worker sees its rollout's image root (the supervisor binds it there, writable)."""

DEFAULT_PATH: Final = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""``PATH`` in an image whose ``Env`` sets none (as docker gives it)."""

_IGNORE_SIGINT: Final = 'trap "" INT; exec "$@"'
_UNSET: Final = ("JPY_PARENT_PID",)


def image_environment(image: ImageSandbox) -> dict[str, str]:
    """The variables the image's ``Env`` sets, with ``PATH`` and ``HOME`` as docker defaults them."""
    env: dict[str, str] = {}
    for entry in image.env:
        name, sep, value = entry.partition("=")
        if sep and name and "\0" not in entry:
            env[name] = value
    env.setdefault("PATH", DEFAULT_PATH)
    env.setdefault("HOME", "/root" if image.uid == 0 else "/")
    return env


def image_prefix(
    bwrap: str,
    image: ImageSandbox,
    *,
    share_net: bool = False,
    ignore_sigint: bool = True,
    new_session: bool = False,
    root: str = IMAGE_ROOT,
    workspace: str | None = None,
) -> list[str]:
    """The command-line prefix that runs a command in the image's root (see the module docstring; pure).

    Args:
        bwrap: The bwrap program, as the worker sees it.
        image: The rollout's image.
        share_net: Keep the worker's network namespace (a harness reaching the worker's forwarder).
        ignore_sigint: As for :meth:`rollcage.cage.NestedCage.prefix`.
        new_session: As for :meth:`rollcage.cage.NestedCage.prefix`.
        root: Where the worker sees the image root.
        workspace: The rollout's workspace, bound at the same path in the image (its mount point is
            made by the supervisor, :data:`rollcage.supervisor.imageroot.MOUNT_POINTS`); ``None``: none.
    """
    environment: list[str] = []
    for name, value in sorted(image_environment(image).items()):
        environment += ["--setenv", name, value]
    for name in _UNSET:
        environment += ["--unsetenv", name]
    wrapper = ["/bin/sh", "-c", _IGNORE_SIGINT, "rollcage-executor"] if ignore_sigint else []
    return [
        *wrapper,
        bwrap,
        "--unshare-user",
        "--disable-userns",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        *([] if share_net else ["--unshare-net"]),
        "--die-with-parent",
        "--uid",
        str(image.uid),
        "--gid",
        str(image.gid),
        # Root in the image is root of nothing: no capability, even in the cage's own namespace.
        "--cap-drop",
        "ALL",
        "--bind",
        root,
        "/",
        # The worker's bounded /tmp and /dev (its /dev/shm): the rollout's budgets hold in the image too.
        "--bind",
        "/tmp",
        "/tmp",
        "--proc",
        "/proc",
        "--dev-bind",
        "/dev",
        "/dev",
        *(["--bind", workspace, workspace] if workspace is not None else []),
        "--chdir",
        image.working_dir,
        *environment,
        *(["--new-session"] if new_session else []),
        "--",
    ]


def image_cage_env(environ: Mapping[str, str]) -> str:
    """The bwrap program the supervisor's :data:`~rollcage.cage.CAGE_ENV` names for the worker.

    Raises:
        SandboxError: No cage was asked for (an image rollout needs one) or bwrap is not given.
    """
    from rollcage.cage._bwrap import which
    from rollcage.cage._nested import CAGE_ENV

    mode = environ.get(CAGE_ENV, "none")
    kind, _, program = mode.partition(":")
    if kind != "bwrap":
        raise SandboxError(
            f"an image rollout runs agent code in a cage of its own, and {CAGE_ENV}={mode!r} asks for none: "
            "use the bwrap sandbox with executor_cage 'bwrap'"
        )
    bwrap = program or which("bwrap")
    if bwrap is None:
        raise SandboxError(f"{CAGE_ENV}=bwrap but bwrap is not visible in the worker's sandbox")
    return bwrap
