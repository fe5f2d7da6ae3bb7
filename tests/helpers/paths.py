"""Where the tests find the repository's files, whatever folder a test module sits in."""

from __future__ import annotations

from pathlib import Path

__all__ = ["EXAMPLES", "FIXTURES", "HELPERS", "REPO"]

REPO = Path(__file__).resolve().parents[2]
"""The repository's root."""
EXAMPLES = REPO / "examples"
"""The bundled examples."""
HELPERS = REPO / "tests" / "helpers"
"""Test helper scripts run as child processes."""
FIXTURES = REPO / "tests" / "fixtures"
"""Recorded fixtures."""
