"""Tests of rollcage.commands: the CLI verbs."""
