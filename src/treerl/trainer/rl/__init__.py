"""RL training: `learn` (one batch -> optimizer steps, shared by both modes) and the synchronous loop (`sync`).

Steps 1 to 6 (docs/architecture.md) for RL.
"""
