"""The hostile-image suite: each attack is refused, or made inert, with a one-line error, and nothing is
written outside the store."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollcage.errors import ImageRefusedError
from rollcage.images import ImageStore, Limits
from tests.helpers.oci import Image, Member, layer, sha256, snapshot


@pytest.fixture
def outside(tmp_path: Path) -> Iterator[Path]:
    """A directory beside the store that attacks aim at; the test checks nothing under tmp_path but the
    store changed."""
    target = tmp_path / "outside"
    target.mkdir()
    (target / "victim").write_text("host file\n")
    yield target


def _pull_refused(
    tmp_path: Path, image: Image, match: str, limits: Limits | None = None, *, layers_kept: int = 0
) -> str:
    layout = image.write_oci(tmp_path / "layout")
    store = ImageStore(tmp_path / "store", limits=limits)
    before = snapshot(*(p for p in tmp_path.iterdir() if p.name != "store"))
    with pytest.raises(ImageRefusedError, match=match) as caught:
        store.pull(f"oci:{layout}")
    message = str(caught.value)
    assert "\n" not in message
    assert snapshot(*(p for p in tmp_path.iterdir() if p.name != "store")) == before
    assert not list((store.path / "roots").iterdir())
    assert len(list((store.path / "layers").iterdir())) == layers_kept  # whole layers, used by no root
    assert not list((store.path / "tmp").iterdir())
    return message


def test_dotdot_member_names_are_refused(tmp_path: Path, outside: Path) -> None:
    depth = len(tmp_path.parts) + 8
    evil = layer(
        Member("ok", data=b"fine"), Member("../" * depth + str(outside / "victim")[1:], data=b"pwned")
    )
    message = _pull_refused(tmp_path, Image([evil]), r"'\.\.' in a member name")
    assert (outside / "victim").read_text() == "host file\n"
    assert "member" in message


def test_absolute_member_names_are_refused(tmp_path: Path, outside: Path) -> None:
    _pull_refused(
        tmp_path, Image([layer(Member(str(outside / "new"), data=b"pwned"))]), "absolute member names"
    )
    assert not (outside / "new").exists()


def test_writing_through_a_symlink_of_the_same_layer_is_refused(tmp_path: Path, outside: Path) -> None:
    evil = layer(Member("escape", kind="symlink", target=str(outside)), Member("escape/pwned", data=b"pwned"))
    _pull_refused(tmp_path, Image([evil]), "parent 'escape' is a link or a file")
    assert not (outside / "pwned").exists()


def test_a_relative_symlink_climbing_out_of_the_root_is_refused(tmp_path: Path) -> None:
    evil = layer(Member("a/b/link", kind="symlink", target="../../../outside"))
    _pull_refused(tmp_path, Image([evil]), "climbs out of the image root")


def test_absolute_symlinks_to_host_paths_are_kept_as_links_and_never_followed(
    tmp_path: Path, outside: Path
) -> None:
    """A later layer writing below an earlier layer's link replaces the link with a directory, as overlayfs
    does; the host path the link named is untouched."""
    first = layer(
        Member("escape", kind="symlink", target=str(outside)), Member("abs", kind="symlink", target="/etc")
    )
    second = layer(Member("escape", kind="dir"), Member("escape/pwned", data=b"pwned"))
    before = snapshot(outside)
    store = ImageStore(tmp_path / "store")
    image = store.pull(f"oci:{Image([first, second]).write_oci(tmp_path / 'layout')}")
    assert os.readlink(image.root / "abs") == "/etc"
    assert (image.root / "escape").is_dir() and not (image.root / "escape").is_symlink()
    assert (image.root / "escape/pwned").read_bytes() == b"pwned"
    only_first = store.pull(f"oci:{Image([first]).write_oci(tmp_path / 'layout1')}")
    assert os.readlink(only_first.root / "escape") == str(outside)
    assert snapshot(outside) == before


@pytest.mark.parametrize("target", ["/etc/passwd", "../../etc/passwd", "etc/passwd"])
def test_a_hard_link_to_a_host_file_is_refused(tmp_path: Path, target: str) -> None:
    evil = layer(Member("etc", kind="dir"), Member("etc/stolen", kind="hardlink", target=target))
    _pull_refused(tmp_path, Image([evil]), "hard link")


@pytest.mark.parametrize("kind", ["chardev", "blockdev"])
def test_device_nodes_are_refused(tmp_path: Path, kind: str) -> None:
    _pull_refused(tmp_path, Image([layer(Member("dev/mem", kind=kind))]), "device nodes are refused")


def test_setuid_and_setgid_bits_are_made_inert(tmp_path: Path) -> None:
    image = Image(
        [
            layer(
                Member("usr/bin/su", data=b"\x7fELF", mode=0o4755, uid=0),
                Member("usr/bin/wall", data=b"\x7fELF", mode=0o2755, uid=0, gid=5),
                Member("tmp", kind="dir", mode=0o1777),
                Member("shared", kind="dir", mode=0o2775),
            )
        ]
    )
    root = ImageStore(tmp_path / "store").pull(f"oci:{image.write_oci(tmp_path / 'layout')}").root
    assert stat.S_IMODE((root / "usr/bin/su").stat().st_mode) == 0o755
    assert stat.S_IMODE((root / "usr/bin/wall").stat().st_mode) == 0o755
    assert stat.S_IMODE((root / "tmp").stat().st_mode) == 0o1777
    assert stat.S_IMODE((root / "shared").stat().st_mode) == 0o775


def _sparse_layer(tmp_path: Path, size: int = 10 * 10**9) -> bytes:
    tar = shutil.which("tar")
    if tar is None:
        pytest.skip("GNU tar is not installed")
    work = tmp_path / "sparse-src"
    work.mkdir()
    with (work / "huge").open("wb") as f:
        f.truncate(size)
        f.seek(size // 2)
        f.write(b"needle")
    out = tmp_path / "sparse.tar"
    subprocess.run([tar, "--sparse", "--format=posix", "-cf", str(out), "-C", str(work), "huge"], check=True)
    (work / "huge").unlink()
    data = out.read_bytes()
    out.unlink()
    work.rmdir()
    return data


def test_a_10_gb_sparse_file_is_refused_before_a_byte_is_written(tmp_path: Path) -> None:
    sparse = _sparse_layer(tmp_path)
    assert len(sparse) < 1 << 20
    message = _pull_refused(
        tmp_path, Image([sparse]), "more than 1073741824 uncompressed bytes", Limits(max_image_bytes=1 << 30)
    )
    assert "huge" in message


def test_a_sparse_file_within_the_limit_is_stored_as_holes(tmp_path: Path) -> None:
    size = 2 * 10**9
    image = Image([_sparse_layer(tmp_path, size)])
    root = ImageStore(tmp_path / "store").pull(f"oci:{image.write_oci(tmp_path / 'layout')}").root
    st = (root / "huge").stat()
    assert st.st_size == size and st.st_blocks * 512 < 1 << 20
    with (root / "huge").open("rb") as f:
        f.seek(size // 2)
        assert f.read(6) == b"needle"


def test_a_gzip_bomb_stops_at_the_cap(tmp_path: Path) -> None:
    bomb = bytes(64 << 20)  # a stream of zeros: an empty tar, then 64 MiB more to decompress
    image = Image([bomb])
    _pull_refused(tmp_path, image, "decompressed layer is over", Limits(max_image_bytes=4 << 20))


def test_files_larger_than_the_limit_in_sum_are_refused(tmp_path: Path) -> None:
    image = Image([layer(Member("a", data=b"x" * (3 << 20))), layer(Member("b", data=b"y" * (3 << 20)))])
    limits = Limits(max_image_bytes=4 << 20)
    _pull_refused(tmp_path, image, "more than 4194304 uncompressed bytes", limits, layers_kept=1)


def _tamper(layout: Path, digest: str, data: bytes) -> None:
    path = layout / "blobs" / "sha256" / digest[7:]
    path.chmod(0o644)
    path.write_bytes(data)


def test_a_manifest_that_does_not_match_its_digest_is_refused(tmp_path: Path) -> None:
    image = Image([layer(Member("f", data=b"ok"))])
    layout = image.write_oci(tmp_path / "layout")
    manifest, _ = image.manifest()
    _tamper(layout, sha256(manifest), manifest.replace(b'"schemaVersion": 2', b'"schemaVersion":  2'))
    with pytest.raises(ImageRefusedError, match="manifest: its digest is"):
        ImageStore(tmp_path / "store").pull(f"oci:{layout}")


def test_a_config_that_does_not_match_its_digest_is_refused(tmp_path: Path) -> None:
    image = Image([layer(Member("f", data=b"ok"))])
    layout = image.write_oci(tmp_path / "layout")
    config = json.loads(image.config())
    config["config"]["Env"] = ["LD_PRELOAD=/evil.so"]
    _tamper(layout, image.id, json.dumps(config).encode())
    with pytest.raises(ImageRefusedError, match="config: its digest is"):
        ImageStore(tmp_path / "store").pull(f"oci:{layout}")


def test_a_layer_blob_that_does_not_match_its_digest_is_refused(tmp_path: Path) -> None:
    image = Image([layer(Member("f", data=b"genuine"))])
    layout = image.write_oci(tmp_path / "layout")
    forged = Image([layer(Member("f", data=b"forged!"))])
    _tamper(layout, sha256(image.blobs()[0]), forged.blobs()[0])
    _pull_refused_at(tmp_path, f"oci:{layout}", "blob digest is")


def test_a_layer_whose_content_does_not_match_the_config_diff_id_is_refused(tmp_path: Path) -> None:
    """A docker archive names no blob digests: the config's diff_ids are what vouch for the layers."""
    image = Image([layer(Member("f", data=b"genuine"))])
    archive = image.write_docker_archive(tmp_path / "a.tar")
    forged = layer(Member("f", data=b"forged!"))
    data = archive.read_bytes().replace(image.layers[0], forged)
    archive.write_bytes(data)
    _pull_refused_at(tmp_path, f"docker-archive:{archive}", "uncompressed digest")


def _pull_refused_at(tmp_path: Path, ref: str, match: str) -> None:
    store = ImageStore(tmp_path / "store")
    with pytest.raises(ImageRefusedError, match=match) as caught:
        store.pull(ref)
    assert "\n" not in str(caught.value)
    assert not list((store.path / "layers").iterdir())
    assert not list((store.path / "roots").iterdir())
