"""Asynchronous RL (`trainer.mode=async`): rollout workers (`pool`, `workers`, `weights`, `interruptible`) sample
while the trainer (`loop`) learns, within a staleness bound."""
