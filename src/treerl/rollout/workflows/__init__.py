"""Workflows: a task's prompts -> samples -> rewards -> training sequences, single-turn (`single_turn.py`) and
branching multi-turn (`multi_turn.py`); one model call as a sequence (`sequences.py`), what a step kept and dropped
(`stats.py`), the samples as people read them (`trajectories.py`).

Steps 1 and 2 (docs/architecture.md): imports `sampling`, `tasks`, `rewards` and `conversations` below it.
"""
