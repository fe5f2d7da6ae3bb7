"""How one rollout is supervised: deadline, sandbox, egress proxy, worker command.

Every model forbids unknown fields. The sandbox is a tagged union on ``type``
(``"bwrap"`` or ``"none"``); each variant builds its own launcher lazily, so
importing the config costs nothing of the machinery behind it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rollcage.budgets import BudgetSettings

if TYPE_CHECKING:
    from rollcage.supervisor.sandbox import BwrapLauncher, NoSandboxLauncher

__all__ = [
    "TOKEN_ENV",
    "BwrapSandbox",
    "NoSandbox",
    "ProxyConfig",
    "SandboxConfig",
    "SupervisorConfig",
]

TOKEN_ENV = "ROLLCAGE_SUPERVISION_TOKEN"
"""Environment variable carrying a per-rollout random token into every process the supervisor starts.

It lets the supervisor recognise descendants that were reparented to it (a daemon
whose parent exited) and tell them apart from those of other rollouts supervised
by the same process.
"""

_MIB = 1 << 20
_GIB = 1 << 30


class _Config(BaseModel):
    # Infinity and NaN are never a meaningful deadline, grace or timeout.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class BwrapSandbox(BudgetSettings):
    """Run the worker under bubblewrap (the default, and required for untrusted agent code).

    The worker gets new user, PID, IPC, UTS, cgroup and network namespaces, a
    read-only system and Python environment, a private ``/tmp``, a cleared
    environment, resource limits set before it starts, and no route out but the
    egress proxy's socket; the agent's code runs in a cage of its own inside
    (``executor_cage``). See :mod:`rollcage.supervisor.sandbox` for the layout.

    Two kinds of bound: **per-process limits** (``setrlimit``, applied in the
    sandbox before the worker starts; ``None`` leaves the supervisor's own) and
    **per-rollout budgets** on the whole sandbox (total memory and processes,
    bytes and inodes of the workspace, ``/tmp`` and ``/dev/shm``). A rollout that
    exceeds a budget is ended as the policy's fault (``agent_error``, the reason
    naming the budget); the receipt records each budget, how it was enforced and
    its peak use (see :mod:`rollcage.cage`).
    """

    type: Literal["bwrap"] = "bwrap"
    address_space_bytes: int | None = Field(
        default=4 * _GIB,
        ge=64 * _MIB,
        description="RLIMIT_AS of every process in the sandbox (a memory bomb gets MemoryError/ENOMEM).",
    )
    file_size_bytes: int | None = Field(
        default=1 * _GIB, ge=_MIB, description="RLIMIT_FSIZE: the largest file any sandbox process may write."
    )
    cpu_seconds: int | None = Field(
        default=None, ge=1, description="RLIMIT_CPU of each process; None: only the deadline bounds it."
    )
    open_files: int | None = Field(default=1024, ge=64, description="RLIMIT_NOFILE of each process.")
    executor_cage: Literal["bwrap", "shared"] = Field(
        default="bwrap",
        description=(
            "bwrap: the agent's code (the Python executor) runs in a cage of its own inside the sandbox, so "
            "it cannot write, trace or signal the worker (see rollcage.cage); shared: in the worker's own "
            "sandbox, as the worker's equal (weaker: the journal and the worker are in its reach)."
        ),
    )
    worker_start: Literal["warm", "cold"] = Field(
        default="warm",
        description=(
            "warm: under bubblewrap, the worker is forked from a pre-imported template into the cage bwrap "
            "made (rollcage.warm; as root, or not as root through the user namespaces bwrap makes as "
            "this uid): the same namespaces, mounts, cgroups, uid, limits and environment as a cold "
            "start, without paying an interpreter and its imports per rollout. cold: every rollout's "
            "worker is a fresh interpreter. A custom worker_command, root without run_as_uid and a "
            "setuid bubblewrap always start cold."
        ),
    )
    run_as_uid: int | None = Field(
        default=65534,
        ge=1,
        description=(
            "Only when the supervisor runs as root: the unprivileged host uid the sandbox runs as. "
            "The kernel never enforces RLIMIT_NPROC for root, so without this a fork bomb is not "
            "contained. None keeps root (not recommended). Ignored when the supervisor is not root."
        ),
    )
    run_as_gid: int | None = Field(
        default=65534, ge=1, description="Host gid paired with run_as_uid (only when the supervisor is root)."
    )
    sandbox_uid: int = Field(default=1000, ge=1, description="The uid the worker sees inside the sandbox.")
    sandbox_gid: int = Field(default=1000, ge=1, description="The gid the worker sees inside the sandbox.")
    system_paths: list[str] = Field(
        default_factory=lambda: ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc"],
        description="Host system paths mounted read-only in place (missing ones skipped; symlinks kept).",
    )
    extra_ro_paths: list[str] = Field(
        default_factory=list,
        description=(
            "More host paths mounted read-only at the same place (e.g. a custom worker's code). The Python "
            "environment running the supervisor and the rollcage package are always mounted."
        ),
    )
    bwrap_path: str | None = Field(default=None, description="The bwrap executable; None: found on PATH.")

    @model_validator(mode="after")
    def _check_paths(self) -> BwrapSandbox:
        for path in [*self.system_paths, *self.extra_ro_paths]:
            if not path.startswith("/"):
                raise ValueError(f"sandbox paths must be absolute, not {path!r}")
        if (self.run_as_uid is None) != (self.run_as_gid is None):
            raise ValueError("run_as_uid and run_as_gid must be set together (or both None)")
        return self

    def launcher(self) -> BwrapLauncher:
        """Build the launcher for this config (imports the sandbox machinery now)."""
        from rollcage.supervisor.sandbox import BwrapLauncher

        return BwrapLauncher(self)


class NoSandbox(_Config):
    """Run the worker as a plain child process: supervised, but **agent code is not contained**.

    The worker shares the supervisor's user, network and file system: it can read
    anything the supervisor can (including the supervisor's environment through
    ``/proc``) and reach the network directly. Use it only for trusted code or
    where bubblewrap cannot run; the supervisor logs a loud warning every time.
    """

    type: Literal["none"] = "none"
    worker_start: Literal["warm", "cold"] = Field(
        default="warm",
        description=(
            "warm: the worker is forked from a pre-imported template (rollcage.warm), the supervisor's "
            "child with the environment, working directory, limits and umask a cold start has, without "
            "paying an interpreter and its imports per rollout; a warm start that fails runs the cold "
            "worker instead. cold: every rollout's worker is a fresh interpreter. A custom "
            "worker_command always starts cold."
        ),
    )

    def launcher(self) -> NoSandboxLauncher:
        """Build the launcher for this config (imports the sandbox machinery now)."""
        from rollcage.supervisor.sandbox import NoSandboxLauncher

        return NoSandboxLauncher(self)


SandboxConfig = Annotated[BwrapSandbox | NoSandbox, Field(discriminator="type")]
"""The worker's containment, tagged by ``type``."""


class ProxyConfig(_Config):
    """The egress proxy: the worker's only way out (see :mod:`rollcage.supervisor.proxy`)."""

    max_request_bytes: int = Field(
        default=32 * _MIB, ge=1024, description="Largest request body accepted; larger ones get 413."
    )
    max_response_bytes: int = Field(
        default=64 * _MIB,
        ge=1024,
        description="Largest response body passed back; a larger one is cut off and the connection closed.",
    )
    max_connections: int = Field(
        default=32,
        ge=1,
        le=4096,
        description=(
            "Connections the sandbox may hold open to the proxy at once; more are refused at accept. The "
            "process also shares what its open-file limit affords fairly between rollouts (see "
            "rollcage.supervisor.fds), so a rollout may get fewer."
        ),
    )
    idle_timeout_s: float = Field(
        default=30.0,
        gt=0,
        allow_inf_nan=False,
        description=(
            "A connection with no request in progress is closed after this long; it also bounds how long "
            "a response waits for a client that does not read."
        ),
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        allow_inf_nan=False,
        description="From the first byte of a request to the end of its head; past it: 408 and close.",
    )
    body_timeout_s: float = Field(
        default=30.0,
        gt=0,
        allow_inf_nan=False,
        description="From the end of a request's head to the end of its body; past it: 408 and close.",
    )
    model_routes: list[str] = Field(
        default_factory=lambda: ["POST /chat/completions", "POST /responses", "GET /models"],
        min_length=1,
        description=(
            "What the model route forwards, as 'METHOD /path' under /model/v1 ('/*' at the end: any path "
            "below); everything else is answered 403 and captured as denied."
        ),
    )
    capture_body_bytes: int = Field(
        default=2 * _MIB,
        ge=0,
        description=(
            "Bodies up to this size are captured whole; a larger one as its size, sha256 and first 64 KiB."
        ),
    )
    max_capture_bytes: int | None = Field(
        default=256 * _MIB,
        ge=64 * 1024,
        description=(
            "The rollout's budget for model_capture.jsonl. The exchange that would pass it is captured "
            "without bodies, and the rollout ends as agent_error (the policy's fault); None: no budget."
        ),
    )
    connect_timeout_s: float = Field(default=10.0, gt=0, description="Deadline for connecting upstream.")
    upstream_timeout_s: float | None = Field(
        default=None,
        gt=0,
        description=(
            "Longest wait for the next bytes of an upstream response; None: only the worker's own "
            "timeouts and the rollout deadline bound it."
        ),
    )

    @field_validator("model_routes")
    @classmethod
    def _check_routes(cls, routes: list[str]) -> list[str]:
        for route in routes:
            method, _, path = route.partition(" ")
            if not (method.isalpha() and method.isupper()) or not path.startswith("/") or " " in path:
                raise ValueError(f"model route {route!r} must be 'METHOD /path' ('POST /chat/completions')")
        return routes


class SupervisorConfig(_Config):
    """Everything :func:`rollcage.supervisor.supervise` needs besides the rollout directory."""

    deadline_s: float = Field(
        default=600.0, gt=0, description="One wall-clock deadline for the whole rollout, from its start."
    )
    grace_s: float = Field(
        default=5.0, ge=0, description="Between SIGTERM (deadline or stop) and SIGKILL to the whole tree."
    )
    sandbox: SandboxConfig = Field(
        default_factory=BwrapSandbox,
        description="bwrap (default; refused with SandboxError where bubblewrap is missing) or none.",
    )
    api_key_env: str | None = Field(
        default=None,
        description=(
            "Name of the supervisor's environment variable holding the model API key; the proxy sends it "
            "upstream as 'Authorization: Bearer <key>'. The sandbox never sees it. None: no credential added."
        ),
    )
    resource_api_key_envs: dict[str, str] = Field(
        default_factory=dict,
        description="Per resource name (WorkerInput.resources key): variable holding its bearer token.",
    )
    worker_command: list[str] | None = Field(
        default=None,
        min_length=1,
        description=(
            "The worker program; the supervisor appends INPUT RESULT --checkpoint PATH. "
            "None: this interpreter running 'python -I -m rollcage worker'."
        ),
    )
    proxy: ProxyConfig | None = Field(
        default_factory=ProxyConfig,
        description=(
            "The egress proxy; None: no proxy, input.json reaches the worker unchanged (direct connections, "
            "which only work with sandbox 'none'), and the receipt's model_calls_captured is None."
        ),
    )
    env_allow: list[str] = Field(
        default_factory=lambda: ["LANG", "LC_ALL", "LC_CTYPE", "TZ", "ROLLCAGE_LOG_LEVEL"],
        description="Variables copied from the supervisor's environment into the worker's (when set).",
    )
    env: dict[str, str] = Field(default_factory=dict, description="Variables set for the worker.")
    start_pacing: Literal["cpus", "off"] = Field(
        default="cpus",
        description=(
            "cpus: rollouts of this event loop start up (sandbox and worker interpreter, the costly part "
            "of a rollout's CPU) at most two per CPU this process may use at once; the rest wait their "
            "turn (counted in their deadline), so the first results come as soon as one rollout alone "
            "would give them rather than after all have started. off: all start at once."
        ),
    )
    stop_poll_s: float = Field(default=0.2, gt=0, description="How often the 'stop' file is polled.")
    kill_wait_s: float = Field(
        default=5.0,
        gt=0,
        description=(
            "After SIGKILL, how long to wait for every process to be gone; past it the receipt says "
            "cleanup_confirmed: false."
        ),
    )

    @model_validator(mode="after")
    def _keep_secrets_out(self) -> SupervisorConfig:
        secret_names = {*self.resource_api_key_envs.values()}
        if self.api_key_env is not None:
            secret_names.add(self.api_key_env)
        leaked = sorted(secret_names & ({*self.env_allow} | {*self.env}))
        if leaked:
            raise ValueError(
                f"{leaked[0]} holds a credential for the egress proxy and must not be passed to the worker "
                "(remove it from env_allow / env)"
            )
        if TOKEN_ENV in self.env or TOKEN_ENV in self.env_allow:
            raise ValueError(f"{TOKEN_ENV} is set by the supervisor itself")
        return self
