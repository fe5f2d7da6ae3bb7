"""Tests of rollcage.supervisor and cage: one rollout, its sandbox, proxy and budgets."""
