"""Tests of rollcage.environments: bundled resource servers, graders, NeMo Gym's protocol."""
