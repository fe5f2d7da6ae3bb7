"""``rollcage.controller``'s face is lazy (PEP 562): a name's module is imported when the name is asked for.

The rooms that need one name of the controller (the viewer's health checks, export's records)
must not pay for all of it (``bench/lean.py``); the face still offers every name of ``__all__``,
to ``dir()``, ``from ... import *`` and attribute access alike.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import rollcage.controller as face


def _loaded_after(code: str) -> list[str]:
    """The controller's modules a fresh interpreter has loaded after running ``code``."""
    probe = (
        f"{code}\nimport json, sys\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('rollcage.controller.'))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_the_face_imports_none_of_its_modules() -> None:
    assert _loaded_after("import rollcage.controller") == []


def test_a_name_imports_its_module_and_what_that_module_needs_only() -> None:
    loaded = _loaded_after("from rollcage.controller import rollout_id")
    assert loaded == ["rollcage.controller._ids"]


def test_every_name_of_the_face_is_offered_and_is_its_modules_own() -> None:
    import importlib

    assert set(face.__all__) <= set(dir(face))
    for name in face.__all__:
        home = importlib.import_module(face._HOMES[name])
        assert getattr(face, name) is getattr(home, name), name
    namespace: dict[str, object] = {}
    exec("from rollcage.controller import *", namespace)
    assert set(face.__all__) <= set(namespace)


def test_a_name_the_face_does_not_offer_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        face.Nope  # noqa: B018
