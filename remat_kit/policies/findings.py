"""Findings: what a check found, raised where a user applies a policy and collected where a report is made.

:func:`remat_kit.apply`'s guard (:mod:`remat_kit.unedited.guard`) raises a one-line ``ValueError`` when a policy
would change nothing. Inside a report (``inspect``, ``compare``, ``fit``) the same finding is a line of the report
instead, so one bad row does not stop the table: the report runs its traces inside :func:`collect`.

>>> with collect() as found:
...     report("the policy changes nothing")
>>> found
['the policy changes nothing']
>>> report("the policy changes nothing")
Traceback (most recent call last):
...
ValueError: the policy changes nothing
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_FOUND: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("remat_kit_findings", default=None)


@contextlib.contextmanager
def collect() -> Iterator[list[str]]:
    """Context: findings reported inside are gathered in the list it yields (once each), not raised."""
    found: list[str] = []
    token = _FOUND.set(found)
    try:
        yield found
    finally:
        _FOUND.reset(token)


def report(message: str) -> None:
    """Raise ``ValueError(message)``, or inside :func:`collect` add it to the findings (once)."""
    found = _FOUND.get()
    if found is None:
        raise ValueError(message)
    if message not in found:
        found.append(message)
