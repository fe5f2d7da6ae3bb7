"""NeMo Gym's own sandbox API, from the upstream package, driving the ``rollcage`` provider next to ``local``.

The scenario below runs in the side environment ``nemo-gym-rollcage`` (NeMo Gym 0.7.0 with rollcage
installed next to it, scripts/upstream-envs): the provider is found by NeMo Gym's registry through
rollcage's entry point, and every call goes through NeMo Gym's public ``AsyncSandbox`` facade, as a
NeMo Gym environment makes it. The same steps run on NeMo Gym's ``local`` provider; what a provider
promises (exit codes, separated streams, env, working directory, initial files, uploads and
downloads byte for byte, timeouts as ``125``/``timeout``, status, idempotent close) must come out the
same on both. What only a cage gives (no network, the image's root, confinement) is checked for
``rollcage`` alone.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers.task_images import make_task_image
from tests.helpers.upstream import run_upstream

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the rollcage provider needs root")

SCENARIO = r"""
import asyncio, json, os, subprocess, sys, tempfile
from pathlib import Path
from nemo_gym.sandbox import AsyncSandbox, SandboxSpec, SandboxStatus, get_provider_class, list_providers
from nemo_gym.sandbox.providers.base import SandboxCreateError

image, state, scratch, store = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
ATTACH = '''
import asyncio, json, sys
from nemo_gym.sandbox import AsyncSandbox, create_provider
async def main():
    provider = create_provider({"rollcage": {"state_dir": sys.argv[2]}})
    box = await AsyncSandbox.connect(json.loads(sys.argv[1]), provider=provider)
    r = await box.exec("echo from-another-process > attached.txt; pwd")
    print(r.stdout.strip(), r.return_code)
    await box.disconnect()
asyncio.run(main())
'''
BLOB = bytes(range(256)) * 33

async def scenario(name, config, workdir):
    report = {}
    spec = SandboxSpec(image=image, workdir=workdir, env={"GREETING": "hello there"},
                       files={"notes/a.txt": "alpha\n"})
    async with await AsyncSandbox({name: config}, spec).start() as box:
        run = lambda *a, **k: box.exec(*a, **k)
        r = await run('echo "$GREETING"; pwd')
        report["env_pwd"] = [r.stdout, r.return_code, r.error_type]
        r = await run("echo out; echo err >&2; exit 7")
        report["exit"] = [r.stdout, r.stderr, r.return_code, r.error_type]
        r = await run('echo "$ONE-$GREETING"', env={"ONE": "1"})
        report["exec_env"] = r.stdout
        r = await run("cat notes/a.txt")
        report["initial_file"] = [r.stdout, r.return_code]
        r = await run("mkdir -p sub && cd sub && pwd", cwd=workdir)
        report["cwd"] = [r.stdout.strip() == workdir + "/sub", r.return_code]
        r = await run("sleep 30", timeout_s=1)
        report["timeout"] = [r.return_code, r.error_type]
        src = scratch / f"{name}-blob"
        src.write_bytes(BLOB)
        await box.upload(src, "up/blob.bin")
        r = await run("wc -c < up/blob.bin")
        report["upload_size"] = r.stdout.strip()
        back = scratch / f"{name}-back" / "blob.bin"
        await box.download(f"{workdir}/up/blob.bin", back)
        report["download_same"] = back.read_bytes() == BLOB
        try:
            await box.download(f"{workdir}/missing.txt", scratch / f"{name}-missing")
            report["download_missing"] = "no error"
        except Exception as exc:
            report["download_missing"] = "raised"
        report["status"] = (await box.status()).value
        provider, handle = box._provider, box._handle
        if name == "rollcage":
            r = await run("cat /etc/os-release; test -e /proc/1/root/usr/lib/python3 && echo HOST")
            report["image_root"] = r.stdout
            r = await run("cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '")
            report["interfaces"] = r.stdout.split()
            await box.upload(src, "../../../../etc/escaped")
            r = await run("test -f /etc/escaped && echo inside")
            report["confined"] = [r.stdout.strip(), os.path.exists("/etc/escaped")]
            descriptor = await box.serialize()
            attached = subprocess.run([sys.executable, "-c", ATTACH, json.dumps(descriptor), state],
                                      capture_output=True, text=True, timeout=300)
            report["attached"] = [attached.stdout.strip(), attached.stderr[-500:]]
            r = await run("cat attached.txt")
            report["attached_file"] = r.stdout
    report["status_after_stop"] = (await provider.status(handle)).value
    await provider.close(handle)  # idempotent
    return report

async def refusals():
    out = {}
    cls = get_provider_class("rollcage")
    for label, spec in {
        "no_image": SandboxSpec(image=None),
        "gpu": SandboxSpec(image=image, resources={"gpu": 1}),
        "hosts": SandboxSpec(image=image, provider_options={"allow_hosts": ["pypi.org"]}),
        "bad_image": SandboxSpec(image="oci:/nonexistent/layout:1"),
    }.items():
        provider = cls(state_dir=state, image_store=store)
        try:
            await provider.create(spec)
            out[label] = "created"
        except SandboxCreateError as exc:
            out[label] = str(exc)
        await provider.aclose()
    return out

async def main():
    local_dir = tempfile.mkdtemp(prefix="gym-local-", dir=scratch)
    result = {
        "providers": list_providers(),
        "class": get_provider_class("rollcage").__module__,
        "local": await scenario("local", {}, local_dir),
        "rollcage": await scenario("rollcage", {"state_dir": state, "image_store": store}, "/work/task"),
        "refusals": await refusals(),
    }
    print(json.dumps(result))

asyncio.run(main())
"""


def test_nemo_gym_drives_rollcage_like_local(tmp_path: Path, state: Path) -> None:
    image = make_task_image(tmp_path / "image", python=False)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    out = run_upstream(
        "nemo-gym-rollcage",
        SCENARIO,
        image.ref,
        str(state),
        str(scratch),
        str(tmp_path / "store"),
        timeout=600,
    )
    assert "rollcage" in out["providers"] and "local" in out["providers"]
    assert out["class"] == "rollcage.gym_sandbox.provider"
    local, caged = out["local"], out["rollcage"]
    # What every provider promises, the same on both.
    for key in ("exit", "exec_env", "initial_file", "cwd", "timeout", "upload_size", "download_same"):
        assert caged[key] == local[key], (key, caged[key], local[key])
    assert local["timeout"] == [125, "timeout"]
    assert local["exit"] == ["out\n", "err\n", 7, None]
    assert caged["env_pwd"] == ["hello there\n/work/task\n", 0, None]
    assert local["env_pwd"][0].startswith("hello there\n")
    assert caged["download_missing"] == local["download_missing"] == "raised"
    assert caged["status"] == local["status"] == "running"
    assert caged["status_after_stop"] == "stopped"
    # What only the cage gives: the image's root, no network but loopback, confinement to the root.
    assert "rollcage-task-image" in caged["image_root"] and "HOST" not in caged["image_root"]
    assert caged["interfaces"] == ["lo"]
    assert caged["confined"] == ["inside", False]
    # Another process attaches from the descriptor (NeMo Gym's serialize/connect), runs a command in
    # the same sandbox, and detaches; the creator sees its file and closes the sandbox later.
    assert caged["attached"][0] == "/work/task 0", caged["attached"]
    assert caged["attached_file"] == "from-another-process\n"
    # Refusals name their cause.
    refusals = out["refusals"]
    assert "SandboxSpec.image is required" in refusals["no_image"]
    assert "resources.gpu" in refusals["gpu"]
    assert "provider_options.allow_hosts" in refusals["hosts"]
    assert "/nonexistent/layout" in refusals["bad_image"]
    # Evidence: every command of the rollcage sandbox is in its journal, in order.
    (directory,) = [
        d for d in state.iterdir() if (d / "sandbox.json").exists() and (d / "execs.jsonl").exists()
    ]
    record = json.loads((directory / "sandbox.json").read_text())
    assert record["closed_at"] and record["image"]["ref"] == image.ref
    lines = [json.loads(line) for line in (directory / "execs.jsonl").read_text().splitlines()]
    assert [line["seq"] for line in lines] == list(range(1, len(lines) + 1))
    # The facade uploads the spec's files first (one command each), then the scenario's commands.
    assert lines[0]["args"] == ["notes/a.txt"] and lines[0]["stdin_bytes"] == len("alpha\n")
    assert lines[1]["command"] == 'echo "$GREETING"; pwd' and lines[1]["exit_code"] == 0
    assert lines[2]["exit_code"] == 7 and lines[2]["stdout_bytes"] == 4
    assert any(line["timed_out"] for line in lines)
    assert any(line["command"].startswith("echo from-another-process") for line in lines)
