"""The store works for a user without privileges: no ownership kept, read-only directories handled."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

from tests.helpers.oci import Image, Member, layer
from tests.helpers.unprivileged import chown_tree, make_test_user, run_as, user_dir


def test_an_unprivileged_user_pulls_composes_and_prunes() -> None:
    user = make_test_user()
    image = Image(
        [
            layer(
                Member("ro", kind="dir", mode=0o555), Member("ro/a", data=b"a", uid=0), Member("x", data=b"x")
            ),
            layer(Member("ro", kind="dir", mode=0o555), Member("ro/b", data=b"b"), Member(".wh.x")),
        ]
    )
    with user_dir(user) as home:
        layout = image.write_oci(home / "layout")
        chown_tree(home, user)
        store = home / "store"

        def images(*args: str) -> str:
            done = run_as(
                user, [sys.executable, "-m", "rollcage", "images", *args, "--store", str(store)], home=home
            )
            assert done.returncode == 0, done.stdout
            return done.stdout

        root = Path(images("pull", f"oci:{layout}").split()[2])
        assert sorted(os.listdir(root / "ro")) == ["a", "b"] and not (root / "x").exists()
        assert stat.S_IMODE((root / "ro").stat().st_mode) == 0o555
        assert (root / "ro/a").stat().st_uid == user.uid
        images("rm", f"oci:{layout}")
        assert images("prune").startswith("removed 0 image(s), 2 layer(s)")
        assert not (store / "layers").exists() or not list((store / "layers").iterdir())
