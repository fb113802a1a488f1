"""Verifiable rewards for arithmetic answers.

SmolLM2 answers "What is 23 + 45?" with "23 + 45 = 78", so the answer is the last
number in the response, not the whole text.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> str | None:
    """The last number written in `text` (thousands separators removed), or None."""
    found = _NUMBER.findall(text.replace(",", ""))
    return found[-1] if found else None


def first_number(text: str) -> str | None:
    """The first number written in `text` (thousands separators removed), or None."""
    found = _NUMBER.search(text.replace(",", ""))
    return found.group(0) if found else None


def exact_number_reward(response: str, answer: str, pick: str = "last") -> float:
    """1.0 when the last (or first) number in the response equals the reference answer, else 0.0."""
    got = last_number(response) if pick == "last" else first_number(response)
    if got is None:
        return 0.0
    try:
        return 1.0 if float(got) == float(answer) else 0.0
    except ValueError:
        return 0.0
