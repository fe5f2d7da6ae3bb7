"""Tests of rollcage.agent, trajectory and resume: the loop and its record."""
