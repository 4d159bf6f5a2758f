"""Errors and exit codes shared by the FP8 tuner's modules."""

EXIT_OK = 0
EXIT_USAGE = 2          # bad usage, no GPU, SGLang's kernel not loadable
EXIT_INCOMPLETE = 3     # stopped by --time-budget; rerunning the same command continues


class UsageError(Exception):
    """Bad input or an unusable environment: one line for the user, exit code 2."""


class CandidateError(Exception):
    """A candidate config failed (compile error, launch error, wrong result)."""
