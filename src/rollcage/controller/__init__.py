"""The controller: run a dataset through supervisors, grade outside the sandbox, record, resume.

Public face of ``rollcage run`` and of ``rollcage.collect`` (``Collection``: records
yielded as they land, for trainers). The unit of work a backend executes is
``run_rollout(prepared, settings)`` → ``RolloutRecord``; ``Controller`` streams the
dataset, schedules those units with bounded concurrency, retries infrastructure
failures, appends ``rollouts.jsonl`` and publishes ``metrics.json``. Backends:
``LocalBackendConfig`` (this machine) and ``RayBackendConfig`` (a Ray cluster; Ray is
imported only when that backend is built).
"""

from rollcage.controller._backend import Backend, LocalBackend
from rollcage.controller._collect import Collection, collect
from rollcage.controller._config import (
    BackendConfig,
    EmbeddedPolicyConfig,
    LocalBackendConfig,
    ModelEndpointConfig,
    ModelSource,
    RayBackendConfig,
    RunConfig,
    api_key_problem,
    model_url_problem,
)
from rollcage.controller._dataset import DatasetRow, EnvironmentRef, InvalidRow, Task, iter_dataset
from rollcage.controller._graders import (
    ExactGrader,
    GradeResult,
    GraderSpec,
    NormalizedGrader,
    NumericGrader,
    RegexGrader,
    VerifyGrader,
)
from rollcage.controller._health import HEALTH_ALIASES, HEALTH_CHECKS, rollout_health, rollout_metrics
from rollcage.controller._ids import rollout_id
from rollcage.controller._ledger import RunLedger, pass_at_k
from rollcage.controller._nemo_gym import create_params_for, function_tools, to_nemo_response
from rollcage.controller._records import RecordLog, load_records
from rollcage.controller._run import (
    EXIT_ALL_GRADER_ERRORS,
    EXIT_ALL_INFRA,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    Controller,
    NullReporter,
    Reporter,
    RunSummary,
)
from rollcage.controller._unit import (
    Endpoints,
    EnvironmentEndpoint,
    EnvironmentPlan,
    GradingPlan,
    PreparedRollout,
    RolloutSettings,
    prepare_rollout,
    run_rollout,
)

__all__ = [
    "EXIT_ALL_GRADER_ERRORS",
    "EXIT_ALL_INFRA",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "HEALTH_ALIASES",
    "HEALTH_CHECKS",
    "Backend",
    "BackendConfig",
    "Collection",
    "Controller",
    "DatasetRow",
    "EmbeddedPolicyConfig",
    "Endpoints",
    "EnvironmentEndpoint",
    "EnvironmentPlan",
    "EnvironmentRef",
    "ExactGrader",
    "GradeResult",
    "GraderSpec",
    "GradingPlan",
    "InvalidRow",
    "LocalBackend",
    "LocalBackendConfig",
    "ModelEndpointConfig",
    "ModelSource",
    "NormalizedGrader",
    "NullReporter",
    "NumericGrader",
    "PreparedRollout",
    "RayBackendConfig",
    "RecordLog",
    "RegexGrader",
    "Reporter",
    "RolloutSettings",
    "RunConfig",
    "RunLedger",
    "RunSummary",
    "Task",
    "VerifyGrader",
    "api_key_problem",
    "collect",
    "create_params_for",
    "function_tools",
    "iter_dataset",
    "load_records",
    "model_url_problem",
    "pass_at_k",
    "prepare_rollout",
    "rollout_health",
    "rollout_id",
    "rollout_metrics",
    "run_rollout",
    "to_nemo_response",
]
