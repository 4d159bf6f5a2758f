"""Refuse the retired names of settings where no dsv4_sm120 process validates the environment first: every make
target and ``scripts/setup_env.sh`` (which runs before any environment exists, with the system's python3).

    python -m dsv4_sm120.retired_names [NAME ...]

prints one line naming each retired name (``dsv4_sm120.settings.RENAMED``, as CHANGELOG.md lists them) that is
set in the environment or is among the NAMEs (the Makefile passes the variables given on its command line), with
its new name, and exits 2; prints nothing and exits 0 when there is none. Imports only the settings module.
"""

from __future__ import annotations

import os
import sys
from typing import Iterable, List, Mapping, Optional

from dsv4_sm120.settings import RENAMED


def found(environ: Mapping[str, str], names: Iterable[str] = ()) -> List[str]:
    """The retired names set in ``environ`` or among ``names``, sorted."""
    return sorted({n for n in list(environ) + list(names) if n in RENAMED})


def message(retired: List[str]) -> str:
    """One line for the retired names in ``retired`` ('' when empty)."""
    if not retired:
        return ""
    return ("; ".join(f"{n} was renamed to {RENAMED[n]}" for n in retired)
            + " (CHANGELOG.md lists the renamed settings): set the new name instead, nothing was done")


def main(argv: Optional[List[str]] = None) -> int:
    msg = message(found(os.environ, sys.argv[1:] if argv is None else argv))
    if msg:
        print(msg)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
