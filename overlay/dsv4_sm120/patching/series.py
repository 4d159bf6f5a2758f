"""Unified diff parsing, the strict applier (no fuzz; offsets allowed) and the patch series with its lock."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional
from .common import PatchError, default_series_path


@dataclass
class Hunk:
    old_start: int
    old_lines: List[str]
    new_lines: List[str]


@dataclass
class FilePatch:
    path: str  # relative to SGLANG_ROOT
    is_new: bool
    is_delete: bool
    hunks: List[Hunk] = field(default_factory=list)


@dataclass
class Patch:
    name: str
    text: str
    header: str
    files: List[FilePatch]


_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _strip_prefix(p: str) -> str:
    p = p.split("\t")[0].strip()
    if p == "/dev/null":
        return p
    if p.startswith("a/") or p.startswith("b/"):
        return p[2:]
    raise PatchError(f"path {p!r} does not start with a/ or b/")


def split_lines(s: str) -> List[str]:
    """Split on '\n' only (str.splitlines also splits on form feeds and friends), keeping ends."""
    parts = s.split("\n")
    out = [p + "\n" for p in parts[:-1]]
    if parts[-1]:
        out.append(parts[-1])
    return out


def read_text(path: Path) -> str:
    return path.read_bytes().decode("utf-8")


def parse_patch(name: str, text: str) -> Patch:
    lines = split_lines(text)
    i = 0
    header: List[str] = []
    while i < len(lines) and not (lines[i].startswith("--- ") and i + 1 < len(lines)
                                  and lines[i + 1].startswith("+++ ")):
        header.append(lines[i])
        i += 1
    files: List[FilePatch] = []
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            old = _strip_prefix(line[4:])
            new = _strip_prefix(lines[i + 1][4:])
            path = new if new != "/dev/null" else old
            fp = FilePatch(path=path, is_new=old == "/dev/null", is_delete=new == "/dev/null")
            files.append(fp)
            i += 2
            continue
        m = _HUNK_RE.match(line)
        if m:
            if not files:
                raise PatchError(f"{name}: hunk before any file header")
            n_old = int(m.group(2)) if m.group(2) is not None else 1
            n_new = int(m.group(4)) if m.group(4) is not None else 1
            old_l: List[str] = []
            new_l: List[str] = []
            i += 1
            last = ""
            while i < len(lines):
                l = lines[i]
                if l.startswith("\\"):  # "\ No newline at end of file": previous line has no newline
                    for tag_, seq in ((" ", old_l), (" ", new_l), ("-", old_l), ("+", new_l)):
                        if last == tag_ and seq and seq[-1].endswith("\n"):
                            seq[-1] = seq[-1][:-1]
                    i += 1
                    continue
                if len(old_l) >= n_old and len(new_l) >= n_new:
                    break
                tag, body = l[:1], l[1:]
                if l == "\n":  # an empty context line whose leading space was stripped
                    tag, body = " ", "\n"
                if tag == " ":
                    old_l.append(body)
                    new_l.append(body)
                elif tag == "-":
                    old_l.append(body)
                elif tag == "+":
                    new_l.append(body)
                else:
                    raise PatchError(f"{name}: malformed hunk line {i + 1}: {l[:60]!r}")
                last = tag
                i += 1
            if len(old_l) != n_old or len(new_l) != n_new:
                raise PatchError(f"{name}: truncated hunk in {files[-1].path}")
            files[-1].hunks.append(Hunk(int(m.group(1)), old_l, new_l))
            continue
        i += 1
    if not files:
        raise PatchError(f"{name}: no file diffs found")
    return Patch(name=name, text=text, header="".join(header), files=files)


def apply_hunks(content: Optional[str], fp: FilePatch, patch_name: str) -> Optional[str]:
    """Apply one file's hunks strictly. Returns new content (None = deleted)."""
    if fp.is_new:
        if content is not None:
            raise PatchError(f"{patch_name}: {fp.path} should not exist yet but does")
        return "".join(h for hk in fp.hunks for h in hk.new_lines)
    if content is None:
        raise PatchError(f"{patch_name}: {fp.path} does not exist")
    src = split_lines(content)
    out: List[str] = []
    pos = 0  # index in src of next unconsumed line
    for hk in fp.hunks:
        want = hk.old_start - 1 if hk.old_lines else hk.old_start
        n = len(hk.old_lines)
        found = None
        # exact position first, then nearest offset, never before `pos`
        for delta in range(0, len(src) + 1):
            for cand in (want + delta, want - delta) if delta else (want,):
                if cand < pos or cand + n > len(src):
                    continue
                if src[cand:cand + n] == hk.old_lines:
                    found = cand
                    break
            if found is not None:
                break
        if found is None:
            raise PatchError(
                f"{patch_name}: hunk at line {hk.old_start} of {fp.path} does not match "
                "(file differs from what the patch expects)")
        out.extend(src[pos:found])
        out.extend(hk.new_lines)
        pos = found + n
    out.extend(src[pos:])
    if fp.is_delete:
        return None
    return "".join(out)


# --------------------------------------------------------------------------
# Series
# --------------------------------------------------------------------------


@dataclass
class Series:
    path: Path
    patches: List[Patch]

    @property
    def hash(self) -> str:
        h = hashlib.sha256()
        for p in self.patches:
            h.update(p.name.encode() + b"\0" + p.text.encode() + b"\0")
        return h.hexdigest()

    @property
    def targets(self) -> List[str]:
        seen: List[str] = []
        for p in self.patches:
            for f in p.files:
                if f.path not in seen:
                    seen.append(f.path)
        return seen

    @property
    def created(self) -> List[str]:
        """Targets that do not exist in the pristine tree (first touch creates them)."""
        first: Dict[str, bool] = {}
        for p in self.patches:
            for f in p.files:
                first.setdefault(f.path, f.is_new)
        return [k for k, v in first.items() if v]

    def lock_path(self) -> Path:
        return self.path.parent / "targets.lock"


def load_series(path: Optional[Path] = None) -> Series:
    path = Path(path) if path else default_series_path()
    if not path.is_file():
        raise PatchError(f"series file not found: {path}", 2)
    names = []
    for raw in path.read_text().splitlines():
        s = raw.split("#", 1)[0].strip()
        if s:
            names.append(s)
    if not names:
        raise PatchError(f"{path} lists no patches", 2)
    patches = []
    for n in names:
        pf = path.parent / n
        if not pf.is_file():
            raise PatchError(f"{path} names {n}, which does not exist", 2)
        patches.append(parse_patch(n, read_text(pf)))
    return Series(path=path, patches=patches)


def apply_series_to_contents(series: Series, contents: Dict[str, Optional[str]]) -> Dict[str, Optional[str]]:
    cur = dict(contents)
    for p in series.patches:
        for f in p.files:
            cur[f.path] = apply_hunks(cur.get(f.path), f, p.name)
    return cur


def load_lock(series: Series) -> Optional[dict]:
    lp = series.lock_path()
    if not lp.is_file():
        return None
    return json.loads(lp.read_text())
