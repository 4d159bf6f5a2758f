"""Apply, revert, check and inspect the patch series on a pinned SGLang tree.

Usage: ``python -m dsv4_sm120.patching {apply,revert,status,check,lock} --help``

It runs with the standard library alone from a bare checkout (``make apply-patches`` with
``PYTHONPATH=overlay``, before any environment has the package). Its parts: :mod:`.common` (error, pinned
wheels, hashing), :mod:`.series` (diff parsing, the strict applier, the series and its lock), :mod:`.tree` (the
SGLang tree), :mod:`.ops` (the apply / revert state machine with its manifest), :mod:`.wheel` (the pristine
wheel, lock and check) and :mod:`.cli`; every name is importable from this package as well.

Model
-----
* ``patches/series`` lists ``*.patch`` files in order.  Each patch is a unified
  diff whose paths are relative to the ``sglang`` package directory
  (``--- a/srt/...`` / ``+++ b/srt/...``); text before the first ``---`` line is
  the patch's header (what and why).
* ``SGLANG_ROOT`` is the ``sglang`` package directory (the one holding
  ``__init__.py`` and ``srt/``).  A directory that *contains* ``sglang/`` is
  accepted too.
* ``patches/targets.lock`` records, for the pinned SGLang release, the sha256
  of every target file before (``pristine``; ``null`` for files the series
  creates) and after (``patched``) the whole series, and the series hash it was
  made with.
* Applying is all-or-nothing: the target files are copied to a scratch
  directory, every patch is applied there (a strict applier: context must match
  exactly), the results are checked against the lock, and only then are the
  originals backed up and the targets replaced one by one with atomic renames.
  The record lives in ``SGLANG_ROOT/.dsv4_sm120/manifest.json`` with the backups
  beside it; a crash half-way leaves ``state: applying`` and the next ``apply``
  or ``revert`` rolls it back from the backups first.

Exit codes: 0 success (or nothing to do), 1 refused/failed with nothing changed,
2 bad usage or environment.
"""

from dsv4_sm120.paths import (BACKUP_DIR, MANIFEST, STATE_DIR, applied_repo_root, cache_dir,
                              installed_sglang_root, read_manifest, repo_root)

from .common import (default_series_path, load_pinned_wheels, PatchError, PINNED_WHEELS, sha256_bytes, sha256_file,
                     wheels_file)
from .series import (apply_hunks, apply_series_to_contents, FilePatch, Hunk, _HUNK_RE, load_lock, load_series,
                     parse_patch, Patch, read_text, Series, split_lines, _strip_prefix)
from .tree import (absolute_python, check_python, check_version, record_hashes, resolve_root, run_python, _say,
                   tree_version, _write_manifest)
from .ops import (apply, apply_safely, expected_pristine, _install_overlay, installed_overlay, overlay_tree_hash,
                  revert, _rollback, status)
from .wheel import (check, extract_pristine, make_lock, pinned_wheel, pristine_contents)
from .cli import (default_status_python, main)
