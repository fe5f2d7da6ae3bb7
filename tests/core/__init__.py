"""Tests of the bottom rooms: errors, procs, protocol, durable; and the architecture's rules."""
