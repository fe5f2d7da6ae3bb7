"""Image references: where an image comes from, parsed once into a typed value.

Four transports, spelled as skopeo spells them::

    docker://REGISTRY/NAME[:TAG][@sha256:HEX]   a registry, over the OCI distribution API
    oci:PATH[:TAG]                              an OCI image layout (a directory with index.json)
    docker-archive:PATH                         a ``docker save`` tarball
    dir:PATH                                    a root file system, used in place

``docker://NAME`` without a registry means Docker Hub (``docker.io``, ``library/`` for one-word
names), as docker and skopeo read it. A malformed reference raises
:class:`~rollcage.errors.ImageReferenceError` with one line naming the bad part.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from rollcage.errors import ImageReferenceError

__all__ = ["DOCKER_HUB", "ImageRef", "parse_ref"]

DOCKER_HUB: Final = "docker.io"
_HUB_API: Final = "registry-1.docker.io"

# The distribution spec's grammar (docker/distribution reference/regexp.go), kept to what we use.
_COMPONENT: Final = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_TAG: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DIGEST: Final = re.compile(r"sha256:[0-9a-f]{64}")
_HOST: Final = re.compile(r"(?:[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*|\[[0-9A-Fa-f:]+\])(?::[0-9]{1,5})?")

Transport = Literal["docker", "oci", "docker-archive", "dir"]


@dataclass(frozen=True, slots=True)
class ImageRef:
    """A parsed image reference. Immutable; ``str()`` gives it back in canonical form."""

    transport: Transport
    """Where the image comes from."""
    registry: str | None = None
    """``docker``: the registry's host[:port] as written (``docker.io`` for Docker Hub); else ``None``."""
    repository: str | None = None
    """``docker``: the repository path (``library/debian``); else ``None``."""
    tag: str | None = None
    """``docker``/``oci``: the tag, ``None`` when not given (``docker`` then means ``latest`` unless a
    digest is given; ``oci`` then means the layout's only image)."""
    digest: str | None = None
    """``docker``: the manifest digest pinned with ``@sha256:…``; ``None`` when not pinned."""
    path: Path | None = None
    """``oci``/``docker-archive``/``dir``: the local path (made absolute); else ``None``."""

    def __str__(self) -> str:
        if self.transport == "docker":
            text = f"docker://{self.registry}/{self.repository}"
            if self.tag is not None:
                text += f":{self.tag}"
            if self.digest is not None:
                text += f"@{self.digest}"
            return text
        text = f"{self.transport}:{self.path}"
        return text + f":{self.tag}" if self.tag is not None else text

    @property
    def api_host(self) -> str:
        """The host[:port] to speak the distribution API to (Docker Hub's API lives elsewhere)."""
        if self.registry is None:
            raise ValueError(f"{self} has no registry")
        return _HUB_API if self.registry == DOCKER_HUB else self.registry

    @property
    def manifest_reference(self) -> str:
        """What to ask the registry's manifest endpoint for: the digest if pinned, else the tag."""
        return self.digest or self.tag or "latest"


def parse_ref(text: str) -> ImageRef:
    """Parse an image reference; raise ``ImageReferenceError`` naming the bad part."""
    if not isinstance(text, str) or not text.strip():
        raise ImageReferenceError("image reference is empty")
    text = text.strip()
    transport, sep, rest = text.partition(":")
    if not sep:
        raise ImageReferenceError(
            f"image reference {text!r} has no transport: write docker://, oci:, docker-archive: or dir:"
        )
    if transport == "docker":
        return _parse_docker(text, rest)
    if transport in ("oci", "docker-archive", "dir"):
        return _parse_local(text, transport, rest)  # type: ignore[arg-type]
    raise ImageReferenceError(
        f"image reference {text!r}: unknown transport {transport!r} (docker://, oci:, docker-archive:, dir:)"
    )


def _parse_docker(text: str, rest: str) -> ImageRef:
    if not rest.startswith("//"):
        raise ImageReferenceError(f"image reference {text!r}: the docker transport is written docker://")
    name = rest[2:]
    digest = None
    if "@" in name:
        name, _, digest = name.partition("@")
        if not _DIGEST.fullmatch(digest):
            raise ImageReferenceError(
                f"image reference {text!r}: digest {digest!r} is not sha256: and 64 lowercase hex digits"
            )
    tag = None
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        name, _, tag = name.rpartition(":")
        if not _TAG.fullmatch(tag):
            raise ImageReferenceError(f"image reference {text!r}: tag {tag!r} is not a valid tag")
    parts = name.split("/")
    if not name or not all(parts):
        raise ImageReferenceError(f"image reference {text!r}: repository name {name!r} is empty or has '//'")
    first = parts[0]
    if len(parts) > 1 and ("." in first or ":" in first or first == "localhost" or first.startswith("[")):
        registry, path = first, parts[1:]
        if not _HOST.fullmatch(registry):
            raise ImageReferenceError(f"image reference {text!r}: registry {registry!r} is not a host[:port]")
    else:
        registry, path = DOCKER_HUB, (["library", *parts] if len(parts) == 1 else parts)
    for component in path:
        if not _COMPONENT.fullmatch(component):
            raise ImageReferenceError(
                f"image reference {text!r}: repository component {component!r} "
                "must be lowercase letters, digits and . _ - separators"
            )
    return ImageRef("docker", registry=registry, repository="/".join(path), tag=tag, digest=digest)


def _parse_local(text: str, transport: Transport, rest: str) -> ImageRef:
    tag = None
    path = rest
    if transport == "oci" and ":" in rest:
        head, _, tail = rest.rpartition(":")
        if head and "/" not in tail:
            if not _TAG.fullmatch(tail):
                raise ImageReferenceError(f"image reference {text!r}: tag {tail!r} is not a valid tag")
            path, tag = head, tail
    if not path:
        raise ImageReferenceError(f"image reference {text!r}: the path is empty")
    if "\0" in path:
        raise ImageReferenceError(f"image reference {text!r}: the path holds a NUL byte")
    return ImageRef(transport, path=Path(path).expanduser().absolute(), tag=tag)
