"""Tests of rollcage.controller, collect and export: a dataset through supervisors."""
