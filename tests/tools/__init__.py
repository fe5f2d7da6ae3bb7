"""Tests of rollcage.tools: the Python executors and resource tools."""
