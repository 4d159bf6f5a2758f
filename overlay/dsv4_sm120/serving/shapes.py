"""``make verify ARGS='--stages shape'``: the serving shape and draft length, chosen by measurement on this box.

A list of candidate deployments is started one after another, each exactly as ``serve/serve_dsv4_tp4.sh --detach``
(``serve_dsv4_mtp.sh`` for the MTP variant) starts it, with its layout in ``PREFILL_GPUS`` / ``DECODE_GPUS`` and its
draft length in ``SPEC_DSPARK_BLOCK_SIZE`` / ``SPEC_NUM_STEPS``: by default, for the ``ours`` variant, your prefill
GPUs with the decode GPUs as one server (PD 4+4 TP4), then as two replicas of half the size (a TP4 prefill and two TP2
decode servers); for the ``mtp`` variant each of these with DSpark block sizes 3 / 5 / 7 or EAGLE steps 1 / 2 / 3
(the checkpoint's own first). Each candidate gets the greedy stage (its tokens compared with the first candidate's on
the first ``--first-tokens``) and the measure stage (SGLang's load generator at ``--concurrency``: output tok/s,
TPOT and TTFT p50 / p99, accepted tokens per verify step), then is stopped. The winner per concurrency
(``machine_profile.shape_decision.winners``) is written with the table and a plot (``<run>/shape/``) and recorded in the
machine profile of the decode GPUs' model (decision ``shape``), where the serve scripts take it when you set no
layout and no draft length (``profile_choices.recorded_shape``). A stand-in rehearsal never replaces a measured record.
"""

from __future__ import annotations

import json
import math
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

from ..machine_profile.shape_decision import candidate_name, shape_text, spec_text, winners
from ..fileio import atomic_write_text
from . import shape_report
from .plan import ConfigError, Plan, build_plan, parse_groups, settings_from_env
from .verify_data import UsageError

STAGES = ["greedy", "measure"]
DRAFT_LENGTHS = {"DSPARK": (3, 5, 7), "EAGLE": (1, 2, 3)}
SERVE_VARIANTS = {"ours": "base", "mtp": "mtp"}
DRAFT_VARS = ("SPEC_NUM_STEPS", "SPEC_NUM_DRAFT_TOKENS", "SPEC_DSPARK_BLOCK_SIZE")


@dataclass
class Candidate:
    name: str
    variant: str                  # serve variant: base | mtp
    prefill: str                  # PREFILL_GPUS
    decode: str                   # DECODE_GPUS
    spec: Optional[dict]
    max_running: int

    @property
    def key(self) -> str:
        """Its deployment's name in verify (and its directory under the run directory)."""
        return f"shape/{self.name}"

    def switches(self) -> Dict[str, str]:
        sw = {"PREFILL_GPUS": self.prefill, "DECODE_GPUS": self.decode, "MAX_RUNNING": str(self.max_running)}
        if self.spec:
            sw.update(dict.fromkeys(DRAFT_VARS, ""))
            key = "SPEC_DSPARK_BLOCK_SIZE" if self.spec["algorithm"] == "DSPARK" else "SPEC_NUM_STEPS"
            sw[key] = str(self.spec["block_size" if self.spec["algorithm"] == "DSPARK" else "steps"])
        return sw

    def describe(self) -> str:
        return f"{shape_text(self.prefill, self.decode)}, {spec_text(self.spec)}, MAX_RUNNING {self.max_running}"


def default_layouts(s: Mapping[str, str]) -> List[Tuple[str, str]]:
    """Your prefill GPUs with every decode GPU as one server, then as two replicas of half the size."""
    pre = s["PREFILL_GPUS"]
    dec = [g for grp in parse_groups("DECODE_GPUS", s["DECODE_GPUS"]) for g in grp]
    out = [(pre, ",".join(map(str, dec)))]
    if len(dec) >= 2 and len(dec) % 2 == 0:
        h = len(dec) // 2
        out.append((pre, ",".join(map(str, dec[:h])) + ";" + ",".join(map(str, dec[h:]))))
    return out


def parse_layouts(items: List[str]) -> List[Tuple[str, str]]:
    out = []
    for text in items:
        pre, sep, dec = text.partition("/")
        if not sep:
            raise UsageError(f"--shape {text!r}: expected PREFILL_GPUS/DECODE_GPUS, e.g. '0,1,2,3/4,5;6,7'")
        try:
            parse_groups("PREFILL_GPUS", pre.strip())
            parse_groups("DECODE_GPUS", dec.strip())
        except ConfigError as e:
            raise UsageError(f"--shape {text!r}: {e}") from None
        out.append((pre.strip(), dec.strip()))
    return list(dict.fromkeys(out))


def draft_specs(a, s: Mapping[str, str], env: Mapping[str, str]) -> List[dict]:
    """The MTP variant's draft lengths (the checkpoint's default first, so a tie keeps it)."""
    from .profile_choices import draft_algorithm
    from .speculative import EAGLE_DEFAULT_STEPS, SpecError, detect_draft

    algo = draft_algorithm(s, env)
    if algo not in DRAFT_LENGTHS:
        raise UsageError("--stages shape, mtp variant: the draft of MODEL_PATH is not known here (set SPEC_ALGORITHM)")
    try:
        lengths = [int(x) for x in (a.draft_lengths or "").split(",") if x.strip()] or list(DRAFT_LENGTHS[algo])
    except ValueError:
        raise UsageError(f"--draft-lengths {a.draft_lengths!r}: expected a comma list of integers") from None
    if any(not 1 <= n <= 16 for n in lengths):
        raise UsageError(f"--draft-lengths {a.draft_lengths!r}: each 1..16")
    try:
        own = detect_draft(s["MODEL_PATH"], env).dspark_block_size if algo == "DSPARK" else EAGLE_DEFAULT_STEPS
    except SpecError:
        own = None
    lengths = sorted(dict.fromkeys(lengths), key=lambda n: (n != own, n))
    key = "block_size" if algo == "DSPARK" else "steps"
    return [{"algorithm": algo, key: n} for n in lengths]


class Study:
    """The candidates, their plans, and the run: start / measure / stop each, compare, record."""

    def __init__(self, a, env: Dict[str, str], variants: List[str], run_dir: Path):
        from ..perf.measure import MeasureError, parse_concurrency

        self.a, self.env, self.run_dir = a, env, run_dir
        serve = [SERVE_VARIANTS[v] for v in variants if v in SERVE_VARIANTS]
        if not serve:
            raise UsageError("--stages shape measures the ours and mtp variants: name one of them in --variants")
        self.ignored = [v for v in variants if v not in SERVE_VARIANTS]
        s = settings_from_env(env)
        try:
            top = max(parse_concurrency(a.concurrency))
        except MeasureError as e:
            raise UsageError(str(e)) from None
        layouts = parse_layouts(a.shape) if a.shape else default_layouts(s)
        specs = {"base": [None], "mtp": draft_specs(a, s, env) if "mtp" in serve else []}
        self.candidates: List[Candidate] = []
        for variant in serve:
            for pre, dec in layouts:
                replicas = len(parse_groups("DECODE_GPUS", dec))
                mr = int(s["MAX_RUNNING"]) if (env.get("MAX_RUNNING") or "").strip() else \
                    max(int(s["MAX_RUNNING"]), math.ceil(top / replicas))
                for spec in specs[variant]:
                    name = candidate_name(pre, dec, spec)
                    taken = {c.name for c in self.candidates}
                    name = next(f"{name}-{i}" for i in range(2, 99) if f"{name}-{i}" not in taken) \
                        if name in taken else name          # two layouts of one shape on other GPUs
                    self.candidates.append(Candidate(name, variant, pre, dec, spec, mr))
        self.plans: Dict[str, Plan] = {}
        for c in self.candidates:
            penv = dict(env, **c.switches(), RUN_DIR=str(run_dir / c.key / "serve"))
            penv.pop("DRY_RUN", None)
            try:
                self.plans[c.key] = build_plan(penv, c.variant)
            except ConfigError as e:
                raise UsageError(f"shape {c.name}: configuration error: {e}") from None
        self.results: Dict[str, dict] = {}
        self.study: Dict[str, object] = {}

    def register(self, ver) -> None:
        for c in self.candidates:
            ver.table[c.key] = (c.variant, c.switches(), c.describe())
            ver.plans[c.key] = self.plans[c.key]

    def dry_run_lines(self, ver) -> List[str]:
        self.register(ver)
        out = [f"# shape stage: {len(self.candidates)} candidate(s), one deployment each, measured at concurrency "
               f"{self.a.concurrency}; greedy tokens compared with {self.candidates[0].name} on the first "
               f"{self.a.first_tokens}" + (f"; not for {', '.join(self.ignored)}" if self.ignored else "")]
        for c in self.candidates:
            sw = " ".join(f"{k}={shlex.quote(x)}" for k, x in c.switches().items())
            out += [f"shape {c.name}: {c.describe()}",
                    f"  start: RUN_DIR={shlex.quote(str(ver.serve_dir(c.key)))} {sw} {shlex.join(ver.start_cmd(c.key))}",
                    f"  greedy: POST {self.plans[c.key].urls['router']}/generate x {len(ver.prompts())} prompts",
                    f"  measure: {shlex.join(ver.measure_cmd(c.key))}",
                    f"  stop: serve/stop.sh {shlex.quote(str(ver.serve_dir(c.key)))}"]
        out.append(f"shape record: {self.target()[1]}")
        return out

    def target(self) -> Tuple[Optional[str], str]:
        """(the GPU model the record goes to, where it goes or why not)."""
        from .. import machine_profile as P
        from .profile_choices import gpu_names

        plan = self.plans[self.candidates[0].key]
        first = next((p.gpus[0] for p in plan.procs if p.role == "decode"), None)
        gpu = gpu_names(plan.settings["NVIDIA_SMI"] or "nvidia-smi").get(first)
        if not gpu:
            return None, "not recorded: no GPU name from nvidia-smi, so no machine profile to write"
        path = P.profile_path(gpu)
        if path is None:
            return None, f"not recorded: {P.ENV_DIR} is empty (profiles off)"
        return gpu, f"the winner per concurrency goes into {path} (decision shape)"

    def run(self, ver) -> None:
        self.register(ver)
        ver.say(f"shape: {len(self.candidates)} candidate(s): {', '.join(c.name for c in self.candidates)}")
        for i, c in enumerate(self.candidates):
            ver.say(f"shape {c.name}: {c.describe()}")
            ver.run_variant(c.key, STAGES)
            checks = ver.box_wide_refusal(c.key)
            self.results[c.key] = ver.results.pop(c.key)
            rest = self.candidates[i + 1:]
            if checks and rest:
                ver.say(f"not starting {', '.join(x.name for x in rest)}: the preflight refused {c.name} on this box's "
                        f"own check(s) ({checks}), which no shape changes")
                ver.skipped_variants += [x.key for x in rest]
                break
        self.finish(ver)

    def rows(self) -> Dict[str, dict]:
        """Per serve variant: the candidates' records and the winners (``shape_decision`` fields)."""
        ref = next((c for c in self.candidates if self._greedy(c) is not None), None)
        out: Dict[str, dict] = {}
        for c in self.candidates:
            rec = out.setdefault(c.variant, {
                "measured_at": _now(), "standin": self.plans[c.key].standin,
                "model": self.plans[c.key].settings["MODEL_PATH"], "input_len": self.a.input_len,
                "output_len": self.a.output_len, "concurrency": [int(x) for x in self.a.concurrency.split(",") if x],
                "reference": ref.name if ref else None, "first_tokens": self.a.first_tokens, "candidates": []})
            rec["candidates"].append(self.record_of(c, ref))
        for rec in out.values():
            rec["winners"] = winners(rec["candidates"])
        return out

    def _greedy(self, c: Candidate) -> Optional[list]:
        g = ((self.results.get(c.key) or {}).get("stages") or {}).get("greedy") or {}
        return g.get("results") if g.get("status") == "ok" else None

    def record_of(self, c: Candidate, ref: Optional[Candidate]) -> dict:
        from .verify_report import compare_greedy

        res = self.results.get(c.key) or {}
        meas = (res.get("stages") or {}).get("measure") or {}
        row = {"name": c.name, "prefill_gpus": c.prefill, "decode_gpus": c.decode, "spec": c.spec,
               "max_running": c.max_running, "status": "ok", "agrees": None, "per_concurrency": {}}
        for run in meas.get("runs") or []:
            m = run.get("metrics") or {}
            if run.get("error") or not m:
                continue
            row["per_concurrency"][str(int(run["concurrency"]))] = {
                "output_tok_s": m.get("output_throughput"), "tpot_p50_ms": m.get("median_tpot_ms"),
                "tpot_p99_ms": m.get("p99_tpot_ms"), "ttft_p50_ms": m.get("median_ttft_ms"),
                "ttft_p99_ms": m.get("p99_ttft_ms"),
                "accept_length": (run.get("speculative") or {}).get("accept_length", m.get("accept_length"))}
        mine, theirs = self._greedy(c), self._greedy(ref) if ref else None
        if mine is not None and theirs is not None:
            row["agrees"] = bool(compare_greedy(theirs, mine, self.a.first_tokens)["first_tokens_identical"])
        start = res.get("start") or {}
        if not start.get("ok"):
            row.update(status="failed", error=start.get("error") or "not started")
        elif meas.get("status") != "ok":
            row.update(status="failed", error=meas.get("error") or f"measure {meas.get('status', 'not run')}")
        return row

    def finish(self, ver) -> None:
        """Compare, write the table and the plot, record the winners."""
        variants = self.rows()
        gpu, where = self.target()
        recorded = record(variants, gpu) if gpu else {v: where for v in variants}
        self.study = {"standin": any(r["standin"] for r in variants.values()), "variants": variants,
                      "recorded": recorded, "dir": str(self.run_dir / "shape")}
        d = self.run_dir / "shape"
        d.mkdir(parents=True, exist_ok=True)
        atomic_write_text(d / "shape.json", json.dumps(self.study, indent=1) + "\n")
        atomic_write_text(d / "table.md", "\n".join(shape_report.markdown(self.study)) + "\n")
        why = shape_report.plot(self.study, d / "shape.png")
        self.study["plot"] = str(d / "shape.png") if why is None else f"none ({why})"
        for v, rec in variants.items():
            wins = ", ".join(f"C={c} {n}" for c, n in sorted(rec["winners"].items(), key=lambda kv: int(kv[0])))
            ver.say(f"shape {v}: winners {wins or 'none'}; {recorded[v]}")
        ver.say(f"shape: table {d / 'table.md'}, plot {self.study['plot']}")

    def report(self) -> dict:
        return dict(self.study)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def record(variants: Dict[str, dict], gpu: str) -> Dict[str, str]:
    """Write each variant's record into the machine profile of ``gpu`` (merged with what is there; a new profile
    with this environment's versions when there is none); {variant: what happened, one line}."""
    from .. import machine_profile as P

    path = P.profile_path(gpu)
    try:
        prof = P.load(path) if path.is_file() else {"schema": P.SCHEMA, "gpu": gpu, "created_at": P.now_iso(),
                                                      "versions": P.running_versions(), "deployment": {},
                                                      "decisions": {}}
    except P.ProfileError as e:
        return {v: f"not recorded: {e}" for v in variants}
    entry = dict(prof["decisions"].get("shape") or {"variants": {}})
    entry["variants"] = dict(entry.get("variants") or {})
    out: Dict[str, str] = {}
    for v, rec in variants.items():
        old = entry["variants"].get(v)
        if rec["standin"] and old and not old.get("standin"):
            out[v] = f"not recorded: {path} holds a measured {v} shape, which a stand-in rehearsal does not replace"
        elif not rec["winners"]:
            out[v] = "not recorded: no candidate agreed with the first one and measured"
        else:
            entry["variants"][v] = rec
            out[v] = f"{path} (decision shape, variant {v})"
    if any(v in entry["variants"] and entry["variants"][v] is variants[v] for v in variants):
        prof["decisions"]["shape"] = entry
        try:
            P.save(prof, path)
        except (P.ProfileError, OSError) as e:
            return {v: f"not recorded: {e}" for v in variants}
        ok, reasons = P.match(prof, gpu, P.running_versions())
        if not ok:
            for v in out:
                out[v] += (f"; the profile was made with other versions ({'; '.join(reasons)}): the serve scripts use "
                           f"it once `make calibrate` remakes it here")
    return out
