"""The controller: run a dataset through supervisors, grade outside the sandbox, record, resume.

Public face of ``rollcage run`` and of ``rollcage.collect`` (``Collection``: records
yielded as they land, for trainers). A backend runs one prepared rollout at a time
into a ``RolloutRecord``; ``Controller`` streams the dataset, schedules those units
with bounded concurrency, retries infrastructure failures, appends ``rollouts.jsonl``
and publishes ``metrics.json``. Backends:
``LocalBackendConfig`` (this machine) and ``RayBackendConfig`` (a Ray cluster; Ray is
imported only when that backend is built).
"""

from rollcage.controller._backend import LocalBackend
from rollcage.controller._branch import branch, branch_source, plan_branches
from rollcage.controller._collect import Collection, collect
from rollcage.controller._config import (
    EmbeddedPolicyConfig,
    LocalBackendConfig,
    ModelEndpointConfig,
    RayBackendConfig,
    RunConfig,
)
from rollcage.controller._dataset import InvalidRow, Task, iter_dataset
from rollcage.controller._graders import ExactGrader, NormalizedGrader, NumericGrader, RegexGrader
from rollcage.controller._health import HEALTH_ALIASES, HEALTH_CHECKS, rollout_health
from rollcage.controller._ids import rollout_id
from rollcage.controller._ledger import pass_at_k
from rollcage.controller._nemo_gym import create_params_for, function_tools, nemo_items, to_nemo_response
from rollcage.controller._records import RecordLog, load_records
from rollcage.controller._scheduler import (
    EXIT_ALL_GRADER_ERRORS,
    EXIT_ALL_INFRA,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    Controller,
    NullReporter,
    RunSummary,
)
from rollcage.controller._unit import Endpoints, EnvironmentEndpoint, prepare_rollout

__all__ = [
    "EXIT_ALL_GRADER_ERRORS",
    "EXIT_ALL_INFRA",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "HEALTH_ALIASES",
    "HEALTH_CHECKS",
    "Collection",
    "Controller",
    "EmbeddedPolicyConfig",
    "Endpoints",
    "EnvironmentEndpoint",
    "ExactGrader",
    "InvalidRow",
    "LocalBackend",
    "LocalBackendConfig",
    "ModelEndpointConfig",
    "NormalizedGrader",
    "NullReporter",
    "NumericGrader",
    "RayBackendConfig",
    "RecordLog",
    "RegexGrader",
    "RunConfig",
    "RunSummary",
    "Task",
    "branch",
    "branch_source",
    "collect",
    "create_params_for",
    "function_tools",
    "iter_dataset",
    "load_records",
    "nemo_items",
    "pass_at_k",
    "plan_branches",
    "prepare_rollout",
    "rollout_health",
    "rollout_id",
    "to_nemo_response",
]
