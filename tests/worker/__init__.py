"""Tests of rollcage.worker: the sandbox entrypoint, its input and hostile models."""
