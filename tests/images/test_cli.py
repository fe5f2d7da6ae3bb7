"""``rollcage images pull|ls|rm|prune``: short output, exit 2 on a user's error, 1 on the registry's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers.oci import Image, Member, Registry, free_port, layer, push


def _images(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollcage", "images", *args], capture_output=True, text=True, timeout=300
    )


def test_pull_ls_rm_prune_round_trip(registry: Registry, tmp_path: Path) -> None:
    image = Image([layer(Member("etc/hello", data=b"hi\n"))])
    push(registry.base, "tests/cli", "v1", image)
    store = str(tmp_path / "store")
    ref = f"docker://{registry.host}/tests/cli:v1"
    pulled = _images("pull", "--store", store, ref)
    assert pulled.returncode == 0, pulled.stderr
    assert pulled.stdout.split()[:2] == [ref, image.id]
    also = _images("pull", "--store", store, f"oci:{image.write_oci(tmp_path / 'layout')}")
    assert also.returncode == 0, also.stderr
    listed = _images("ls", "--store", store)
    assert listed.returncode == 0
    lines = listed.stdout.splitlines()
    assert len(lines) == 2 and all(image.id[7:19] in line for line in lines)
    assert "untagged" in _images("rm", "--store", store, ref).stdout  # the oci: reference still names it
    assert _images("rm", "--store", store, f"oci:{tmp_path / 'layout'}").stdout.startswith("removed ")
    assert _images("ls", "--store", store).stdout == "no images\n"
    pruned = _images("prune", "--store", store)
    assert pruned.returncode == 0 and pruned.stdout.startswith("removed 0 image(s), 1 layer(s)")


def test_user_errors_exit_2_in_one_line(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    for args, says in [
        (("pull", "--store", store, "debian"), "no transport"),
        (("rm", "--store", store, f"oci:{tmp_path}/nothing"), "not in the image store"),
        (("pull", "--store", store, f"oci:{tmp_path}/nothing"), "no OCI image layout"),
    ]:
        done = _images(*args)
        assert done.returncode == 2, (args, done.stderr)
        assert done.stderr.count("\n") == 1 and says in done.stderr, done.stderr


def test_a_refused_image_exits_2_naming_the_member(tmp_path: Path) -> None:
    evil = Image([layer(Member("dev/kmem", kind="chardev"))])
    done = _images("pull", "--store", str(tmp_path / "store"), f"oci:{evil.write_oci(tmp_path / 'evil')}")
    assert done.returncode == 2
    assert "'dev/kmem'" in done.stderr and done.stderr.count("\n") == 1


def test_an_unreachable_registry_exits_1(tmp_path: Path) -> None:
    done = _images("pull", "--store", str(tmp_path / "store"), f"docker://127.0.0.1:{free_port()}/x/y:1")
    assert done.returncode == 1
    assert "ConnectError" in done.stderr and done.stderr.count("\n") == 1
