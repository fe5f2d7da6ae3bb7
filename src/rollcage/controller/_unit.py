"""The controller's unit of work: supervise one prepared rollout, grade it, make its record.

``run_rollout(prepared, settings)`` is a plain function of its two serialisable
arguments (plus an optional stop event) and returns a ``RolloutRecord``; it is
what any backend executes, locally or as a remote task. Everything it needs that
the sandbox must never see (the reference answer, the grader, the verify token,
the row's verifier fields) travels in ``PreparedRollout.grading`` and
``PreparedRollout.environment``, in memory only: ``input.json`` is built from
``PreparedRollout.worker_input`` alone (plus the session cookies ``/seed_session``
set, which the agent's tool calls need).

With an environment, one attempt speaks NeMo Gym's resource-server protocol
(``rollcage.controller._nemo_gym``): seed the session, supervise the worker (whose
tool calls carry the session cookies), verify, close the session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from rollcage.controller._graders import (
    GradeResult,
    GraderSpec,
    checked_grade,
    grade_builtin_off_loop,
    grader_raised,
    read_workspace_files,
    verify_remote,
)
from rollcage.controller._health import assess, unobserved_health
from rollcage.controller._ids import rollout_id
from rollcage.controller._nemo_gym import (
    close_request,
    close_session,
    create_params_for,
    function_tools,
    run_request,
    seed_session,
    to_nemo_response,
)
from rollcage.errors import (
    BranchReplayError,
    ConfigError,
    DurableWriteError,
    ResumeRefusedError,
    RollcageError,
)
from rollcage.protocol import (
    BranchLink,
    FileSeal,
    HarnessEnvironment,
    HarnessSpec,
    ImageSandbox,
    ModelEndpoint,
    Outcome,
    ResourceEndpoint,
    ResumeLink,
    ResumeRequest,
    RolloutHealth,
    RolloutMetrics,
    RolloutRecord,
    SupervisorReceipt,
    WorkerInput,
    WorkerResult,
)
from rollcage.supervisor.config import BwrapSandbox

if TYPE_CHECKING:
    from rollcage.controller._dataset import Task
    from rollcage.supervisor import Supervised

__all__ = [
    "Endpoints",
    "EnvironmentEndpoint",
    "EnvironmentPlan",
    "GradingPlan",
    "PreparedRollout",
    "ResumeSource",
    "RolloutSettings",
    "SuperviseFn",
    "build_supervisor_config",
    "lay_out",
    "may_grade",
    "prepare_rollout",
    "record_without_result",
    "run_rollout",
    "set_aside",
    "set_aside_earlier",
    "task_change",
    "task_image",
]

logger = logging.getLogger("rollcage.controller")

_SESSION_TIMEOUT_S = 30.0
_RESUME_JOURNAL = "resume.jsonl"
_RESUME_CHAIN = 8
"""Earlier attempts remembered behind the latest one (a retry budget rarely reaches it)."""
_MAX_RESUME_JOURNAL_BYTES = 1 << 30
"""The largest earlier journal resumed from (a journal is O(new content) per boundary: far below)."""
# A built-in grade is linear in the answer (regex bounds itself): this only backstops it.
_BUILTIN_GRADE_TIMEOUT_S = 30.0
_IMAGE_GRADE_SLACK_S = 300.0
"""Beyond a tests grader's timeout_s: making its fresh root and reading its JUnit file."""
_DIFF_TIMEOUT_S = 600.0
"""The longest workspace.diff may take (git in a cage on a large repository, or a large file-level diff)."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GradingPlan(_Model):
    """Controller-only grading state of one rollout; never written into the rollout directory."""

    grader: Any = Field(description="The GraderSpec to apply.")
    expected: Any = Field(default=None, description="The row's reference answer.")
    verify_url: str | None = Field(default=None, description="Environment base URL for 'verify'.")
    files: list[str] = Field(default_factory=list, description="Workspace files sent to '/verify'.")


class EnvironmentPlan(_Model):
    """The rollout's environment as the controller speaks to it (NeMo Gym's protocol); never in input.json."""

    url: str = Field(description="The environment's base URL, as the host reaches it.")
    token: str | None = Field(
        default=None, description="Bearer token of a bundled environment's own endpoints."
    )
    run_request: dict[str, Any] = Field(
        description="NeMo Gym's run request: the row's verifier fields and its responses_create_params; "
        "the body of /seed_session and the base of /verify's (/close_session takes NeMo Gym's close body)."
    )
    timeout_s: float = Field(default=_SESSION_TIMEOUT_S, gt=0, description="Deadline of seed and close.")


class ResumeSource(_Model):
    """The earlier attempt a new one is asked to continue (``--resume-rollouts``)."""

    rollout_id: str = Field(description="Id of the earlier attempt (its journal's start record says it).")
    directory: str = Field(description="Its directory, kept intact as evidence; its journal is copied.")
    earlier: list[ResumeSource] = Field(
        default_factory=list,
        description="Attempts before it, latest first: tried in turn when its journal cannot be resumed "
        "from (it was itself resumed, and killed before its replay was over).",
    )
    upto: int | None = Field(
        default=None, ge=1, description="A branch's prefix: stage only the journal's records up to this seq."
    )
    strict: bool = Field(
        default=False,
        description="A branch: the model settings may differ from the earlier attempt's, and a journal that "
        "cannot be replayed ends the attempt as infra_failure instead of a fresh start (rollcage.branch).",
    )

    def chain(self) -> list[ResumeSource]:
        """This attempt and the ones before it, latest first, each without its own ``earlier``."""
        return [item.model_copy(update={"earlier": []}) for item in (self, *self.earlier)]

    def then(self, rollout_id: str, directory: str) -> ResumeSource:
        """The source for the attempt after ``rollout_id``, which was asked to continue this one."""
        return ResumeSource(rollout_id=rollout_id, directory=directory, earlier=self.chain()[:_RESUME_CHAIN])


class PreparedRollout(_Model):
    """Everything one attempt needs: the sandbox's input and the controller's grading state."""

    rollout_id: str = Field(description="Id of this attempt.")
    task_id: str = Field(description="The dataset row's id.")
    task_index: int | None = Field(
        default=None, ge=0, description="The task's dataset row (NeMo Gym's _ng_task_index; Task.index)."
    )
    sample: int = Field(ge=0, description="Which sample of the task.")
    try_index: int = Field(ge=0, description="Infrastructure retry number of this sample.")
    rollout_dir: str = Field(description="Where the rollout directory is laid out (must not exist yet).")
    worker_input: WorkerInput = Field(description="input.json, with endpoints as the host sees them.")
    grading: GradingPlan | None = Field(default=None, description="How to grade; None: not graded.")
    environment: EnvironmentPlan | None = Field(
        default=None, description="The environment's session protocol; None: the row has no environment."
    )
    resume_from: ResumeSource | None = Field(
        default=None, description="Continue this earlier attempt from its journal; None: start fresh."
    )
    node_image: str | None = Field(
        default=None,
        description=(
            "A task image to prepare in the store of the node the attempt runs on, which then sets "
            "worker_input.image (the Ray backend); None: worker_input.image is already set, or none."
        ),
    )
    branched_from: BranchLink | None = Field(
        default=None, description="A branch's source (rollcage.branch); the record carries it."
    )


class RolloutSettings(_Model):
    """How every rollout of a run is supervised and graded."""

    deadline_s: float = Field(default=600.0, gt=0, description="Wall-clock deadline of one rollout.")
    grace_s: float = Field(default=5.0, ge=0, description="SIGTERM → SIGKILL grace.")
    sandbox: Literal["bwrap", "none"] = Field(default="bwrap", description="How the worker is contained.")
    api_key_env: str | None = Field(
        default=None, description="Environment variable with the model API key, added by the egress proxy."
    )
    grade_timeouts: bool = Field(default=False, description="Grade the result of a rollout that timed out.")
    input_mode: int = Field(default=0o644, description="File mode of input.json.")
    bwrap: BwrapSandbox = Field(
        default_factory=BwrapSandbox, description="Limits and per-rollout budgets of the bwrap sandbox."
    )
    max_capture_bytes: int | None = Field(
        default=256 * 1024 * 1024,
        ge=64 * 1024,
        description=(
            "Budget of a rollout's model_capture.jsonl; past it the rollout ends as agent_error; None: none."
        ),
    )


class SuperviseFn(Protocol):
    """The supervisor's entry point: ``await supervise_rollout(rollout_dir, config, stop=...)``."""

    def __call__(
        self, rollout_dir: Path, config: Any, *, stop: asyncio.Event | None = None
    ) -> Awaitable[Supervised]:
        """Supervise one prepared rollout directory; return its receipt and its result, parsed once."""
        ...


@dataclass(frozen=True)
class EnvironmentEndpoint:
    """A running environment as the host reaches it.

    Attributes:
        url: Base URL.
        token: Bearer token of its ``/verify`` (bundled environments); ``None``: none.
        verify_files: Default workspace files for ``/verify``.
    """

    url: str
    token: str | None = None
    verify_files: tuple[str, ...] = ()


@dataclass(frozen=True)
class Endpoints:
    """The model and environments of a run, as the host reaches them.

    Attributes:
        model: The model endpoint with the run's defaults (rows override all but URL and name).
        environments: Running environments by resource key.
        harness: The run's harness, for rows that name none (``None``: the builtin loop).
        harness_envs: The checked environment of each harness kind the run uses (``nooa``,
            ``command``; ``None``: a command with the system's programs only).
    """

    model: ModelEndpoint
    environments: dict[str, EnvironmentEndpoint] = field(default_factory=dict)
    harness: HarnessSpec | None = None
    harness_envs: dict[str, HarnessEnvironment | None] = field(default_factory=dict)
    images: dict[str, ImageSandbox] = field(default_factory=dict)
    """The run's task images, prepared and leased, by reference."""
    image: str | None = None
    """The run's image for rows whose sandbox names none (``--image``)."""
    images_on_nodes: bool = False
    """Images are prepared where each rollout runs (the Ray backend), not in ``images``."""


def task_image(task: Task, default: str | None) -> str | None:
    """The task image ``task`` runs in: its row's ``sandbox.image``, else the run's, else none."""
    return task.row.sandbox.image if task.row.sandbox is not None else default


def _image_of(task: Task, endpoints: Endpoints) -> ImageSandbox | None:
    ref = task_image(task, endpoints.image)
    if ref is None:
        return None
    if ref not in endpoints.images:
        raise ConfigError(f"task {task.id}: its image {ref} was not prepared for the run")
    return endpoints.images[ref]


def prepare_rollout(
    task: Task, sample: int, try_index: int, *, out_dir: Path, endpoints: Endpoints
) -> PreparedRollout:
    """Build one attempt of ``task``: its id, directory, ``input.json`` content and grading plan.

    Raises:
        ConfigError: The environment the task names is not running.
    """
    rid = rollout_id(task.id, sample, try_index)
    row = task.row
    overrides = {k: v for k, v in row.model.model_dump(exclude_none=True).items() if k != "sampling"}
    model = endpoints.model.model_copy(update=overrides)
    if row.model.sampling is not None:
        model = model.model_copy(update={"sampling": row.model.sampling})
    resources: dict[str, ResourceEndpoint] = {}
    env_endpoint: EnvironmentEndpoint | None = None
    environment: EnvironmentPlan | None = None
    if task.environment is not None:
        env_endpoint = endpoints.environments[task.environment.key]
        resources[task.environment.key] = ResourceEndpoint(base_url=env_endpoint.url)
        params = task.create_params
        if params is None:
            params = create_params_for(
                input=row.input,
                instructions=row.instructions,
                tools=function_tools(list(task.tools), codeact=row.agent.mode == "codeact"),
                model=model.model,
                sampling=model.sampling.model_dump(),
            )
        environment = EnvironmentPlan(
            url=env_endpoint.url, token=env_endpoint.token, run_request=run_request(params, task.verifier)
        )
    harness = row.agent.harness or endpoints.harness
    agent = row.agent if harness is row.agent.harness else row.agent.model_copy(update={"harness": harness})
    harness_env = endpoints.harness_envs.get(harness.type) if harness is not None else None
    worker_input = WorkerInput(
        rollout_id=rid,
        task_id=task.id,
        input=row.input,
        instructions=row.instructions,
        model=model,
        agent=agent,
        executor=row.executor,
        tools=list(task.tools),
        resources=resources,
        harness_env=harness_env,
        image=None if endpoints.images_on_nodes else _image_of(task, endpoints),
    )
    grading: GradingPlan | None = None
    if task.grader is not None:
        files: list[str] = []
        if task.grader.type == "verify" and env_endpoint is not None:
            files = (
                list(task.grader.files) if task.grader.files is not None else list(env_endpoint.verify_files)
            )
        grading = GradingPlan(
            grader=task.grader,
            expected=row.expected,
            verify_url=env_endpoint.url if env_endpoint is not None else None,
            files=files,
        )
    return PreparedRollout(
        rollout_id=rid,
        task_id=task.id,
        task_index=task.index,
        sample=sample,
        try_index=try_index,
        rollout_dir=str(out_dir / "rollouts" / rid),
        worker_input=worker_input,
        grading=grading,
        environment=environment,
        node_image=task_image(task, endpoints.image) if endpoints.images_on_nodes else None,
    )


def may_grade(outcome: Outcome, *, grade_timeouts: bool) -> bool:
    """Whether an outcome allows grading (docs/reference/outcomes.md; timeouts only when asked)."""
    return outcome in ("completed", "agent_error") or (outcome == "timeout" and grade_timeouts)


def lay_out(
    directory: Path, worker_input: WorkerInput, mode: int, resume: ResumeSource | None = None
) -> ResumeLink | None:
    """Create one attempt's rollout directory: ``workspace/`` and ``input.json`` (blocking).

    Args:
        directory: The rollout directory; it must not exist yet (one directory per attempt).
        worker_input: What the worker is given.
        mode: File mode of ``input.json``.
        resume: The earlier attempt to continue: its journal is staged as ``resume.jsonl``.

    Returns:
        With ``resume``, the attempt's link to the earlier one: ``resumed`` False with
        the reason when its journal cannot be resumed from (the attempt then starts
        fresh), else provisional (the worker says whether the replay held).
    """
    from rollcage.durable import publish_json
    from rollcage.supervisor.fds import retry_on_emfile

    directory.mkdir(parents=True, exist_ok=False)
    (directory / "workspace").mkdir()
    link: ResumeLink | None = None
    harness = worker_input.agent.harness
    if resume is not None and harness is not None and harness.type != "builtin":
        # A harness is a program of its own: nothing can make it replay recorded answers.
        link = _not_resumed(
            resume, f"{harness.type} harness rollouts are not resumed (a harness cannot replay)"
        )
    elif resume is not None:
        link = _stage_first_usable(directory, resume, worker_input)
        if link.reason is None:
            request = ResumeRequest(previous_rollout_id=link.previous_rollout_id, strict=resume.strict)
            worker_input = worker_input.model_copy(update={"resume": request})
        elif resume.strict:
            # A branch never starts fresh: that would not be its source's prefix.
            raise BranchReplayError(f"the branch's prefix cannot be staged: {link.reason}")
    # Another rollout may hold every descriptor for a moment: wait for one rather than fail this one.
    retry_on_emfile(publish_json, directory / "input.json", worker_input, mode=mode)
    return link


def _stage_first_usable(directory: Path, resume: ResumeSource, worker_input: WorkerInput) -> ResumeLink:
    """Stage the latest earlier journal that can be resumed from; else the latest one's reason.

    An attempt a killed controller left half-prepared (no ``input.json``: it never ran) is passed
    over, and named as such only when no attempt that ran is there to say why it was not resumed.
    """
    first: ResumeLink | None = None
    unprepared: ResumeLink | None = None
    for source in resume.chain():
        if not os.path.lexists(Path(source.directory) / "input.json"):
            unprepared = unprepared or _not_resumed(
                source,
                f"the earlier attempt in {source.directory} was interrupted while it was being prepared "
                "(it has no input.json, so it never ran): there is nothing to resume from it",
            )
            continue
        link = _stage_resume(directory, source, worker_input)
        if link.reason is None:
            return link
        first = first or link
    found = first or unprepared
    assert found is not None
    return found


def _stage_resume(directory: Path, resume: ResumeSource, worker_input: WorkerInput) -> ResumeLink:
    """Copy the earlier attempt's journal in as ``resume.jsonl`` and validate the copy (blocking).

    The journal was written inside a sandbox: it is read once, bounded, from a
    regular file, and what is validated is the copy the worker will read. The
    earlier attempt must have been given the same task (its ``input.json``, the
    controller's own, says so): responses to another prompt are not replayed. The
    earlier directory is left as it was.
    """
    from rollcage.durable import read_bounded
    from rollcage.resume import load_replay

    staged = directory / _RESUME_JOURNAL
    previous = Path(resume.directory) / "checkpoint.jsonl"
    link = ResumeLink(previous_rollout_id=resume.rollout_id, previous_dir=resume.directory, resumed=False)
    try:
        changed = _changed_task(Path(resume.directory) / "input.json", worker_input, branch=resume.strict)
        if changed is not None:
            raise ResumeRefusedError(f"the task changed since the earlier attempt ({changed})")
        if previous.is_symlink():
            # The journal is a file its worker appended to, never a link: following one could copy
            # any file the controller can read into a directory the next worker reads.
            raise ResumeRefusedError(f"the earlier attempt's journal {previous} is a symbolic link")
        data = read_bounded(previous, limit=_MAX_RESUME_JOURNAL_BYTES)
        if resume.upto is not None:
            # Records are numbered from 1, a line each (rollcage.durable): the prefix is the first lines.
            data = b"".join(data.splitlines(keepends=True)[: resume.upto])
        staged.write_bytes(data)
        plan = load_replay(staged, resume.rollout_id)
    except OSError as exc:
        reason = f"the earlier attempt's journal {previous} cannot be read: {exc.strerror or exc}"
    except RollcageError as exc:
        reason = str(exc)
    else:
        return link.model_copy(update={"boundary": plan.boundary})
    with contextlib.suppress(OSError):
        staged.unlink()
    logger.info("not resuming %s from %s, starting fresh: %s", directory.name, resume.rollout_id, reason)
    return link.model_copy(update={"reason": reason[:2000]})


_PER_ATTEMPT = {"rollout_id": True, "model_cookies": True, "resource_cookies": True, "resume": True}
"""What differs between attempts of one task by design (the endpoints' addresses too, below)."""


def task_change(previous_input: Path, worker_input: WorkerInput, *, branch: bool = False) -> str | None:
    """The first field in which an earlier attempt's task (its ``input.json``) differs from this one's.

    ``None``: the same task. With ``branch``, the model and its settings may differ (blocking).

    Raises:
        ResumeRefusedError: The earlier ``input.json`` cannot be read.
    """
    return _changed_task(previous_input, worker_input, branch=branch)


def _changed_task(previous_input: Path, worker_input: WorkerInput, *, branch: bool = False) -> str | None:
    """The first field in which the earlier attempt's task differs from this one's; None: the same task."""
    from rollcage.durable import read_bounded

    try:
        earlier = WorkerInput.model_validate_json(read_bounded(previous_input, limit=64 * 1024 * 1024))
    except (OSError, ValueError) as exc:
        # Not a changed task: an input that cannot be compared (the reason says which).
        raise ResumeRefusedError(f"the earlier attempt's input.json cannot be read: {exc}") from exc

    def task(value: WorkerInput) -> dict[str, Any]:
        data = value.model_dump(mode="json", exclude=_PER_ATTEMPT)
        # A rerun serves the same model on another port; the model's name and settings must match.
        data["model"] = {k: v for k, v in data["model"].items() if k not in ("base_url", "uds")}
        if branch:
            # A branch may continue with another model or sampling: the replayed prefix is checked instead.
            data.pop("model")
        data["resources"] = {k: {**v, "base_url": None, "uds": None} for k, v in data["resources"].items()}
        return data

    before, now = task(earlier), task(worker_input)
    return next((f"field {key!r}" for key in now if before.get(key) != now[key]), None)


def _not_resumed(resume: ResumeSource, reason: str) -> ResumeLink:
    return ResumeLink(
        previous_rollout_id=resume.rollout_id, previous_dir=resume.directory, resumed=False, reason=reason
    )


def _resume_link(link: ResumeLink | None, result: WorkerResult | None) -> ResumeLink | None:
    """The final link: what the worker did with a journal it was given."""
    if link is None or link.reason is not None:
        return link
    if result is None:
        return link.model_copy(
            update={"reason": "the attempt left no valid result: it is unknown how far it got"}
        )
    resumed = result.trajectory.resumed_from
    if resumed is None:
        return link.model_copy(
            update={
                "reason": result.trajectory.resume_refused or "the worker did not resume",
                "boundary": None,
            }
        )
    return link.model_copy(
        update={
            "resumed": True,
            "boundary": resumed.boundary,
            "replayed_model_calls": len(resumed.replayed_model_calls),
        }
    )


def _verify_payload(
    prepared: PreparedRollout,
    plan: EnvironmentPlan,
    result: WorkerResult,
    outcome: Outcome,
    files: dict[str, str],
) -> tuple[bytes, frozenset[str]]:
    """The /verify body and its top-level keys: rollcage's fields, the row's verifier fields over them,
    NeMo Gym's over all."""
    import orjson

    params = plan.run_request.get("responses_create_params") or {}
    extras: dict[str, Any] = {
        "task_id": prepared.task_id,
        "rollout_id": prepared.rollout_id,
        "outcome": outcome,
        "output_text": result.response.output_text if result.response is not None else "",
    }
    if files:
        extras["workspace_files"] = files
    body = {**extras, **plan.run_request, "response": to_nemo_response(result, params)}
    return orjson.dumps(body), frozenset(body)


async def _grade(
    prepared: PreparedRollout, result: WorkerResult, outcome: Outcome, client: Any
) -> GradeResult:
    plan = prepared.grading
    assert plan is not None
    spec: GraderSpec = plan.grader
    answer = result.response.output_text if result.response is not None else ""
    if spec.type == "tests":
        from rollcage.controller._image_grade import grade_tests

        # Bounded by the grader's own timeout (the cage is killed at it); this backstops the rest
        # (copying the changes, mounting, reading the JUnit file).
        try:
            async with asyncio.timeout(spec.timeout_s + _IMAGE_GRADE_SLACK_S):
                return await grade_tests(spec, Path(prepared.rollout_dir))
        except TimeoutError:
            return GradeResult(
                None, {"name": "tests"}, f"the tests grader did not finish within {spec.timeout_s:g} s"
            )
    if spec.type != "verify":
        backstop = _BUILTIN_GRADE_TIMEOUT_S + (spec.timeout_s if spec.type == "regex" else 0.0)
        return await grade_builtin_off_loop(spec, expected=plan.expected, answer=answer, timeout_s=backstop)
    env = prepared.environment
    if env is None:
        return GradeResult(None, {"name": "verify"}, "no environment to verify against")
    workspace = os.path.join(prepared.rollout_dir, "workspace")
    files = await asyncio.to_thread(read_workspace_files, workspace, plan.files) if plan.files else {}
    # Serialising a large result is CPU work: not on the loop.
    payload, sent = await asyncio.to_thread(_verify_payload, prepared, env, result, outcome, files)
    return await verify_remote(
        env.url,
        client=client,
        token=env.token,
        payload=payload,
        timeout_s=spec.timeout_s,
        cookies=result.resource_cookies,
        sent=sent,
    )


async def _write_diff(rollout_dir: Path) -> FileSeal | None:
    """The rollout's ``workspace.diff`` (evidence only: whatever happens, the outcome and grade stand).

    Returns its seal, for the record (see ``rollcage.controller._workspace_diff``); ``None``: none
    was published.
    """
    from rollcage.controller._workspace_diff import write_workspace_diff

    try:
        async with asyncio.timeout(_DIFF_TIMEOUT_S):
            return (await write_workspace_diff(rollout_dir)).seal
    except TimeoutError:
        logger.warning(
            "rollout %s: workspace.diff took over %g s; left out", rollout_dir.name, _DIFF_TIMEOUT_S
        )
        return None


async def _seed(prepared: PreparedRollout, client: Any) -> PreparedRollout:
    """Seed the environment's session; the cookies it sets join ``input.json``'s resource cookies."""
    import orjson

    env = prepared.environment
    assert env is not None
    body = await asyncio.to_thread(orjson.dumps, env.run_request)
    cookies = await seed_session(client, env.url, token=env.token, body=body, timeout_s=env.timeout_s)
    if not cookies:
        return prepared
    inp = prepared.worker_input
    worker_input = inp.model_copy(update={"resource_cookies": {**inp.resource_cookies, **cookies}})
    return prepared.model_copy(update={"worker_input": worker_input})


async def _close(prepared: PreparedRollout, client: Any, cookies: dict[str, str]) -> str | None:
    import orjson

    env = prepared.environment
    assert env is not None
    body = orjson.dumps(
        close_request(
            rollout_id=prepared.rollout_id,
            task_id=prepared.task_id,
            sample=prepared.sample,
            attempt=prepared.try_index,
        )
    )
    problem = await close_session(
        client, env.url, token=env.token, body=body, cookies=cookies, timeout_s=env.timeout_s
    )
    if problem is not None:
        logger.warning("rollout %s: /close_session on %s failed: %s", prepared.rollout_id, env.url, problem)
    return problem


def record_without_result(
    prepared: PreparedRollout, settings: RolloutSettings, reason: BaseException, started: float, *, where: str
) -> RolloutRecord:
    """The ``infra_failure`` record of an attempt the machinery could not run (no result, no grading).

    Args:
        prepared: The attempt.
        settings: Its settings (the receipt repeats the deadline and sandbox).
        reason: What failed.
        started: Unix time the attempt started.
        where: Whose machinery failed, for the reason (``"the controller"``, ``"the Ray backend"``).
    """
    receipt = _failed_receipt(prepared, settings, reason, started, where=where)
    metrics = RolloutMetrics(duration_s=receipt.duration_s)
    return _record(prepared, receipt, unobserved_health(f"{where} could not run the rollout"), metrics)


def _record(
    prepared: PreparedRollout,
    receipt: SupervisorReceipt,
    health: RolloutHealth,
    metrics: RolloutMetrics,
    **grading: Any,
) -> RolloutRecord:
    """The record of one attempt; ``grading``: the grade's fields (none: not graded)."""
    return RolloutRecord(
        rollout_id=prepared.rollout_id,
        task_id=prepared.task_id,
        task_index=prepared.task_index,
        sample=prepared.sample,
        try_index=prepared.try_index,
        outcome=receipt.outcome,
        **{"graded": False, "reward": None, **grading},
        receipt=receipt,
        metrics=metrics,
        health=health,
        rollout_dir=prepared.rollout_dir,
        branched_from=prepared.branched_from,
    )


def _failed_receipt(
    prepared: PreparedRollout, settings: RolloutSettings, exc: BaseException, started: float, *, where: str
) -> SupervisorReceipt:
    ended = time.time()
    return SupervisorReceipt(
        rollout_id=prepared.rollout_id,
        outcome="infra_failure",
        outcome_reason=f"{where} could not run the rollout: {type(exc).__name__}: {exc}"[:2000],
        sandbox=settings.sandbox,
        deadline_s=settings.deadline_s,
        grace_s=settings.grace_s,
        deadline_fired=False,
        stop_requested=False,
        started_at=started,
        ended_at=ended,
        duration_s=ended - started,
        cleanup_confirmed=False,
        result_present=False,
        result_valid=False,
    )


def build_supervisor_config(settings: RolloutSettings) -> Any:
    """The ``rollcage.supervisor.SupervisorConfig`` for ``settings`` (imported now, lazily)."""
    from rollcage.supervisor import NoSandbox, ProxyConfig, SupervisorConfig

    # How the worker starts is the one bwrap setting --sandbox none has too.
    sandbox = (
        settings.bwrap if settings.sandbox == "bwrap" else NoSandbox(worker_start=settings.bwrap.worker_start)
    )
    return SupervisorConfig(
        deadline_s=settings.deadline_s,
        grace_s=settings.grace_s,
        sandbox=sandbox,
        api_key_env=settings.api_key_env,
        proxy=ProxyConfig(max_capture_bytes=settings.max_capture_bytes),
    )


def _default_supervise() -> SuperviseFn:
    from rollcage.supervisor import supervise_rollout

    fn: SuperviseFn = supervise_rollout
    return fn


async def run_rollout(
    prepared: PreparedRollout,
    settings: RolloutSettings,
    *,
    stop: asyncio.Event | None = None,
    supervise: SuperviseFn | None = None,
    supervisor_config: Any = None,
) -> RolloutRecord:
    """Run one attempt end to end and return its record (not yet appended anywhere).

    Lays out the rollout directory (``input.json`` from ``worker_input`` only, an
    empty ``workspace/``), supervises it, grades the result the supervisor parsed
    on this side when the outcome allows, computes the attempt's health and
    metrics once, and builds the record (holding the parsed result, see
    ``RolloutRecord.result``). A failure of the machinery itself (the directory
    cannot be made, the supervisor raises) becomes an ``infra_failure`` record with
    the reason, so it is retried like any other infrastructure failure.

    Args:
        prepared: The attempt (see ``prepare_rollout``); its directory must not exist.
        settings: Supervision and grading settings.
        stop: Set to stop the rollout early (its outcome becomes ``cancelled``).
        supervise: The supervisor entry point; default ``rollcage.supervisor.supervise``.
        supervisor_config: Its config; default built from ``settings``.

    **Cancellation:** cancelling the call cancels the supervisor, which stops and
    reaps the worker (see ``rollcage.supervisor``); no record is returned, so the
    attempt is rerun on resume. A session already seeded is not closed (the
    environment's own session limits reclaim it); the rerun seeds a new one.
    """
    if prepared.environment is None:
        return await _run_and_grade(prepared, settings, stop, supervise, supervisor_config, None)
    from http.cookiejar import CookieJar, DefaultCookiePolicy

    import httpx

    # The session is the rollout's cookies, sent explicitly: a client jar that accepts
    # nothing, so no cookie of one call leaks into the next.
    jar = CookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))
    async with httpx.AsyncClient(trust_env=False, follow_redirects=False, cookies=jar) as client:
        return await _run_and_grade(prepared, settings, stop, supervise, supervisor_config, client)


async def _run_and_grade(
    prepared: PreparedRollout,
    settings: RolloutSettings,
    stop: asyncio.Event | None,
    supervise: SuperviseFn | None,
    supervisor_config: Any,
    client: Any,
) -> RolloutRecord:
    rollout_dir = Path(prepared.rollout_dir)
    started = time.time()
    seeded = False
    link: ResumeLink | None = None
    result: WorkerResult | None = None
    try:
        resume = prepared.resume_from
        if client is not None:
            if resume is not None:
                # The earlier attempt's session was closed with it; a replay against a new one would
                # not see the state its tool calls built.
                link = _not_resumed(
                    resume, "rows with an environment are not resumed (the earlier session was closed)"
                )
                resume = None
            prepared = await _seed(prepared, client)
            seeded = True
        staged = await asyncio.to_thread(
            lay_out, rollout_dir, prepared.worker_input, settings.input_mode, resume
        )
        link = staged if staged is not None else link
        if supervise is None:
            fn = _default_supervise()
            config = supervisor_config if supervisor_config is not None else build_supervisor_config(settings)
        else:
            fn, config = supervise, supervisor_config
        receipt, result = await fn(rollout_dir, config, stop=stop)
    except (RollcageError, OSError, ImportError, ValueError, TypeError, RuntimeError) as exc:
        logger.warning("rollout %s: infrastructure failure in the controller: %r", prepared.rollout_id, exc)
        receipt = _failed_receipt(prepared, settings, exc, started, where="the controller")
    if not receipt.result_valid:
        result = None
    diff_seal = await _write_diff(rollout_dir)
    link = _resume_link(link, result)
    if prepared.resume_from is not None:
        receipt = receipt.model_copy(update={"resumed_from": prepared.resume_from.rollout_id})
    graded = False
    masked = False
    failure_kind: str | None = None
    reward: float | None = None
    grader: dict[str, Any] | None = None
    if prepared.grading is not None and may_grade(receipt.outcome, grade_timeouts=settings.grade_timeouts):
        if receipt.budget_exceeded is not None:
            # The rollout was ended for going over a budget: a failure of the policy's, whatever answer it
            # left (or none, when the kernel killed the worker). Never "not graded": that would reward
            # blowing a budget with a skipped sample instead of a zero.
            spec_name = prepared.grading.grader.type
            grade = GradeResult(0.0, {"name": spec_name, "budget_exceeded": receipt.budget_exceeded})
        elif result is None:
            grade = GradeResult(None, {"name": prepared.grading.grader.type}, "no valid result.json to grade")
        else:
            try:
                grade = await _grade(prepared, result, receipt.outcome, client)
            except Exception as exc:  # any grader, built-in or an environment's: this row's grader_error
                logger.warning("rollout %s: the grader raised: %r", prepared.rollout_id, exc)
                grade = grader_raised(prepared.grading.grader.type, exc)
        grade = checked_grade(grade)
        grader = grade.as_record()
        graded = grade.reward is not None
        reward = grade.reward
        masked = grade.masked
        failure_kind = grade.failure_kind
    if seeded:
        cookies = result.resource_cookies if result is not None else prepared.worker_input.resource_cookies
        problem = await _close(prepared, client, cookies)
        if problem is not None and grader is not None:
            grader["close_session_error"] = problem
    # Computed once, here, from the result already in memory; a resumed run reads them from the record.
    health, metrics = await asyncio.to_thread(
        assess, result, receipt, grader_failed=grader is not None and "error" in grader
    )
    return _record(
        prepared,
        receipt,
        health,
        metrics,
        graded=graded,
        reward=reward,
        masked=masked,
        failure_kind=failure_kind,
        grader=grader,
        termination_reason=result.termination_reason if result is not None else None,
        resume=link,
        workspace_diff=diff_seal,
    ).with_result(result)


_SET_ASIDE = re.compile(r"\.(\d{8}T\d{6}Z)(?:\.(\d+))?$")
"""The suffix :func:`set_aside` gives a directory it moves: ``.STAMP`` or ``.STAMP.N``."""


def set_aside_earlier(rollout: str, attic: Path) -> list[Path]:
    """The directories of attempt ``rollout`` that killed runs set aside in ``attic``, latest first.

    Blocking. Each run that found the attempt unfinished set its directory aside before staging it
    again: a run killed while staging leaves one that never ran, and the one before it
    holds the journal to continue from.
    """
    found: list[tuple[str, int, Path]] = []
    try:
        with os.scandir(attic) as scan:
            entries = list(scan)
    except OSError:
        return []
    for entry in entries:
        if not entry.name.startswith(f"{rollout}."):
            continue
        match = _SET_ASIDE.fullmatch(entry.name[len(rollout) :])
        if match is not None and entry.is_dir(follow_symlinks=False):
            found.append((match.group(1), int(match.group(2) or 0), Path(entry.path)))
    return [path for _, _, path in sorted(found, reverse=True)]


def set_aside(rollout_dir: Path, attic: Path) -> Path | None:
    """Move a stale rollout directory (left by a killed run, no record) into ``attic`` (blocking).

    Returns:
        Its new path, or ``None`` when there was nothing to move.

    Raises:
        DurableWriteError: it could not be moved (it is left where it is, untouched).
    """
    from rollcage.durable import sweep_temp_artifacts

    if not rollout_dir.exists():
        return None
    # A controller killed while publishing left temporary files: evidence of nothing, not worth keeping.
    sweep_temp_artifacts(rollout_dir)
    attic.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = attic / f"{rollout_dir.name}.{stamp}"
    n = 0
    while target.exists():
        n += 1
        target = attic / f"{rollout_dir.name}.{stamp}.{n}"
    try:
        os.replace(rollout_dir, target)
    except OSError as error:
        # Never delete it instead: the directory holds the journal a retry resumes from, and the
        # evidence of what the killed run did (and, under a mount point, maybe not only its own files).
        raise DurableWriteError(
            f"cannot set aside the unfinished rollout directory {rollout_dir} into {attic} "
            f"({error.strerror or error}); it is kept as it is: move it out of the run directory "
            "by hand, then run again"
        ) from error
    return target
