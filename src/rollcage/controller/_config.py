"""The run's configuration: one canonical, validated shape, built by the CLI or by code."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rollcage.controller._unit import RolloutSettings
from rollcage.errors import ConfigError, RollcageError
from rollcage.protocol import HarnessSpec
from rollcage.supervisor.config import BwrapSandbox

if TYPE_CHECKING:
    from rollcage.controller._backend import Backend

__all__ = [
    "BackendConfig",
    "EmbeddedPolicyConfig",
    "LocalBackendConfig",
    "ModelEndpointConfig",
    "ModelSource",
    "RayBackendConfig",
    "RunConfig",
    "api_key_problem",
    "model_url_problem",
]


def model_url_problem(url: str) -> str | None:
    """Why no rollout could reach a model at ``url``, or ``None``: it must be an http(s) URL with a host.

    The one check of a model URL, for ``rollcage run --model`` and ``rollcage.collect(model=...)`` alike.
    """
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - reading it validates it
    except ValueError as exc:
        return f"{url!r} is not a URL ({exc})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{url!r} is not an http(s) URL with a host, e.g. http://127.0.0.1:8000/v1"
    return None


def api_key_problem(name: str) -> str | None:
    """Why the API key variable ``name`` cannot serve this process's rollouts, or ``None``.

    Unset or empty, or a value no HTTP header can carry (a newline, a character beyond ISO-8859-1).

    Checked where rollouts are supervised by this process (the local backend); with Ray the
    variable may be set on the nodes instead.
    """
    import os

    from rollcage.errors import HeaderValueError
    from rollcage.headers import header_value

    value = os.environ.get(name)
    if not value:
        return f"{name} is not set (or empty) in this environment; export it, or drop the API key variable"
    try:
        header_value(f"Bearer {value}", what=f"the key in {name}")
    except HeaderValueError as exc:
        return f"{exc}; set {name} to the key alone"
    return None


class _Config(BaseModel):
    # Infinity and NaN are never a meaningful deadline, grace or timeout.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class EmbeddedPolicyConfig(_Config):
    """The scripted policy server, started in-process on loopback (the default with no model flags)."""

    type: Literal["embedded"] = "embedded"
    script: Path | None = Field(
        default=None, description="Policy script; None: policy.yaml beside the dataset."
    )
    model_name: str = Field(default="rollcage-scripted", description="Model name sent in requests.")


class ModelEndpointConfig(_Config):
    """A real OpenAI-compatible endpoint (vLLM, SGLang, NIM, OpenAI)."""

    type: Literal["endpoint"] = "endpoint"
    base_url: str = Field(description="Base URL ending in /v1, as the host reaches it.")
    model_name: str = Field(min_length=1, description="Model name sent in requests.")
    api_key_env: str | None = Field(
        default=None,
        description="Environment variable holding the API key; given to the supervisor, never to input.json.",
    )

    @field_validator("base_url")
    @classmethod
    def _reachable(cls, url: str) -> str:
        problem = model_url_problem(url)
        if problem is not None:
            raise ValueError(problem)
        return url


ModelSource = Annotated[EmbeddedPolicyConfig | ModelEndpointConfig, Field(discriminator="type")]
"""Where the model comes from, tagged by ``type``."""


class LocalBackendConfig(_Config):
    """Run rollouts on this machine, each under its own supervisor in this process."""

    type: Literal["local"] = "local"

    def build(self, settings: RolloutSettings, **overrides: Any) -> Backend:
        """The backend for ``settings`` (imported now, lazily).

        Args:
            settings: How rollouts are supervised and graded.
            **overrides: ``supervise``/``supervisor_config`` replacements (tests, fakes).
        """
        from rollcage.controller._backend import LocalBackend

        return LocalBackend(settings, **overrides)


class RayBackendConfig(_Config):
    """Run each rollout as a Ray task, supervised and graded on whichever node has room.

    Every node needs rollcage (and bubblewrap, with sandbox ``bwrap``) installed;
    the model and the environments must be reachable from every node.
    """

    type: Literal["ray"] = "ray"
    address: str | None = Field(
        default=None,
        description=(
            "The cluster: 'HOST:PORT' of its head (GCS), or 'auto' for one started with 'ray start' "
            "on this machine. None: the cluster this process is already connected to, else RAY_ADDRESS, "
            "else a private local instance that the run starts and stops."
        ),
    )
    num_cpus_per_rollout: float = Field(
        default=1.0, ge=0, description="CPUs Ray reserves for each rollout task (0: none reserved)."
    )
    shared_dir: Path | None = Field(
        default=None,
        description=(
            "A directory every node mounts at the same path, holding the output directory: nodes write "
            "rollout directories in place. None: each node works in a temporary directory and ships the "
            "packed artifacts to the driver."
        ),
    )
    max_artifact_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=64 * 1024,
        description=(
            "Largest rollout directory (bytes of file content) shipped to the driver without shared_dir; "
            "a larger one makes the attempt an infra_failure that says so."
        ),
    )
    local_num_cpus: int | None = Field(
        default=None, ge=1, description="CPUs of a private local instance; None: all of this machine's."
    )
    image_store: Path | None = Field(
        default=None,
        description=(
            "Where each node keeps its task images (a path on the node, not shared between nodes); "
            "None: the node's $ROLLCAGE_IMAGE_STORE, else rollcage-images under its Ray temp dir."
        ),
    )

    @field_validator("image_store")
    @classmethod
    def _store_absolute(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_absolute():
            raise ValueError(f"the image store {value} must be an absolute path (it is a path on each node)")
        return value

    def build(self, settings: RolloutSettings, **overrides: Any) -> Backend:
        """The backend for ``settings`` (Ray is imported now, lazily).

        Args:
            settings: How rollouts are supervised and graded.
            **overrides: Passed to ``RayBackend`` (none are needed in normal use).

        Raises:
            ConfigError: Ray is not installed.
        """
        try:
            from rollcage.controller._ray import RayBackend
        except ImportError as exc:
            raise ConfigError(
                f"the Ray backend needs Ray ({exc}): pip install 'rollcage[ray]' on the driver and every node"
            ) from exc
        return RayBackend(self, settings, **overrides)


BackendConfig = Annotated[LocalBackendConfig | RayBackendConfig, Field(discriminator="type")]
"""Where rollouts execute, tagged by ``type``: ``local`` or ``ray``; each builds its backend lazily."""


class RunConfig(_Config):
    """Everything ``rollcage run`` and ``rollcage.collect`` need; every field has a default but the output."""

    dataset: Path | None = Field(
        default=None, description="The JSONL dataset; None: the tasks are given in memory (rollcage.collect)."
    )
    out: Path = Field(description="Output directory (rollouts.jsonl, metrics.json, rollouts/).")
    model: ModelSource = Field(default_factory=EmbeddedPolicyConfig, description="The model endpoint.")
    api: Literal["chat", "responses"] = Field(default="chat", description="API style unless a row says.")
    concurrency: int = Field(default=8, ge=1, le=4096, description="Rollouts in flight at most.")
    attempts: int = Field(default=1, ge=1, le=10_000, description="Samples per task (k of pass@k).")
    max_infra_retries: int = Field(default=2, ge=0, le=100, description="Retries of an infra_failure.")
    retry_backoff_s: float = Field(default=1.0, ge=0, description="First retry delay; doubles per retry.")
    retry_backoff_max_s: float = Field(default=30.0, ge=0, description="Cap on the retry delay.")
    deadline_s: float = Field(default=600.0, gt=0, description="Wall-clock deadline of one rollout.")
    grace_s: float = Field(default=5.0, ge=0, description="SIGTERM → SIGKILL grace of one rollout.")
    sandbox: Literal["bwrap", "none"] = Field(default="bwrap", description="How agent code is contained.")
    bwrap: BwrapSandbox = Field(
        default_factory=BwrapSandbox,
        description="With sandbox bwrap: its per-process limits and per-rollout budgets (memory, disk, ...).",
    )
    grade_timeouts: bool = Field(default=False, description="Grade rollouts that hit the deadline.")
    resume_rollouts: bool = Field(
        default=False,
        description="A retry after infra_failure, or a rollout a killed run interrupted, continues from the "
        "earlier attempt's journal (rollcage.resume) instead of the first turn.",
    )
    strict: bool = Field(default=False, description="Stop before running anything if a row is malformed.")
    pass_threshold: float = Field(default=1.0, description="A reward at least this passes (pass@k).")
    metrics_interval_s: float = Field(default=2.0, gt=0, description="How often metrics.json is refreshed.")
    max_capture_bytes: int | None = Field(
        default=256 * 1024 * 1024,
        ge=64 * 1024,
        description=(
            "Budget of a rollout's model_capture.jsonl; past it the rollout ends as agent_error; None: none."
        ),
    )
    backend: BackendConfig = Field(default_factory=LocalBackendConfig, description="Where rollouts run.")
    dataset_format: Literal["auto", "rollcage", "nemo-gym", "inspect"] = Field(
        default="auto", description="How the dataset's rows are written; auto: detected from its first rows."
    )
    environment: str | None = Field(
        default=None,
        description="Environment (bundled name or resource server URL) of rows that name none; "
        "NeMo Gym rows never do. None: such rows have no environment.",
    )
    harness: HarnessSpec | None = Field(
        default=None,
        description="The harness of rows whose agent names none (builtin, nooa, command); None: builtin.",
    )
    harness_env: Path | None = Field(
        default=None,
        description="The virtualenv a nooa or command harness runs with (mounted read-only in every "
        "sandbox); None: nooa's installed one ('rollcage harness install nooa'), none for a command.",
    )
    image: str | None = Field(
        default=None,
        description="The task image (docker://, oci:, docker-archive:, dir:) of rows whose sandbox names "
        "none: agent code runs in a copy-on-write root of it. None: such rows run on the host's system view.",
    )

    @field_validator("image")
    @classmethod
    def _image_ref(cls, value: str | None) -> str | None:
        if value is None:
            return None
        from rollcage.images import parse_ref

        try:
            return str(parse_ref(value))
        except RollcageError as exc:
            raise ValueError(str(exc)) from exc

    def rollout_settings(self) -> RolloutSettings:
        """The per-rollout settings handed to the backend."""
        key = self.model.api_key_env if isinstance(self.model, ModelEndpointConfig) else None
        return RolloutSettings(
            deadline_s=self.deadline_s,
            grace_s=self.grace_s,
            sandbox=self.sandbox,
            api_key_env=key,
            grade_timeouts=self.grade_timeouts,
            bwrap=self.bwrap,
            max_capture_bytes=self.max_capture_bytes,
        )

    @model_validator(mode="after")
    def _key_variable_set(self) -> RunConfig:
        # Every rollout supervised here would fail on a missing key: refused before anything runs.
        model = self.model
        if (
            isinstance(model, ModelEndpointConfig)
            and model.api_key_env
            and isinstance(self.backend, LocalBackendConfig)
        ):
            problem = api_key_problem(model.api_key_env)
            if problem is not None:
                raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _out_inside_shared_dir(self) -> RunConfig:
        # Nodes write rollout directories under --out in place, so --out must be on the shared
        # file system; refusing here means nothing runs with artifacts landing on node-local disks.
        shared = self.backend.shared_dir if isinstance(self.backend, RayBackendConfig) else None
        if shared is not None and not self.out.resolve().is_relative_to(shared.resolve()):
            raise ValueError(
                f"--out {self.out} must be inside --shared-dir {shared}, which every node mounts"
            )
        return self
