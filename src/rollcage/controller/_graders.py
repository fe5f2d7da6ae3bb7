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
``match``      Inspect's ``match()``: ``expected`` at the answer's end (``location``), after
               case folding and stripping whitespace and punctuation from both ends
``includes``   Inspect's ``includes()``: ``expected`` occurs in the answer (case folded)
``choice``     Inspect's ``choice()``: the ``ANSWER: X`` letters equal ``expected``'s
=============  ==========================================================================

``match``, ``includes`` and ``choice`` are Inspect AI's scorers, rule for rule
(``rollcage.controller._inspect_scoring``): an Inspect sample is scored by ``choice``
when it has choices, else by ``match``.

Built-in graders give 1.0 or 0.0. A grader that cannot give a grade (the verify
endpoint is down, answers garbage, a pattern runs past its timeout, the grader
raises) yields ``reward=None`` with an ``error``: the ``grader_error`` health check,
never counted as the policy's failure. So does a reward that is not a sensible
number (``checked_grade``): not finite, or beyond ``REWARD_LIMIT`` (1e9) either way,
which no scoring scheme means and which would overflow the run's mean reward.

Grading never runs on the controller's event loop (``grade_builtin_off_loop``): a
grade is computed in a worker thread under a per-grade timeout, so one expensive
grade cannot stall the other rollouts' supervision. What truly bounds the one
unbounded built-in, ``regex``, is the ``regex`` module: its matcher checks a
``timeout`` as it backtracks and raises, and with ``concurrent=True`` it releases
the GIL while matching, so a catastrophic pattern (``(a|aa)+$`` on ``"a"*60+"!"``)
neither holds the interpreter nor outlives its timeout. (A thread around the
standard ``re`` would keep the GIL and could not be stopped; a process per grade
would cost a fork per rollout for graders that take microseconds.) The other
built-ins are linear in the answer.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import stat
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollcage.controller._inspect_scoring import (
    MatchLocation,
    answer_character,
    choice_positions,
    includes,
    match_str,
    selected_positions,
)

if TYPE_CHECKING:
    import httpx

__all__ = [
    "REWARD_LIMIT",
    "ChoiceGrader",
    "ExactGrader",
    "GradeResult",
    "GraderSpec",
    "IncludesGrader",
    "MatchGrader",
    "NormalizedGrader",
    "NumericGrader",
    "RegexGrader",
    "TestsGrader",
    "VerifyGrader",
    "check_pattern",
    "checked_grade",
    "grade_builtin",
    "grade_builtin_off_loop",
    "grader_raised",
    "parse_verify_answer",
    "read_workspace_files",
    "reward_problem",
    "verify_remote",
]

_REGEX_TEXT_LIMIT = 100_000
_PATTERN_LIMIT = 10_000
_VERIFY_ANSWER_LIMIT = 16 * 1024 * 1024
_DETAIL_LIMIT = 16 * 1024
_FAILURE_KIND_LIMIT = 200
# Keys of a verify answer that are not the grade's detail: the grade itself, and
# NeMo Gym's echo of the request (BaseVerifyResponse extends BaseVerifyRequest).
_ANSWER_KEYS = frozenset(
    {"reward", "detail", "mask_sample", "failure_kind", "responses_create_params", "response"}
)
_FILE_LIMIT = 256 * 1024
_ERROR_LIMIT = 2000

REWARD_LIMIT = 1e9
"""The largest reward magnitude a grade may have: rewards are scores (0..1, points, penalties), and a sum of
any number of rewards within it stays far from a float's overflow."""
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
    pattern: str | None = Field(
        default=None, max_length=_PATTERN_LIMIT, description="The pattern; None: the row's expected string."
    )
    ignore_case: bool = Field(default=False, description="Match case-insensitively.")
    timeout_s: float = Field(
        default=5.0, gt=0, le=300, description="Longest the match may run; past it: grader_error."
    )


class MatchGrader(_Spec):
    """Inspect's ``match()``: ``expected`` (or one of a list) found at ``location`` in the answer."""

    type: Literal["match"] = "match"
    location: MatchLocation = Field(
        default="end",
        description="Where the target must be: begin, end, any or exact (Inspect's default: end).",
    )
    ignore_case: bool = Field(default=True, description="Compare case-folded (Inspect's default).")


class IncludesGrader(_Spec):
    """Inspect's ``includes()``: ``expected`` (or one of a list) occurs in the answer."""

    type: Literal["includes"] = "includes"
    ignore_case: bool = Field(default=True, description="Compare case-folded (Inspect's default).")


class ChoiceGrader(_Spec):
    """Inspect's ``choice()``: the letters after ``ANSWER:`` are exactly the ``expected`` letters."""

    type: Literal["choice"] = "choice"
    choices: int = Field(ge=1, le=1000, description="How many options the question offers (A, B, ...).")
    multiple_correct: bool = Field(
        default=False, description="Several letters may be answered (Inspect's multiple_correct)."
    )


class TestsGrader(_Spec):
    """Run the task's tests in a fresh root: the rollout's image plus its changes (see ``_image_grade``).

    The reward is 1.0 when the command exits 0 (and, with ``junit_xml``, every test it reports
    passed), else 0.0; with ``fail_to_pass`` or ``pass_to_pass`` (SWE-bench's lists), 1.0 exactly
    when every listed test passed in the JUnit XML.
    """

    type: Literal["tests"] = "tests"
    command: str = Field(min_length=1, max_length=100_000, description="Shell command run with /bin/sh -c.")
    junit_xml: str | None = Field(
        default=None,
        max_length=4096,
        description="Absolute path in the root of the JUnit XML the command writes; None: exit status only.",
    )
    fail_to_pass: list[str] = Field(
        default_factory=list, description="pytest ids that must pass (they failed before the fix)."
    )
    pass_to_pass: list[str] = Field(default_factory=list, description="pytest ids that must still pass.")
    timeout_s: float = Field(
        default=600.0, gt=0, le=24 * 3600, description="Wall-clock bound of the command."
    )

    @model_validator(mode="after")
    def _lists_need_junit(self) -> TestsGrader:
        if self.junit_xml is not None and not self.junit_xml.startswith("/"):
            raise ValueError(f"junit_xml {self.junit_xml!r} must be an absolute path in the image root")
        if (self.fail_to_pass or self.pass_to_pass) and self.junit_xml is None:
            raise ValueError(
                "fail_to_pass and pass_to_pass need junit_xml: the file that says which tests passed"
            )
        if any(not test or len(test) > 4096 for test in [*self.fail_to_pass, *self.pass_to_pass]):
            raise ValueError("a test id in fail_to_pass or pass_to_pass is empty or over 4096 characters")
        return self


GraderSpec = Annotated[
    VerifyGrader
    | ExactGrader
    | NormalizedGrader
    | NumericGrader
    | RegexGrader
    | MatchGrader
    | IncludesGrader
    | ChoiceGrader
    | TestsGrader,
    Field(discriminator="type"),
]
"""A row's ``grader``, tagged by ``type``."""


@dataclass(frozen=True)
class GradeResult:
    """A grade, or why there is none.

    Attributes:
        reward: The reward; ``None`` when the grader could not grade (see ``error``).
        detail: What the grader reports (the record's ``grader`` field, with ``name``).
        error: Why no reward could be given; ``None`` on success.
        masked: The environment asked that this sample be left out of training and of
            reward metrics (NeMo Gym's ``mask_sample``); its reward is kept as evidence.
        failure_kind: The environment's label for why the sample failed, if it gave one.
    """

    reward: float | None
    detail: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    masked: bool = False
    failure_kind: str | None = None

    def as_record(self) -> dict[str, Any]:
        """The ``grader`` field of a RolloutRecord."""
        out = dict(self.detail)
        if self.error is not None:
            out["error"] = self.error
        return out


def reward_problem(value: Any) -> str | None:
    """Why ``value`` cannot be a reward (not a number, not finite, beyond ``REWARD_LIMIT``), else ``None``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"reward {_shown(value)} is not a number"
    if isinstance(value, int) and abs(value) > REWARD_LIMIT:
        return f"reward {_shown(value)} is outside the accepted range -{REWARD_LIMIT:g}..{REWARD_LIMIT:g}"
    if not math.isfinite(value):
        return f"reward {value!r} is not a finite number"
    if abs(value) > REWARD_LIMIT:
        return f"reward {value!r} is outside the accepted range -{REWARD_LIMIT:g}..{REWARD_LIMIT:g}"
    return None


def checked_grade(grade: GradeResult) -> GradeResult:
    """``grade``, or a grader error naming its reward if that is no sensible number (``reward_problem``)."""
    if grade.reward is None:
        return grade
    problem = reward_problem(grade.reward)
    if problem is None:
        return grade
    return GradeResult(None, {**grade.detail, "rejected_reward": _shown(grade.reward)}, problem)


def grader_raised(name: str, exc: Exception) -> GradeResult:
    """The grader error of a grader that raised instead of grading (that row's ``grader_error``)."""
    return GradeResult(None, {"name": name}, f"the {name} grader raised {type(exc).__name__}: {_shown(exc)}")


def _shown(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    try:
        text = str(value) if isinstance(value, BaseException) else repr(value)
    except Exception:  # a value whose repr fails says at least what it is
        text = f"<{type(value).__name__}>"
    return text if len(text) <= _ERROR_LIMIT else text[: _ERROR_LIMIT - 3] + "..."


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
    if isinstance(spec, ExactGrader | NormalizedGrader):
        return _grade_match(spec, expected, answer)
    if isinstance(spec, NumericGrader):
        return _grade_numeric(spec, expected, answer)
    if isinstance(spec, RegexGrader):
        return _grade_regex(spec, expected, answer)
    if isinstance(spec, MatchGrader | IncludesGrader):
        return _grade_inspect_match(spec, expected, answer)
    if isinstance(spec, ChoiceGrader):
        return _grade_choice(spec, expected, answer)
    return GradeResult(None, {"name": spec.type}, f"{spec.type} is not a built-in grader")


def _grade_match(spec: ExactGrader | NormalizedGrader, expected: Any, answer: str) -> GradeResult:
    accepted = _accepted(expected)
    if accepted is None:
        return GradeResult(None, {"name": spec.type}, "expected must be a string or a list of strings")
    if isinstance(spec, ExactGrader):
        ok = answer.strip() in [a.strip() for a in accepted]
    else:
        ok = _normalise(answer) in [_normalise(a) for a in accepted]
    return GradeResult(1.0 if ok else 0.0, {"name": spec.type, "match": ok})


def _grade_inspect_match(spec: MatchGrader | IncludesGrader, expected: Any, answer: str) -> GradeResult:
    """Inspect's ``str_match_scorer``: correct when any accepted target matches."""
    accepted = _accepted(expected)
    if accepted is None:
        return GradeResult(None, {"name": spec.type}, "expected must be a string or a list of strings")
    if isinstance(spec, MatchGrader):
        ok = any(match_str(answer, t, spec.location, ignore_case=spec.ignore_case) for t in accepted)
    else:
        ok = any(includes(answer, t, ignore_case=spec.ignore_case) for t in accepted)
    detail: dict[str, Any] = {"name": spec.type, "match": ok}
    if not answer.strip():
        detail["reason"] = "no_response"  # Inspect's word for an empty completion, whatever its value
    return GradeResult(1.0 if ok else 0.0, detail)


def _grade_choice(spec: ChoiceGrader, expected: Any, answer: str) -> GradeResult:
    """Inspect's ``choice()`` on an unshuffled question (NOANSWER and INCORRECT both give 0.0)."""
    if not (
        isinstance(expected, str)
        or (isinstance(expected, list) and all(isinstance(x, str) for x in expected))
    ):
        return GradeResult(None, {"name": spec.type}, "expected must be a letter or a list of letters")
    try:
        wanted = sorted(choice_positions(expected, spec.choices))
    except ValueError as exc:
        return GradeResult(None, {"name": spec.type}, str(exc))
    selected = selected_positions(answer, spec.choices, multiple_correct=spec.multiple_correct)
    ok = selected == wanted
    detail: dict[str, Any] = {
        "name": spec.type,
        "match": ok,
        "selected": [answer_character(i) for i in selected],
    }
    if not ok and not selected:
        detail["reason"] = "no_response" if not answer.strip() else "invalid_response_format"
    return GradeResult(1.0 if ok else 0.0, detail)


def _grade_numeric(spec: NumericGrader, expected: Any, answer: str) -> GradeResult:
    name = spec.type
    try:
        if isinstance(expected, bool):
            raise TypeError
        target = float(expected.replace(",", "") if isinstance(expected, str) else expected)
    except (TypeError, ValueError, OverflowError):
        return GradeResult(None, {"name": name}, f"expected {_shown(expected)} is not a finite number")
    if not math.isfinite(target):
        return GradeResult(None, {"name": name}, f"expected {_shown(expected)} is not a finite number")
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


def _grade_regex(spec: RegexGrader, expected: Any, answer: str) -> GradeResult:
    import regex

    name = spec.type
    pattern = spec.pattern if spec.pattern is not None else expected
    if not isinstance(pattern, str):
        return GradeResult(None, {"name": name}, "regex grader needs 'pattern' or a string 'expected'")
    problem = check_pattern(pattern, ignore_case=spec.ignore_case)
    if problem is not None:
        return GradeResult(None, {"name": name}, problem)
    compiled = regex.compile(pattern, regex.IGNORECASE if spec.ignore_case else 0)
    try:
        # The matcher itself enforces the timeout, and releases the GIL while it runs.
        hit = compiled.search(answer[:_REGEX_TEXT_LIMIT], timeout=spec.timeout_s, concurrent=True)
    except TimeoutError:
        return GradeResult(None, {"name": name}, f"regex grader timed out after {spec.timeout_s:g} s")
    ok = hit is not None
    return GradeResult(1.0 if ok else 0.0, {"name": name, "match": ok})


def check_pattern(pattern: str, *, ignore_case: bool = False) -> str | None:
    """Why ``pattern`` cannot be a regex grader's pattern, or ``None`` when it compiles."""
    import regex

    if len(pattern) > _PATTERN_LIMIT:
        return f"pattern of {len(pattern)} characters is over the {_PATTERN_LIMIT} character limit"
    try:
        regex.compile(pattern, regex.IGNORECASE if ignore_case else 0)
    except (regex.error, RecursionError, OverflowError, ValueError) as exc:
        return f"bad pattern {pattern[:80]!r}: {exc}"
    return None


async def grade_builtin_off_loop(
    spec: GraderSpec, *, expected: Any, answer: str, timeout_s: float
) -> GradeResult:
    """``grade_builtin`` in a worker thread, bounded by ``timeout_s``; a timeout is a grader error.

    The regex grader bounds itself (see the module docstring); ``timeout_s`` is the
    backstop for the whole grade, so a grade that overruns ends in ``grader_error``
    rather than holding the rollout's record back.

    **Cancellation:** the caller stops waiting at once; the thread finishes its
    (bounded) grade on its own and its answer is dropped.
    """
    try:
        async with asyncio.timeout(timeout_s):
            return await asyncio.to_thread(grade_builtin, spec, expected=expected, answer=answer)
    except TimeoutError:
        return GradeResult(None, {"name": spec.type}, f"grader timed out after {timeout_s:g} s")


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
    url: str,
    *,
    token: str | None,
    payload: bytes,
    timeout_s: float,
    cookies: dict[str, str] | None = None,
    client: httpx.AsyncClient | None = None,
    sent: frozenset[str] = frozenset(),
) -> GradeResult:
    """POST ``payload`` (JSON bytes) to an environment's ``/verify`` and read its grade.

    Args:
        url: The environment's base URL (``/verify`` is appended).
        token: Bearer token of a bundled environment; ``None`` sends none.
        payload: The verify request body, already serialised (see ``rollcage.environments``).
        timeout_s: Deadline of the whole request, answer included.
        cookies: The rollout's session cookies, sent as a ``Cookie`` header.
        client: An open client to use; ``None``: a fresh one for this request.
        sent: Top-level keys of the request, not kept in the detail when echoed back.

    Returns:
        The grade (see ``parse_verify_answer``), or ``reward=None`` with an ``error``
        when the endpoint failed, answered non-2xx, or answered something unusable.

    **Cancellation:** the request is abandoned and the connection closed.
    """
    import httpx

    from rollcage.errors import HeaderValueError
    from rollcage.headers import cookie_header, header_value

    detail: dict[str, Any] = {"name": "verify"}
    headers = [(b"content-type", b"application/json")]
    try:
        if token:
            bearer = header_value(f"Bearer {token}", what="the environment's token")
            headers.append((b"authorization", bearer))
        if cookies:
            # The cookies come back in the sandbox's result: nothing guarantees they can be sent.
            headers.append((b"cookie", cookie_header(cookies)))
    except HeaderValueError as exc:
        return GradeResult(None, detail, f"verify was not asked: {exc}")
    own = client is None
    http = client if client is not None else httpx.AsyncClient(trust_env=False, follow_redirects=False)
    try:
        async with asyncio.timeout(timeout_s):
            request = http.build_request(
                "POST", url.rstrip("/") + "/verify", content=payload, headers=headers, timeout=timeout_s
            )
            response = await http.send(request, stream=True)
            try:
                body = await read_bounded(response, _VERIFY_ANSWER_LIMIT)
            finally:
                await response.aclose()
    except TimeoutError:
        return GradeResult(None, detail, f"verify gave no answer within {timeout_s:g} s")
    except httpx.HTTPError as exc:
        return GradeResult(None, detail, f"verify request failed: {type(exc).__name__}: {exc}")
    finally:
        if own:
            await http.aclose()
    if body is None:
        return GradeResult(None, detail, f"verify answer is over {_VERIFY_ANSWER_LIMIT} bytes")
    # Parsing a large answer is CPU work: not on the loop.
    return await asyncio.to_thread(parse_verify_answer, response.status_code, body, sent)


async def read_bounded(response: httpx.Response, limit: int) -> bytes | None:
    """A streamed response's body, or ``None`` once it grows past ``limit`` bytes.

    **Cancellation:** the read stops; the caller closes the response.
    """
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def parse_verify_answer(status: int, body: bytes, sent: frozenset[str] = frozenset()) -> GradeResult:
    """Read a ``/verify`` answer: NeMo Gym's ``BaseVerifyResponse`` or rollcage's ``{reward, detail}``.

    ``reward`` (a finite number) is required; ``mask_sample`` (bool) and
    ``failure_kind`` (string) are honoured when present. Any other top-level field
    the environment adds (NeMo Gym servers add their own metrics beside the echoed
    request; echoed keys named in ``sent`` are dropped) is kept in the detail,
    bounded in size. A non-2xx status, a body that
    is not a JSON object, or a field of the wrong type is a grader error.
    """
    import orjson

    detail: dict[str, Any] = {"name": "verify"}
    text = body[:300].decode("utf-8", "replace")
    if not 200 <= status < 300:
        return GradeResult(None, detail, f"verify answered HTTP {status}: {text}")
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        return GradeResult(None, detail, f"verify answered non-JSON: {text}")
    if not isinstance(answer, dict):
        return GradeResult(None, detail, f"verify answered a JSON {type(answer).__name__}, not an object")
    reward = answer.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        return GradeResult(None, detail, f"verify answered no finite numeric 'reward': {text}")
    masked = answer.get("mask_sample", False)
    if masked is None:
        masked = False
    if not isinstance(masked, bool):
        return GradeResult(None, detail, f"verify answered a non-boolean 'mask_sample': {masked!r}"[:300])
    failure_kind = answer.get("failure_kind")
    if failure_kind is not None and not isinstance(failure_kind, str):
        return GradeResult(
            None, detail, f"verify answered a non-string 'failure_kind': {failure_kind!r}"[:300]
        )
    extra = answer.get("detail")
    if isinstance(extra, dict):
        extra = {k: v for k, v in extra.items() if k != "name"}
        size = len(orjson.dumps(extra))
        if size <= _DETAIL_LIMIT:
            detail.update(extra)
        else:
            # The record is one line of rollouts.jsonl: an environment's essay stays in its own logs.
            detail["detail_cut"] = (
                f"the answer's detail was {size} bytes of JSON, over {_DETAIL_LIMIT}: left out "
                f"(its keys: {', '.join(k[:80] for k in sorted(extra)[:50])})"
            )
    others = {k: v for k, v in answer.items() if k not in _ANSWER_KEYS and k not in detail and k not in sent}
    if others:
        dumped = orjson.dumps(others)
        if len(dumped) <= _DETAIL_LIMIT:
            detail.update(others)
        else:
            detail["fields"] = sorted(others)[:100]
    if masked:
        detail["mask_sample"] = True
    kind = failure_kind[:_FAILURE_KIND_LIMIT] if failure_kind is not None else None
    if kind is not None:
        detail["failure_kind"] = kind
    return GradeResult(float(reward), detail, masked=masked, failure_kind=kind)
