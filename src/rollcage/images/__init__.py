"""Task images: pull, verify and unpack OCI images into a node's store; a copy-on-write root per rollout.

The public face::

    store = ImageStore()                       # $ROLLCAGE_IMAGE_STORE or ~/.cache/rollcage/images
    image = store.prepare("docker://localhost:5000/task:1")   # pulled and unpacked once per node
    with store.lease(image):                   # rm/prune keep it while a rollout uses it
        with cow_root(image, rollout_dir / "overlay", rollout_dir / "root") as root:
            ...                                # root.path: the image, writable, writes in root.upper

No container daemon is involved: the distribution API is spoken with httpx (``_registry``), layers
are unpacked by rollcage's own hardened tar reader (``_unpack``), and the store is a directory
tree guarded by flock (``_store``).
"""

from rollcage.images._overlay import CowRoot, cow_root
from rollcage.images._paths import find_program
from rollcage.images._ref import ImageRef, parse_ref
from rollcage.images._root import image_sandbox
from rollcage.images._store import (
    STORE_ENV,
    ImageConfig,
    ImageEntry,
    ImageStore,
    PreparedImage,
    PruneReport,
    default_store_path,
)
from rollcage.images._unpack import Limits

__all__ = [
    "STORE_ENV",
    "CowRoot",
    "ImageConfig",
    "ImageEntry",
    "ImageRef",
    "ImageStore",
    "Limits",
    "PreparedImage",
    "PruneReport",
    "cow_root",
    "default_store_path",
    "find_program",
    "image_sandbox",
    "parse_ref",
    "prepare",
]


def prepare(ref: str | ImageRef, store: ImageStore | None = None) -> PreparedImage:
    """The image ``ref`` names, ready to be a rollout's lower root (pulled and unpacked if missing)."""
    return (store or ImageStore()).prepare(ref)
