"""Deterministic rollout ids, so a rerun of the same command names the same attempts."""

from __future__ import annotations

import hashlib
import re

__all__ = ["rollout_id"]

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_MAX_STEM = 80


def rollout_id(task_id: str, sample: int, try_index: int) -> str:
    """The id of one attempt: ``<task>-s<sample>-t<try>``, safe as a directory name.

    A task id that is already safe (letters, digits, ``.``, ``_``, ``-``; at most 80
    characters; not starting with ``.``) is used as is. Any other is sanitised and
    followed by ``~`` and a hash of the original, so two different task ids never
    share a rollout id (``~`` never survives sanitising, so a sanitised id cannot
    equal an untouched one).

    Args:
        task_id: The dataset row's id.
        sample: Which of the ``--attempts`` samples (0-based).
        try_index: The infrastructure retry of that sample (0-based).
    """
    stem = _UNSAFE.sub("_", task_id)
    if stem.startswith("."):
        stem = "_" + stem[1:]
    if stem != task_id or len(stem) > _MAX_STEM:
        digest = hashlib.sha256(task_id.encode("utf-8", "surrogatepass")).hexdigest()[:10]
        stem = f"{stem[:_MAX_STEM]}~{digest}"
    return f"{stem}-s{sample}-t{try_index}"
