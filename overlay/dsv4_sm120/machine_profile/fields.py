"""What the decisions' profile fields share (pure): the check of an object of named entries."""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence


def keyed_problem(d: object, field: str, what: str, allowed: Sequence[str],
                  problem: Callable[[object], Optional[str]], nonempty: bool = False) -> Optional[str]:
    """None when ``d[field]`` is an object (``nonempty``: with an entry) whose keys are in ``allowed`` and whose
    entries ``problem`` finds nothing wrong with; else the first problem in words, naming ``what`` and its key."""
    if not isinstance(d, Mapping) or not isinstance(d.get(field), Mapping) or (nonempty and not d[field]):
        return f"no {field} object"
    for key, entry in d[field].items():
        if key not in allowed:
            return f"{what} {key!r}: expected one of {', '.join(allowed)}"
        why = problem(entry)
        if why:
            return f"{what} {key}: {why}"
    return None
