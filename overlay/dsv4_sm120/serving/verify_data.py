"""``make verify``'s inputs and small helpers: the prompt set, the GSM8K test set (downloaded once into the cache),
what a refused start's output says, option lists (``verify.py`` runs the stages)."""

from __future__ import annotations

import hashlib
import json
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import List, Optional, Tuple

from ..fileio import atomic_write_text
from ..paths import PACKAGE_DIR, cache_dir

PROMPTS = PACKAGE_DIR / "serving" / "verify_prompts.json"
GSM8K_URL = "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/test.jsonl"


class UsageError(Exception):
    pass


def decode_urls(plan) -> str:
    """The decode servers' URLs of a plan, comma-separated (one per replica), for ``make measure``'s acceptance
    counters."""
    return ",".join(p.health_url.rsplit("/health", 1)[0] for p in plan.procs if p.role == "decode") \
        or plan.urls["decode"]


def preflight_refusal(log: Path) -> Optional[dict]:
    """What a start's output says when its preflight refused it: {"why": the first failure (+ how many more),
    "checks": the failed checks' names ("python" when it failed before the named checks)}; None when the
    preflight did not refuse it."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return None
    if not re.search(r"^\[serve\] refused to start: \d+ preflight failure", text, re.M):
        return None
    lines = re.findall(r"^\[serve\] preflight: (.+)$", text, re.M)
    checks = list(dict.fromkeys(re.findall(r"preflight (\w+): FAILED", text))) or ["python"]
    why = (f"preflight: {lines[0]}" + (f" (and {len(lines) - 1} more)" if len(lines) > 1 else "")
           if lines else "the preflight refused it")
    return {"why": why, "checks": checks}


def client_failure(what: str, rc: Optional[int], log: Path) -> str:
    """The error of a client stage that did not succeed (``rc`` None: it ran out of time)."""
    return f"{what} {'timed out' if rc is None else f'exited {rc}'}; see {log}"


def read_json(p: Path) -> Optional[dict]:
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def load_prompts(path: Optional[str]) -> List[dict]:
    p = Path(path) if path else PROMPTS
    try:
        data = json.loads(p.read_text())
        prompts = data["prompts"] if isinstance(data, dict) else data
        if not prompts or not all(isinstance(x.get("id"), str) and isinstance(x.get("text"), str) for x in prompts):
            raise ValueError("expected a list of {\"id\": ..., \"text\": ...}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UsageError(f"prompt file {p}: {e}")
    return prompts


def gsm8k_cache_path(url: str) -> Path:
    return cache_dir() / "gsm8k" / f"{hashlib.sha256(url.encode()).hexdigest()[:12]}-test.jsonl"


def fetch_gsm8k(data: Optional[str], url: str) -> Tuple[Optional[Path], str]:
    """(the GSM8K test file, "") or (None, "GSM8K not reachable (<reason>)"): a given file, else the cached
    download of ``url``, else one download (atomic)."""
    def valid(p: Path) -> Optional[str]:
        try:
            first = json.loads(p.read_text().splitlines()[0])
            return None if "question" in first and "answer" in first else "no question/answer fields"
        except (OSError, ValueError, IndexError) as e:
            return f"{type(e).__name__}: {e}"

    if data:
        problem = valid(Path(data))
        return (Path(data), "") if problem is None else (None, f"GSM8K not readable from {data} ({problem})")
    dest = gsm8k_cache_path(url)
    if dest.is_file() and valid(dest) is None:
        return dest, ""
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            raw = r.read()
        atomic_write_text(dest, raw.decode())
    except urllib.error.HTTPError as e:
        return None, f"GSM8K not reachable (HTTP {e.code} from {url})"
    except (urllib.error.URLError, OSError, ValueError) as e:
        return None, f"GSM8K not reachable ({type(e).__name__}: {getattr(e, 'reason', e)}; {url})"
    problem = valid(dest)
    return (dest, "") if problem is None else (None, f"GSM8K not reachable ({url} gave no GSM8K data: {problem})")


def parse_list(text: str, known, what: str) -> List[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in known]
    if bad or not items:
        raise UsageError(f"--{what} {text!r}: expected a comma list of {', '.join(known)}")
    return list(dict.fromkeys(items))
