"""Alias of ``attention.config`` for the serving preflight (``serving/preflight.py`` imports ``check_env`` from
here); remove once it imports ``attention.config``."""

from .config import BF16_ONLY_IMPLS, IMPLS, KEYS, QK_MODES, check_env, parse_config  # noqa: F401
