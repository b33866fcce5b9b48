"""RL training: `learn` (one batch -> optimizer steps, shared by both modes) and the synchronous loop (`sync`)."""
