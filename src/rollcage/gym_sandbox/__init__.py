"""rollcage's cage as a NeMo Gym sandbox provider (``sandbox: {rollcage: {...}}`` in NeMo Gym's config).

Two layers: :mod:`rollcage.gym_sandbox._cage` is the sandbox itself on rollcage's own pieces (the
image store, the copy-on-write image root, bubblewrap, cgroup budgets, an exec journal) and needs
nothing of NeMo Gym; :mod:`rollcage.gym_sandbox.provider` adapts it to NeMo Gym's ``SandboxProvider``
protocol and is the only module that imports ``nemo_gym`` (install ``rollcage[nemo-gym]``). NeMo
Gym finds it through the entry point ``rollcage`` of the group ``nemo_gym.sandbox_providers``. The face
offers what ``rollcage show`` reads of a sandbox's directory.
"""

from rollcage.gym_sandbox._show import render_sandbox, sandbox_directory

__all__ = ["render_sandbox", "sandbox_directory"]
