"""Tests of rollcage.model: the model client, the wire formats, token data."""
