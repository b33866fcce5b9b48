"""Asynchronous RL (`trainer.mode=async`): rollout workers (`pool`, `workers`, `weights`, `interruptible`) sample
while the trainer (`loop`) learns, within a staleness bound.

Steps 1 to 6 (docs/architecture.md) with step 1 in worker processes, overlapping the others.
"""
