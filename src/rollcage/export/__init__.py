"""Export a run's rollouts in other projects' formats: ATIF v1.7 trajectories and NeMo Gym rollout JSONL.

``rollcage export RUN --format atif|nemo-gym [--out PATH]`` is ``export_run``;
``to_atif`` and ``to_nemo_gym_row`` convert one rollout (its record, its parsed
``result.json`` and its ``input.json``).
"""

from rollcage.export._atif import ATIF_VERSION, to_atif
from rollcage.export._export_run import ExportFormat, ExportReport, default_destination, export_run
from rollcage.export._nemo import NG_TRAJECTORY_VERSION, to_nemo_gym_row

__all__ = [
    "ATIF_VERSION",
    "NG_TRAJECTORY_VERSION",
    "ExportFormat",
    "ExportReport",
    "default_destination",
    "export_run",
    "to_atif",
    "to_nemo_gym_row",
]
