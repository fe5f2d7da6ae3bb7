"""The code-fn resource app; the code lives in ``rollcage.environments.code_fn``."""

from rollcage.environments.code_fn import create_app

__all__ = ["create_app"]
