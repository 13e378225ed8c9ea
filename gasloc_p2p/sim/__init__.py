"""In-process swarm simulator: N workers on one machine, a driver of the pure core.

Synchronous rounds (docs/algorithm.md section 1) and an event-driven asynchronous mode (section 2)
with per-worker compute speed and per-link bandwidth; simulated wall-clock time is reported.
"""
