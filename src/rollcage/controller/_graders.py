"""Graders: run on the controller's side, after the supervisor's receipt, never on a checkpoint.

A row names its grader in ``grader`` (a tagged union on ``type``); without one, a
row with an environment is graded by the environment's ``/verify``, a row with
only ``expected`` by ``exact``, and a row with neither is not graded.

=============  ==========================================================================
``verify``     POST to the environment's ``/verify`` (see ``rollcage.environments``)
``exact``      the final answer, stripped, equals ``expected`` (or one of a list)
``normalized`` the same after case folding, collapsing whitespace, dropping a final ``.``
``numeric``    the last number in the answer is within ``tolerance`` of ``expected``
``regex``      ``pattern`` (or ``expected``) is found in the answer
=============  ==========================================================================

Built-in graders give 1.0 or 0.0. A grader that cannot give a grade (the verify
endpoint is down, answers garbage) yields ``reward=None`` with an ``error``: that
is the infrastructure's failure, and it is never counted as the policy's.
"""

from __future__ import annotations

import math
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ExactGrader",
    "GradeResult",
    "GraderSpec",
    "NormalizedGrader",
    "NumericGrader",
    "RegexGrader",
    "VerifyGrader",
    "grade_builtin",
    "read_workspace_files",
    "verify_remote",
]

_REGEX_TEXT_LIMIT = 100_000
_FILE_LIMIT = 256 * 1024
_FILES_TOTAL_LIMIT = 1024 * 1024


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class VerifyGrader(_Spec):
    """The environment's ``/verify`` endpoint grades the rollout."""

    type: Literal["verify"] = "verify"
    timeout_s: float = Field(default=60.0, gt=0, le=3600, description="Deadline of the verify request.")
    files: list[str] | None = Field(
        default=None,
        description="Workspace files (relative paths) sent along; None: the environment's default list.",
    )


class ExactGrader(_Spec):
    """The stripped final answer equals ``expected`` (a string, or a list of accepted strings)."""

    type: Literal["exact"] = "exact"


class NormalizedGrader(_Spec):
    """Like ``exact`` after case folding, collapsing whitespace and dropping a trailing period."""

    type: Literal["normalized"] = "normalized"


class NumericGrader(_Spec):
    """The last number in the final answer is within ``tolerance`` of ``expected``."""

    type: Literal["numeric"] = "numeric"
    tolerance: float = Field(default=1e-6, ge=0, description="Allowed difference.")
    relative: bool = Field(default=False, description="Tolerance relative to |expected| instead of absolute.")


class RegexGrader(_Spec):
    """``pattern`` is found (``re.search``) in the final answer."""

    type: Literal["regex"] = "regex"
    pattern: str | None = Field(default=None, description="The pattern; None: the row's expected string.")
    ignore_case: bool = Field(default=False, description="Match case-insensitively.")


GraderSpec = Annotated[
    VerifyGrader | ExactGrader | NormalizedGrader | NumericGrader | RegexGrader, Field(discriminator="type")
]
"""A row's ``grader``, tagged by ``type``."""


@dataclass(frozen=True)
class GradeResult:
    """A grade, or why there is none.

    Attributes:
        reward: The reward; ``None`` when the grader could not grade (see ``error``).
        detail: What the grader reports (the record's ``grader`` field, with ``name``).
        error: Why no reward could be given; ``None`` on success.
    """

    reward: float | None
    detail: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def as_record(self) -> dict[str, Any]:
        """The ``grader`` field of a RolloutRecord."""
        out = dict(self.detail)
        if self.error is not None:
            out["error"] = self.error
        return out


def _accepted(expected: Any) -> list[str] | None:
    if isinstance(expected, str | int | float) and not isinstance(expected, bool):
        return [str(expected)]
    if isinstance(expected, list) and expected and all(isinstance(x, str | int | float) for x in expected):
        return [str(x) for x in expected]
    return None


def _normalise(text: str) -> str:
    return " ".join(text.casefold().split()).rstrip(".")


_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def grade_builtin(spec: GraderSpec, *, expected: Any, answer: str) -> GradeResult:
    """Grade ``answer`` with a built-in grader (anything but ``verify``).

    Args:
        spec: The grader.
        expected: The row's controller-only ``expected``.
        answer: The final answer text (``WorkerResult.response.output_text``).
    """
    name = spec.type
    if isinstance(spec, ExactGrader | NormalizedGrader):
        accepted = _accepted(expected)
        if accepted is None:
            return GradeResult(None, {"name": name}, "expected must be a string or a list of strings")
        if isinstance(spec, ExactGrader):
            ok = answer.strip() in [a.strip() for a in accepted]
        else:
            ok = _normalise(answer) in [_normalise(a) for a in accepted]
        return GradeResult(1.0 if ok else 0.0, {"name": name, "match": ok})
    if isinstance(spec, NumericGrader):
        try:
            if isinstance(expected, bool):
                raise TypeError
            target = float(expected.replace(",", "") if isinstance(expected, str) else expected)
        except (TypeError, ValueError):
            return GradeResult(None, {"name": name}, f"expected {expected!r} is not a number")
        found = _NUMBER.findall(answer)
        if not found:
            return GradeResult(0.0, {"name": name, "match": False, "found": None})
        try:
            got = float(found[-1].replace(",", ""))
        except ValueError:
            return GradeResult(0.0, {"name": name, "match": False, "found": found[-1]})
        bound = spec.tolerance * abs(target) if spec.relative else spec.tolerance
        ok = math.isfinite(got) and abs(got - target) <= bound
        return GradeResult(1.0 if ok else 0.0, {"name": name, "match": ok, "found": got})
    if isinstance(spec, RegexGrader):
        pattern = spec.pattern if spec.pattern is not None else expected
        if not isinstance(pattern, str):
            return GradeResult(None, {"name": name}, "regex grader needs 'pattern' or a string 'expected'")
        try:
            compiled = re.compile(pattern, re.IGNORECASE if spec.ignore_case else 0)
        except re.error as exc:
            return GradeResult(None, {"name": name}, f"bad pattern: {exc}")
        # Bounded text: a pathological pattern on a huge answer must not stall the controller.
        ok = compiled.search(answer[:_REGEX_TEXT_LIMIT]) is not None
        return GradeResult(1.0 if ok else 0.0, {"name": name, "match": ok})
    return GradeResult(None, {"name": name}, f"{name} is not a built-in grader")


def read_workspace_files(workspace: str, names: list[str]) -> dict[str, str]:
    """Read the named files from a finished rollout's workspace, safely.

    The agent controlled that directory, so nothing in it is trusted: every path
    component is opened without following symlinks (a link to ``/etc/shadow`` or to
    the controller's files is skipped, not read), only regular files are read (a
    FIFO cannot block us), and sizes are bounded. Missing or refused files are
    simply absent from the answer.

    Args:
        workspace: The rollout's ``workspace/`` directory.
        names: Relative paths, without ``..``.
    """
    out: dict[str, str] = {}
    total = 0
    for name in names:
        parts = [p for p in name.split("/") if p not in ("", ".")]
        if not parts or ".." in parts or name.startswith("/"):
            continue
        text = _read_one(workspace, parts)
        if text is None or total + len(text) > _FILES_TOTAL_LIMIT:
            continue
        total += len(text)
        out[name] = text
    return out


def _read_one(workspace: str, parts: list[str]) -> str | None:
    flags_dir = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        fd = os.open(workspace, flags_dir)
    except OSError:
        return None
    try:
        for part in parts[:-1]:
            next_fd = os.open(part, flags_dir, dir_fd=fd)
            os.close(fd)
            fd = next_fd
        file_fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    except OSError:
        os.close(fd)
        return None
    os.close(fd)
    try:
        info = os.fstat(file_fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _FILE_LIMIT:
            return None
        data = os.read(file_fd, _FILE_LIMIT + 1)
    except OSError:
        return None
    finally:
        os.close(file_fd)
    if len(data) > _FILE_LIMIT:
        return None
    return data.decode("utf-8", "replace")


async def verify_remote(
    url: str, *, token: str | None, payload: dict[str, Any], timeout_s: float
) -> GradeResult:
    """POST ``payload`` to an environment's ``/verify`` and read its reward.

    Args:
        url: The environment's base URL (``/verify`` is appended).
        token: Bearer token of a bundled environment; ``None`` sends none.
        payload: The verify request body (see ``rollcage.environments``).
        timeout_s: Deadline of the whole request.

    Returns:
        The reward, or ``reward=None`` with an ``error`` when the endpoint failed.

    **Cancellation:** the request is abandoned and the connection closed.
    """
    import httpx

    headers = {"authorization": f"Bearer {token}"} if token else {}
    detail: dict[str, Any] = {"name": "verify"}
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), trust_env=False) as client:
            response = await client.post(url.rstrip("/") + "/verify", json=payload, headers=headers)
    except httpx.HTTPError as exc:
        return GradeResult(None, detail, f"verify request failed: {type(exc).__name__}: {exc}")
    if response.status_code != 200:
        return GradeResult(
            None, detail, f"verify answered HTTP {response.status_code}: {response.text[:300]}"
        )
    try:
        body = response.json()
    except ValueError:
        return GradeResult(None, detail, f"verify answered non-JSON: {response.text[:300]}")
    reward = body.get("reward") if isinstance(body, dict) else None
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        return GradeResult(None, detail, f"verify answered no numeric 'reward': {str(body)[:300]}")
    extra = body.get("detail")
    if isinstance(extra, dict):
        detail.update({k: v for k, v in extra.items() if k != "name"})
    return GradeResult(float(reward), detail)
