"""Supervise one rollout: sandbox, deadline, egress proxy, process-tree reaping, receipt and outcome.

The controller's entry point::

    from rollcage.supervisor import BwrapSandbox, SupervisorConfig, supervise

    config = SupervisorConfig(deadline_s=300, grace_s=5, sandbox=BwrapSandbox(), api_key_env="OPENAI_API_KEY")
    receipt = await supervise(rollout_dir, config, stop=stop_event)
    receipt, result = await supervise_rollout(rollout_dir, config, stop=stop_event)  # result parsed once

``supervise`` runs many rollouts concurrently in one event loop. The rooms
behind this face: :mod:`~rollcage.supervisor.config` (the configs),
:mod:`~rollcage.supervisor.sandbox` (the sandbox layout and the bwrap command
line), :mod:`~rollcage.supervisor.proxy` (the egress proxy and the capture),
:mod:`~rollcage.supervisor.tree` (a rollout's process tree, stopped through :mod:`rollcage.procs`),
:mod:`rollcage.budgets` (per-rollout budgets), :mod:`~rollcage.supervisor.fds` (open files),
:mod:`~rollcage.supervisor.pacing` (how many rollouts start up at once),
:mod:`~rollcage.supervisor.bytecode` (the worker's compiled bytecode),
:mod:`~rollcage.supervisor.warm` (workers forked warm into their cages),
:mod:`~rollcage.supervisor.outcome` (the outcome rules) and
:mod:`~rollcage.supervisor.core` (the sequence).
"""

from rollcage.runfiles import RolloutLayout
from rollcage.supervisor.config import BwrapSandbox, NoSandbox, ProxyConfig, SandboxConfig, SupervisorConfig
from rollcage.supervisor.core import (
    Supervised,
    default_worker_command,
    kill_leftovers,
    supervise,
    supervise_rollout,
)
from rollcage.supervisor.outcome import OutcomeEvidence, classify_outcome
from rollcage.supervisor.warm import stop_templates

__all__ = [
    "BwrapSandbox",
    "NoSandbox",
    "OutcomeEvidence",
    "ProxyConfig",
    "RolloutLayout",
    "SandboxConfig",
    "Supervised",
    "SupervisorConfig",
    "classify_outcome",
    "default_worker_command",
    "kill_leftovers",
    "stop_templates",
    "supervise",
    "supervise_rollout",
]
