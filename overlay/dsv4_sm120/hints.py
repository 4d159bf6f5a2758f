"""Hints that name a command's options, in the form the user can type where the command runs, and how a command
ends on a usage error or Ctrl-C (:func:`run_command`).

The Makefile sets ``DSV4_SM120_MAKE_TARGET`` for the targets that run a command with ``ARGS``: there a hint
names the whole make command (``make calibrate ARGS=--dry-run``), because a bare option after ``make``
is read by make itself (``make calibrate --dry-run`` is make's own dry run). Run directly
(``python -m ...``), a hint names the options as they are.
"""

from __future__ import annotations

import shlex
import sys
from typing import Callable


def make_target() -> str:
    """The make target running this process ('' when not run by a make target)."""
    from dsv4_sm120 import settings

    try:
        return (settings.get("DSV4_SM120_MAKE_TARGET") or "").strip()
    except settings.SettingsError:
        return ""


def args(options: str) -> str:
    """``options`` (e.g. ``--dry-run``, ``--mem dram``) as the user types them here: ``make <target>
    ARGS=<options>`` under make, the options themselves otherwise."""
    target = make_target()
    if not target:
        return options
    return f"make {target} ARGS={shlex.quote(options)}"


def run_command(body: Callable[[], int], usage_error: type, interrupted: str, exit_usage: int = 2) -> int:
    """``body()``'s exit code; a ``usage_error`` it raises is one line on stderr (``error: ...``, exit
    ``exit_usage``), Ctrl-C the line ``interrupted`` (exit 130): never a traceback."""
    try:
        return body()
    except usage_error as e:
        print(f"error: {e}", file=sys.stderr)
        return exit_usage
    except KeyboardInterrupt:
        print(f"\n{interrupted}", file=sys.stderr)
        return 130
