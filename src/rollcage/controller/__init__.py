"""The controller: run a dataset through supervisors, grade outside the sandbox, record, resume.

Public face of ``rollcage run`` and of ``rollcage.collect`` (``Collection``: records
yielded as they land, for trainers). A backend runs one prepared rollout at a time
into a ``RolloutRecord``; ``Controller`` streams the dataset, schedules those units
with bounded concurrency, retries infrastructure failures, appends ``rollouts.jsonl``
and publishes ``metrics.json``. Backends:
``LocalBackendConfig`` (this machine) and ``RayBackendConfig`` (a Ray cluster; Ray is
imported only when that backend is built).

The face is lazy (PEP 562): each name is imported from its module when first asked
for, so a room that needs one name (``rollcage show``'s health checks, ``rollcage
run``'s configuration) does not pay for the whole controller. ``TYPE_CHECKING``
imports keep the names visible to type checkers and to the API reference.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_HOMES: dict[str, str] = {
    "LocalBackend": "rollcage.controller._backend",
    "branch": "rollcage.controller._branch",
    "branch_source": "rollcage.controller._branch",
    "plan_branches": "rollcage.controller._branch",
    "Collection": "rollcage.controller._collect",
    "collect": "rollcage.controller._collect",
    "EmbeddedPolicyConfig": "rollcage.controller._config",
    "LocalBackendConfig": "rollcage.controller._config",
    "ModelEndpointConfig": "rollcage.controller._config",
    "RayBackendConfig": "rollcage.controller._config",
    "RunConfig": "rollcage.controller._config",
    "InvalidRow": "rollcage.controller._dataset",
    "Task": "rollcage.controller._dataset",
    "iter_dataset": "rollcage.controller._dataset",
    "ExactGrader": "rollcage.controller._graders",
    "NormalizedGrader": "rollcage.controller._graders",
    "NumericGrader": "rollcage.controller._graders",
    "RegexGrader": "rollcage.controller._graders",
    "HEALTH_ALIASES": "rollcage.controller._health",
    "HEALTH_CHECKS": "rollcage.controller._health",
    "rollout_health": "rollcage.controller._health",
    "rollout_id": "rollcage.controller._ids",
    "pass_at_k": "rollcage.controller._ledger",
    "create_params_for": "rollcage.controller._nemo_gym",
    "function_tools": "rollcage.controller._nemo_gym",
    "nemo_items": "rollcage.controller._nemo_gym",
    "to_nemo_response": "rollcage.controller._nemo_gym",
    "RecordLog": "rollcage.controller._records",
    "load_records": "rollcage.controller._records",
    "Controller": "rollcage.controller._scheduler",
    "EXIT_ALL_GRADER_ERRORS": "rollcage.controller._scheduler",
    "EXIT_ALL_INFRA": "rollcage.controller._scheduler",
    "EXIT_INTERRUPTED": "rollcage.controller._scheduler",
    "EXIT_OK": "rollcage.controller._scheduler",
    "EXIT_USAGE": "rollcage.controller._scheduler",
    "NullReporter": "rollcage.controller._scheduler",
    "RunSummary": "rollcage.controller._scheduler",
    "Endpoints": "rollcage.controller._unit",
    "EnvironmentEndpoint": "rollcage.controller._unit",
    "prepare_rollout": "rollcage.controller._unit",
}
"""Where each name of the face lives (its module, imported on first use)."""


def __getattr__(name: str) -> Any:
    """A name of the face, imported from its module on first use (and kept: the next look is direct)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
