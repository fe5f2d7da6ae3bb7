"""Tests of rollcage.viewer: show and report."""
