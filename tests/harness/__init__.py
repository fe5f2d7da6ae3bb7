"""Tests of rollcage.harness: NOOA and command-line agents."""
