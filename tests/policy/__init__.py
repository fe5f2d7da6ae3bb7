"""Tests of rollcage.policy: the scripted model server."""
