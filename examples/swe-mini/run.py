#!/usr/bin/env python3
"""examples/swe-mini end to end: build the images, serve them from a local registry, run, grade.

    make swe-mini                                    # the same, after installing what is missing
    .venv/bin/python examples/swe-mini/run.py        # build (cached), registry, run, print the grades

Steps: build.py's images (cached by content key; the first build takes a few minutes), a real
local registry (Debian's ``docker-registry`` on a free loopback port) with every image pushed to
it, ``dataset.jsonl`` naming each image by its ``docker://`` reference, then
``rollcage run DATASET --policy examples/swe-mini/policy.yaml``: each rollout pulls its image
through the distribution API into the node's image store, the scripted model fixes the bug with
bash and the editor, and the ``tests`` grader runs the task's own tests in a fresh root made of
the image and the rollout's changes. The registry is stopped when the run ends (also on failure).
Prints one line per task: its outcome, its reward and where its rollout directory is.

Exit status: 0 when every task was graded 1.0, 1 otherwise, 2 when the images could not be built.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import build  # this directory's build.py, beside this file

POLICY = build.HERE / "policy.yaml"


def rollcage_command() -> list[str]:
    """``rollcage`` of the running interpreter's environment (the repository's .venv), else PATH's."""
    beside = Path(sys.executable).with_name("rollcage")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("rollcage")
    if found is None:
        raise SystemExit("swe-mini: rollcage is not installed: run 'make swe-mini' (it makes .venv)")
    return [found]


def grades(run_dir: Path) -> list[dict[str, Any]]:
    """The last attempt of each task in ``run_dir/rollouts.jsonl``."""
    last: dict[str, dict[str, Any]] = {}
    path = run_dir / "rollouts.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                last[record["task_id"]] = record
    return [last[t.name] if t.name in last else {"task_id": t.name} for t in build.TASKS]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/swe-mini"), help="output directory")
    parser.add_argument("--cache", type=Path, default=None, help="build cache (default: user cache)")
    parser.add_argument(
        "--transport",
        choices=("docker", "oci", "docker-archive"),
        default="docker",
        help="how the dataset names the images (default: docker, through the local registry)",
    )
    parser.add_argument("rollcage_args", nargs="*", help="more `rollcage run` options, after --")
    args = parser.parse_args(argv)
    out = args.out.absolute()
    try:
        built = build.export(build.ensure_images((args.cache or build.default_cache()).absolute()), out)
    except build.BuildError as exc:
        print(f"swe-mini: {exc}", file=sys.stderr)
        return 2
    run_dir = out / "run"
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a fresh run each time (the same --out would resume the last one)
    registry = build.LocalRegistry(out / "registry") if args.transport == "docker" else None
    try:
        refs = build.refs_for(built, args.transport, registry)
        dataset = build.write_dataset(out / "dataset.jsonl", refs)
        argv_run = [
            *rollcage_command(),
            "run",
            str(dataset),
            "--policy",
            str(POLICY),
            "--out",
            str(run_dir),
            *args.rollcage_args,
        ]
        build.log(" ".join(argv_run))
        status = subprocess.run(argv_run, check=False).returncode
    except build.BuildError as exc:
        print(f"swe-mini: {exc}", file=sys.stderr)
        return 2
    finally:
        if registry is not None:
            registry.stop()
    print()
    print(f"{'task':<16} {'outcome':<14} {'reward':<7} rollout")
    every_one = True
    for record in grades(run_dir):
        reward = record.get("reward")
        every_one &= reward == 1.0
        shown = "-" if reward is None else f"{reward:g}"
        outcome = record.get("outcome", "not run")
        print(f"{record['task_id']:<16} {outcome:<14} {shown:<7} {record.get('rollout_dir', '')}")
    if status != 0:
        print(f"swe-mini: rollcage run exited with status {status}", file=sys.stderr)
    return 0 if every_one and status == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
