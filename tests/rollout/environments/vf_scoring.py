"""The scores of the verifiers tasksets of the tests (vf_spelling, vf_counting), plain Python: the tests compute
what verifiers should give for a reply with the same functions the tasksets' rewards call."""

from __future__ import annotations

import re


def correct(reply: str, answer: str) -> float:
    """1 when the reply holds the word asked for."""
    return 1.0 if answer in reply else 0.0


def brief(reply: str) -> float:
    """1 for a reply of at most 12 characters."""
    return 1.0 if len(reply) <= 12 else 0.0


def counted(replies: list[str]) -> float:
    """The share of replies that say the number asked for (1, 2, 3, ...), in order."""
    said = [re.findall(r"\d+", reply)[:1] for reply in replies]
    return sum(1.0 for k, numbers in enumerate(said, 1) if numbers == [str(k)]) / max(len(replies), 1)


def spelled(word: str) -> str:
    """The speller tool's answer: the word's letters joined by dashes."""
    return "-".join(word)
