"""Accepted tokens per speculative step, from the decode server's own counters.

SGLang 0.5.23 (``--enable-metrics``, which serve/serve_dsv4_mtp.sh passes) exports on ``/metrics``:

* ``sglang:spec_verify_calls_total``: verify passes, summed over finished requests
  (``observability/metrics_collector.py``, fed by the per-request ``spec_verify_ct``);
* ``sglang:generation_tokens_total``: their output tokens.

Their increase over one benchmark run gives the mean accepted tokens per verify step, exactly as
SGLang's per-request ``meta_info["spec_accept_length"]`` = completion_tokens / spec_verify_ct
(``managers/tokenizer_manager.py``), bonus token included. The accept rate is SGLang's
``spec_accept_rate`` definition, accepted drafts / proposed drafts =
(accept_length - 1) / (num_draft_tokens - 1), with ``speculative_num_draft_tokens`` from the decode
server's ``/server_info``. The scheduler's gauges (``sglang:spec_accept_length``) and
``/server_info``'s ``avg_spec_accept_length`` are windowed averages, not per run, so they are
only a fallback.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from typing import Dict, List, Optional

VERIFY = "sglang:spec_verify_calls_total"
GENERATED = "sglang:generation_tokens_total"
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)(\s+\d+)?\s*$")


def parse_prometheus(text: str) -> Dict[str, float]:
    """Metric name -> sum of its samples over all label sets (comments skipped)."""
    out: Dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            v = float(m.group(3))
        except ValueError:
            continue
        out[m.group(1)] = out.get(m.group(1), 0.0) + v
    return out


def _get(url: str, timeout: float) -> Optional[str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read().decode("utf-8", "replace") if r.status == 200 else None
    except (urllib.error.URLError, OSError, ValueError):
        return None


def urls(decode_url: str) -> List[str]:
    """The decode servers of ``decode_url``: one URL, or a comma list (decode replicas behind the router)."""
    return [u.strip().rstrip("/") for u in (decode_url or "").split(",") if u.strip()]


def snapshot(decode_url: str, timeout: float = 10.0) -> Optional[Dict[str, float]]:
    """The two counters now, summed over the decode servers of ``decode_url`` (one URL or a comma list: replicas
    each count their own requests), or None (a server without /metrics or without speculation counters)."""
    out = {"verify": 0.0, "generated": 0.0}
    for u in urls(decode_url) or [""]:
        text = _get(u + "/metrics", timeout) if u else None
        if text is None:
            return None
        m = parse_prometheus(text)
        if GENERATED not in m:
            return None
        out["verify"] += m.get(VERIFY, 0.0)
        out["generated"] += m[GENERATED]
    return out


def server_spec(decode_url: str, timeout: float = 10.0) -> Dict[str, object]:
    """speculative_algorithm / speculative_num_draft_tokens / avg_spec_accept_length of the (first) decode
    server (from /server_info; empty when it does not answer); replicas run the same flags."""
    first = (urls(decode_url) or [""])[0]
    text = _get(first + "/server_info", timeout) if first else None
    try:
        info = json.loads(text) if text else None
    except ValueError:
        info = None
    if not isinstance(info, dict):
        return {}
    states = info.get("internal_states") or [{}]
    avg = states[0].get("avg_spec_accept_length") if isinstance(states[0], dict) else None
    return {"algorithm": info.get("speculative_algorithm"),
            "num_draft_tokens": info.get("speculative_num_draft_tokens"),
            "avg_spec_accept_length": avg}


def summarize(before: Optional[Dict[str, float]], after: Optional[Dict[str, float]],
              num_draft_tokens: Optional[int]) -> Optional[dict]:
    """Accept length and rate over the interval, or None when no verify step ran in it."""
    if not before or not after:
        return None
    steps = after["verify"] - before["verify"]
    tokens = after["generated"] - before["generated"]
    if steps <= 0 or tokens <= 0:
        return None
    length = tokens / steps
    rate = None
    if num_draft_tokens and int(num_draft_tokens) > 1:
        rate = (length - 1.0) / (int(num_draft_tokens) - 1)
    return {"accept_length": length, "accept_rate": rate, "verify_steps": int(round(steps)),
            "decode_tokens": int(round(tokens)), "num_draft_tokens": num_draft_tokens,
            "source": "decode /metrics counter deltas"}
