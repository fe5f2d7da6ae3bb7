"""``rollcage images pull|ls|rm|prune``: the node's image store.

Exit codes: 0 done; 2 a wrong reference, an image refused (unsafe, corrupt, too large), or a
wrong command line; 1 the registry or the disk failed (a later pull resumes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

__all__ = ["app"]

app = typer.Typer(
    name="images",
    help="Task images: pull and unpack OCI images into this node's store, list and remove them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_STORE_HELP = "The image store; default: $ROLLCAGE_IMAGE_STORE, else ~/.cache/rollcage/images."
StoreOption = Annotated[Path | None, typer.Option("--store", help=_STORE_HELP)]
RefArgument = Annotated[
    str,
    typer.Argument(
        help="docker://REGISTRY/NAME[:TAG|@sha256:...], oci:PATH[:TAG], docker-archive:PATH or dir:PATH.",
        show_default=False,
    ),
]


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


@app.command("pull")
def pull(
    ref: RefArgument,
    store: StoreOption = None,
    insecure: Annotated[
        bool,
        typer.Option(
            "--insecure",
            help="Allow plain http:// to this registry (loopback registries never need it).",
        ),
    ] = False,
) -> None:
    """Pull an image and unpack it once into the store; print its id and root."""
    from rollcage.images import ImageStore

    image = ImageStore(store, insecure=insecure).pull(ref)
    typer.echo(f"{image.ref}  {image.digest}  {image.root}")


@app.command("ls")
def ls(store: StoreOption = None) -> None:
    """List the images in the store: reference, image id, unpacked size, rollouts using it now."""
    from rollcage.images import ImageStore

    entries = ImageStore(store).list()
    if not entries:
        typer.echo("no images")
        return
    width = max(len(e.ref) for e in entries)
    for e in entries:
        used = f"  in use by {e.in_use}" if e.in_use else ""
        typer.echo(f"{e.ref:<{width}}  {e.digest[7:19]}  {_size(e.bytes):>10}{used}")


@app.command("rm")
def rm(ref: RefArgument, store: StoreOption = None) -> None:
    """Forget a reference; its files go too unless another reference names it or a rollout uses it."""
    from rollcage.images import ImageStore

    removed = ImageStore(store).remove(ref)
    typer.echo(f"removed {ref}" if removed else f"untagged {ref} (its image is kept: named or in use)")


@app.command("prune")
def prune(
    store: StoreOption = None,
    everything: Annotated[
        bool,
        typer.Option("--all", help="Also remove images a reference names, when no rollout uses them."),
    ] = False,
) -> None:
    """Remove what nothing needs: unnamed images no rollout uses, their layers, interrupted pulls."""
    from rollcage.images import ImageStore

    report = ImageStore(store).prune(everything=everything)
    typer.echo(f"removed {len(report.images)} image(s), {report.layers} layer(s), {report.other} leftover(s)")
