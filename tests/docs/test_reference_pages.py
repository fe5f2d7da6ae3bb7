"""The reference pages' generated parts cover the code, and the code's pointers into docs/ resolve."""

from __future__ import annotations

import importlib.util
import re
from types import ModuleType, SimpleNamespace

import pytest

from tests.helpers.paths import REPO

DOCS = REPO / "docs"


@pytest.fixture(scope="module")
def hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", REPO / "scripts" / "docs_hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_lists_every_verb_and_option(hooks: ModuleType) -> None:
    import typer.main

    from rollcage.cli import _build_app

    page = hooks.cli_reference()
    root = typer.main.get_command(_build_app())
    for name, command in hooks._walk(root, "rollcage"):
        assert f"## `{name}`" in page
        for param in command.params:
            if param.param_type_name == "option" and not param.hidden:
                assert param.opts[0] in page, (name, param.opts[0])


def test_schema_reference_covers_every_artifact(hooks: ModuleType) -> None:
    from rollcage.protocol import artifact_models

    page = hooks.schema_reference()
    for name in artifact_models():
        assert f"### {name}" in page
        assert f'JSON Schema of {name}"' in page


def test_every_generated_part_of_every_page_expands(hooks: ModuleType) -> None:
    pages = sorted(DOCS.rglob("*.md"))
    expanded = 0
    for path in pages:
        text = path.read_text(encoding="utf-8")
        page = SimpleNamespace(file=SimpleNamespace(src_uri=str(path.relative_to(DOCS))))
        result = hooks.on_page_markdown(text, page=page, config=None, files=None)
        assert "<!-- rollcage:" not in result, path
        expanded += text.count("<!-- rollcage:")
    assert expanded >= 9


def test_an_unknown_generated_part_fails_the_build(hooks: ModuleType) -> None:
    page = SimpleNamespace(file=SimpleNamespace(src_uri="x.md"))
    with pytest.raises(ValueError, match="unknown generated part"):
        hooks.on_page_markdown("<!-- rollcage:nothing -->\n", page=page, config=None, files=None)


def test_the_codes_pointers_into_the_docs_exist() -> None:
    pointers: set[str] = set()
    for source in (REPO / "src").rglob("*.py"):
        text = source.read_text(encoding="utf-8")
        assert "DESIGN.md" not in text, f"{source}: refers to DESIGN.md, which is not in the repository"
        pointers.update(re.findall(r"\bdocs/[\w/.-]+\.md\b", text))
    assert pointers
    missing = sorted(pointer for pointer in pointers if not (REPO / pointer).is_file())
    assert not missing, missing


def test_the_health_reference_lists_every_check() -> None:
    from rollcage.controller._health import HEALTH_CHECKS

    page = (REPO / "docs" / "reference" / "health.md").read_text()
    assert [name for name in HEALTH_CHECKS if f"`{name}`" not in page] == []
