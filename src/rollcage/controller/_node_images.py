"""Task images where rollouts run: each node prepares the images of its rollouts in its own store.

The local backend prepares every image of a run once, up front, in this machine's store
(``Controller._prepare_images``). A Ray run cannot: a rollout runs on whichever node has room,
and an image root is a path on that node. So the driver checks what it can without the image
(the sandbox, the executor) and hands each attempt the image's *reference*
(``PreparedRollout.node_image``); the node, before it lays the rollout out, prepares the image in
its own store (:func:`node_image_store`), takes a lease on it for the attempt (so no prune removes
it meanwhile) and fills in ``WorkerInput.image``. The store's own locks make concurrent attempts on
one node pull an image once: the first pulls and unpacks, the others wait and find it there.

The programs a rollout's tools run in the image (:func:`programs_needed`) are checked wherever the
image is prepared: up front locally, on the node before the attempt starts on Ray.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final

from rollcage.errors import ConfigError
from rollcage.protocol import BashToolSpec, EditorToolSpec, ImageSandbox, PythonToolSpec

__all__ = ["NODE_STORE_NAME", "missing_program", "node_image", "node_image_store", "programs_needed"]

NODE_STORE_NAME: Final = "rollcage-images"
"""The store's directory under a node's Ray temp dir, where no other is configured."""


def programs_needed(mode: str, tools: Sequence[Any]) -> list[tuple[str, str]]:
    """The programs the builtin loop runs in a task's image for its tools: (program, what for)."""
    needed = []
    if mode == "codeact" or any(isinstance(t, PythonToolSpec) for t in tools):
        needed.append(("python3", "the python tool (and codeact)"))
    if any(isinstance(t, BashToolSpec) for t in tools):
        needed.append(("/bin/bash", "the bash tool"))
    if any(isinstance(t, EditorToolSpec) for t in tools):
        needed.append(("python3", "the file editor"))
    return needed


def missing_program(sandbox: ImageSandbox, program: str) -> str | None:
    """Where ``program`` was looked for in the image, when it is not there; ``None`` when it is."""
    from rollcage.cage import image_environment
    from rollcage.images import find_program

    search = image_environment(sandbox)["PATH"]
    where = os.path.dirname(program) if "/" in program else search
    return None if find_program(sandbox.root, os.path.basename(program), where) is not None else where


def node_image_store(configured: Path | None) -> Path:
    """This node's image store: ``configured`` (``--ray-image-store``), else ``$ROLLCAGE_IMAGE_STORE`` as
    set for the node, else ``rollcage-images`` under the node's Ray temp dir (``ray start --temp-dir``;
    the system's temporary directory where Ray does not say)."""
    from rollcage.images import STORE_ENV

    if configured is not None:
        return configured
    explicit = os.environ.get(STORE_ENV)
    if explicit:
        return Path(explicit).expanduser().absolute()
    return _ray_temp_dir() / NODE_STORE_NAME


def _ray_temp_dir() -> Path:
    try:
        from ray._private import worker  # the node's --temp-dir: no public API gives it

        node = worker._global_node
        if node is not None:
            return Path(node.get_temp_dir_path())
    except (ImportError, AttributeError):
        pass
    return Path(tempfile.gettempdir())


@contextlib.contextmanager
def node_image(
    ref: str, store_path: Path, *, mode: str, tools: Sequence[Any], builtin: bool
) -> Iterator[ImageSandbox]:
    """Prepare image ``ref`` in the store at ``store_path`` and hold a lease on it while the block runs.

    Args:
        ref: The image reference (a row's ``sandbox.image`` or the run's ``--image``).
        store_path: The node's store (:func:`node_image_store`).
        mode: The agent's mode (``codeact`` runs python3 in the image).
        tools: The attempt's tools: the programs they run must be in the image.
        builtin: The builtin loop runs the attempt (a harness brings its own programs).

    Raises:
        ConfigError: The image cannot be used (its reference, its content), or lacks a program the
            attempt's tools run; ``ImagePullError``: the registry failed.
    """
    from rollcage.images import ImageStore, image_sandbox

    store = ImageStore(store_path)
    prepared = store.prepare(ref)
    with store.lease(prepared) as leased:
        sandbox = image_sandbox(leased)
        if builtin:
            for program, what in programs_needed(mode, tools):
                where = missing_program(sandbox, program)
                if where is not None:
                    raise ConfigError(
                        f"image {ref} has no {program} (looked in {where}), so {what} cannot run in it"
                    )
        yield sandbox
