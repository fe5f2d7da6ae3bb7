"""Image references parse into typed values, and a malformed one is refused naming the bad part."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollcage.errors import ConfigError, ImageReferenceError
from rollcage.images import ImageRef, parse_ref


def test_docker_reference_with_registry_tag_and_digest() -> None:
    digest = "sha256:" + "ab" * 32
    ref = parse_ref(f"docker://localhost:5000/team/task:v1@{digest}")
    assert (ref.transport, ref.registry, ref.repository, ref.tag, ref.digest) == (
        "docker",
        "localhost:5000",
        "team/task",
        "v1",
        digest,
    )
    assert ref.manifest_reference == digest
    assert ref.api_host == "localhost:5000"


def test_docker_hub_short_names_get_library_and_the_api_host() -> None:
    ref = parse_ref("docker://debian:bookworm")
    assert (ref.registry, ref.repository, ref.tag, ref.api_host) == (
        "docker.io",
        "library/debian",
        "bookworm",
        "registry-1.docker.io",
    )
    assert parse_ref("docker://python").manifest_reference == "latest"


def test_local_references_carry_absolute_paths_and_oci_tags(tmp_path: Path) -> None:
    assert parse_ref(f"oci:{tmp_path}/layout:v2") == ImageRef("oci", path=tmp_path / "layout", tag="v2")
    assert parse_ref(f"oci:{tmp_path}/layout").tag is None
    assert parse_ref(f"docker-archive:{tmp_path}/a.tar").path == tmp_path / "a.tar"
    assert parse_ref("dir:rel/root").path == Path.cwd() / "rel" / "root"


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("", "empty"),
        ("debian:12", "transport 'debian'"),
        ("ubuntu", "no transport"),
        ("docker:debian", "docker://"),
        ("docker://Debian", "'Debian'"),
        ("docker://localhost:5000/x:bad/tag", "'x:bad'"),
        ("docker://x@sha256:123", "'sha256:123'"),
        ("docker://host.example//x", "'//'"),
        ("oci:", "path is empty"),
        ("podman://x", "unknown transport 'podman'"),
    ],
)
def test_a_malformed_reference_is_refused_naming_the_part(text: str, names: str) -> None:
    with pytest.raises(ImageReferenceError) as caught:
        parse_ref(text)
    message = str(caught.value)
    assert names in message and "\n" not in message
    assert isinstance(caught.value, ConfigError)


_COMPONENT = st.from_regex(r"[a-z0-9]{1,8}(?:[._-][a-z0-9]{1,5})?", fullmatch=True)


@settings(max_examples=50, deadline=None)
@given(
    registry=st.sampled_from(["localhost:5000", "registry.example.com", "127.0.0.1:8080", "docker.io"]),
    path=st.lists(_COMPONENT, min_size=1, max_size=3),
    tag=st.none() | st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,20}", fullmatch=True),
    digest=st.none() | st.from_regex(r"sha256:[0-9a-f]{64}", fullmatch=True),
)
def test_canonical_form_parses_back_to_the_same_reference(
    registry: str, path: list[str], tag: str | None, digest: str | None
) -> None:
    ref = parse_ref(
        str(
            parse_ref(
                f"docker://{registry}/{'/'.join(path)}"
                + (f":{tag}" if tag else "")
                + (f"@{digest}" if digest else "")
            )
        )
    )
    assert parse_ref(str(ref)) == ref
    assert ref.tag == tag and ref.digest == digest
