"""The launch plan of one sparse MLA decode call: the one place that merges the launch tables, a machine profile's
launch, the settings and a call's ``launch=`` keys, settles the QK mode, and cuts the rows into chunks whose
workspace fits.

``plan_call(H, T, device, K1, K2, qk=..., launch=..., profile_qk=..., profile_launch=...)`` returns a
:class:`CallPlan`:

* ``qk`` / ``qk_from``: the QK mode (``"bf16"`` / ``"fp8"``) and where it came from (:func:`settle_qk`: the call's
  ``qk_mode=`` argument > the setting ``DSV4_SM120_ATTN_QK`` > the profile's ``+fp8qk`` > the default, bf16);
* ``keys`` / ``keys_from``: the launch keys laid over the tables and, per key, ``"setting"``
  (``DSV4_SM120_ATTN_CONFIG``), ``"profile"`` (a profile winner ``dsv4:<keys>``, only where the setting is unset)
  or ``"launch="`` (the call's own keys, over both) (:func:`launch_keys`);
* ``entry``: the launch-table entry the call's rows read (``"arch_sm_120.json[1]"``; ``"interpreter"`` under
  Triton's interpreter), before the "auto" rules; calls with the same entry run the same table launch;
* ``chunks``: ``(t0, t1, launch)`` per kernel launch (:class:`Chunk`): all rows in one launch unless its workspace
  passes ``DSV4_SM120_ATTN_WS_MB``, each with its resolved :class:`~.config.Launch` (``launch.source``: the entry
  it came from); ``chunk.sources()`` says where each resolved key came from.

``entry`` and ``chunks`` are worked out when first read (the kernel reads the chunks only, the SGLang glue the
entry only). Torch-free: the glue's routing, the self-check and the tests ask it on a CPU with injected device
facts (:class:`~.config.Device`). The kernel (``launch.sparse_mla_decode``), the glue
(``sglang_glue.attention.launch_bucket``) and the self-check (``sglang_glue.selfcheck.call_launches``) all read
their launches here; benchmarks and calibration pass launch variants as ``launch=``.
"""

from __future__ import annotations

import os
from functools import cached_property, lru_cache
from typing import Dict, List, Mapping, NamedTuple, Optional, Tuple, Union

from .. import settings
from . import config as C
from .keys import DecodeInputError, parse_config
from .plan import cdiv, ws_words

QK_SETTING = "DSV4_SM120_ATTN_QK"
CONFIG_SETTING = "DSV4_SM120_ATTN_CONFIG"
WS_SETTING = "DSV4_SM120_ATTN_WS_MB"
QK_MODES = C.QK_MODES

LaunchText = Union[None, str, Mapping[str, object]]


def interpreting() -> bool:
    """Whether Triton's CPU interpreter runs the kernels (``TRITON_INTERPRET``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ---- the QK mode


def settle_qk(call: Optional[str] = None, profile: Optional[str] = None,
              env: Optional[Mapping[str, str]] = None) -> Tuple[str, str]:
    """``(mode, from)``: the QK mode (``"bf16"`` / ``"fp8"``) and where it came from. The rule: the call's
    ``qk_mode=`` argument (``"qk_mode="``), else the setting ``DSV4_SM120_ATTN_QK`` when set (``"setting"``), else
    the machine profile's (``"profile"``: a winner ``dsv4+fp8qk``), else ``"default"``. ``auto`` (the default) is bf16
    on every architecture: decode reads ~584 B per candidate for ~2 x 512 x H FLOP of QK, far below any tensor-core
    ridge, and quantizing Q costs 2-3% accuracy (`make bench-attention` times both). Raises DecodeInputError for a
    mode that is not ``auto`` / ``bf16`` / ``fp8``."""
    if call:
        text, source = call, "qk_mode="
    elif (settings.raw(QK_SETTING, env) or "").strip():
        try:
            text, source = settings.get(QK_SETTING, env), "setting"
        except settings.SettingsError as e:
            raise DecodeInputError(str(e)) from None
    elif profile:
        text, source = profile, "profile"
    else:
        text, source = "auto", "default"
    if text not in QK_MODES:
        raise DecodeInputError(f"qk_mode must be one of {', '.join(QK_MODES)}, got {text!r}")
    return ("fp8" if text == "fp8" else "bf16"), source


def qk_mode(requested: Optional[str] = None, env: Optional[Mapping[str, str]] = None) -> str:
    """The QK mode of a call with ``qk_mode=requested`` and no profile (:func:`settle_qk`)."""
    return settle_qk(requested, None, env)[0]


# ---- the launch keys


@lru_cache(maxsize=128)
def _parsed(text: str, what: str) -> Tuple[Tuple[str, object], ...]:
    return tuple(parse_config(text, what).items())


def _keys(given: LaunchText, what: str) -> Dict[str, object]:
    if not given:
        return {}
    if isinstance(given, str):
        return dict(_parsed(given, what))
    return dict(_parsed(",".join(f"{k}={v}" for k, v in given.items()), what))


def setting_keys(env: Optional[Mapping[str, str]] = None) -> Dict[str, object]:
    """The launch keys of ``DSV4_SM120_ATTN_CONFIG`` (validated; empty when unset)."""
    return _keys(settings.raw(CONFIG_SETTING, env) or "", CONFIG_SETTING)


def launch_keys(call: LaunchText = None, profile: Optional[str] = None,
                env: Optional[Mapping[str, str]] = None) -> Tuple[Dict[str, object], Dict[str, str]]:
    """``(keys, from)``: the launch keys laid over the tables and, per key, where it came from. The setting
    ``DSV4_SM120_ATTN_CONFIG`` (``"setting"``) or, where it is unset, the profile's launch (``"profile"``: a winner
    ``dsv4:<keys>``; the setting replaces it whole), then the call's ``launch=`` keys (``"launch="``: text as in the
    setting, or a mapping) over both."""
    base = setting_keys(env)
    origin = "setting"
    if not base and profile:
        base, origin = _keys(profile, "profile launch"), "profile"
    keys, sources = dict(base), {k: origin for k in base}
    for k, v in _keys(call, "launch").items():
        keys[k], sources[k] = v, "launch="
    return keys, sources


def profile_in_force(launch: Optional[str], qk: Optional[str],
                     env: Optional[Mapping[str, str]] = None) -> Tuple[Optional[str], Optional[str]]:
    """``(launch, qk)`` of a profile winner as far as the settings leave them in force (None where a setting
    replaces them): what the SGLang glue routes a call with."""
    if launch and (settings.raw(CONFIG_SETTING, env) or "").strip():
        launch = None
    if qk and (settings.raw(QK_SETTING, env) or "").strip():
        qk = None
    return launch, qk


# ---- workspace and row chunks


def workspace_cap_words(env: Optional[Mapping[str, str]] = None) -> int:
    """``DSV4_SM120_ATTN_WS_MB`` in 4-byte words: the most workspace one launch may use."""
    try:
        return int(settings.get(WS_SETTING, env) * (1 << 20) / 4)
    except settings.SettingsError as e:
        raise DecodeInputError(str(e)) from None


def workspace_words(launch: C.Launch, rows: int, H: int) -> int:
    """4-byte words of the workspace ``launch`` uses for ``rows`` rows of ``H`` heads: per (row, split, padded
    head) the partial (``plan.ws_words``)."""
    s1, _, s2, _ = launch.plan
    HP = cdiv(H, launch.config["BLOCK_H"]) * launch.config["BLOCK_H"]
    return rows * (s1 + s2) * HP * ws_words(launch.config["impl"], launch.config.get("PART_BF16", 0))


def row_chunks(H: int, T: int, K1: int, K2: int, device: C.Device, qk: str, overrides, interpret: bool,
               cap_words: int, root=None) -> List[Tuple[int, int, C.Launch]]:
    """``(t0, t1, launch)`` per launch: all ``T`` rows in one launch unless its workspace would pass ``cap_words``
    4-byte words; then row chunks of the largest size (halving) that fits, the last one with its own launch."""
    def launch(rows: int) -> C.Launch:
        return C.resolve(H, rows, K1, K2, device, qk=qk, overrides=overrides, interpret=interpret, call_rows=T,
                         root=root)

    TC, L = T, launch(T)
    while TC > 1 and workspace_words(L, TC, H) > cap_words:
        TC = (TC + 1) // 2
        L = launch(TC)
    out = []
    for t0 in range(0, T, TC):
        t1 = min(T, t0 + TC)
        out.append((t0, t1, L if t1 - t0 == TC else launch(t1 - t0)))
    return out


# ---- the plan of a call


class Chunk(NamedTuple):
    t0: int
    t1: int
    launch: C.Launch
    keys_from: Mapping[str, str]

    def sources(self) -> Dict[str, str]:
        """Where each resolved key came from: ``setting`` / ``profile`` / ``launch=`` for the keys given, ``combine
        plan`` for the combine keys, else the entry (``launch.source``: ``table <file>[<size>]``, or
        ``interpreter``), with its "auto" values resolved for the shape."""
        entry = self.launch.source if self.launch.source.startswith("interpreter") else f"table {self.launch.source}"
        return {k: self.keys_from.get(k) or ("combine plan" if k in C.COMBINE_KEYS else entry)
                for k in self.launch.config}


class CallPlan:
    """The launch plan of one call (module doc); build it with :func:`plan_call`."""

    def __init__(self, H: int, T: int, device: C.Device, K1: Optional[int], K2: int, qk: Tuple[str, str],
                 keys: Tuple[Dict[str, object], Dict[str, str]], interpret: bool, cap_words: Optional[int],
                 env, root):
        self.H, self.T, self.device, self.K1, self.K2 = int(H), int(T), device, K1, int(K2)
        (self.qk, self.qk_from), (self.keys, self.keys_from) = qk, keys
        self.interpret, self._cap, self._env, self._root = interpret, cap_words, env, root

    @cached_property
    def entry(self) -> str:
        if self.interpret:
            return "interpreter"
        return C.table_entry(self.H, self.T, self.qk, self.device, self.keys.get("impl"), self._root)[1]

    @cached_property
    def chunks(self) -> Tuple[Chunk, ...]:
        if self.K1 is None:
            raise DecodeInputError("plan_call: the row chunks need the candidate counts (K1, K2)")
        cap = workspace_cap_words(self._env) if self._cap is None else self._cap
        return tuple(Chunk(t0, t1, L, self.keys_from) for t0, t1, L in row_chunks(
            self.H, self.T, int(self.K1), self.K2, self.device, self.qk, self.keys, self.interpret, cap, self._root))

    def __repr__(self) -> str:
        return (f"CallPlan(H={self.H}, T={self.T}, qk={self.qk} ({self.qk_from}), keys={self.keys}, "
                f"keys_from={self.keys_from})")


def plan_call(H: int, T: int, device: C.Device, K1: Optional[int] = None, K2: int = 0, *, qk: Optional[str] = None,
              launch: LaunchText = None, profile_qk: Optional[str] = None, profile_launch: Optional[str] = None,
              interpret: Optional[bool] = None, cap_words: Optional[int] = None,
              env: Optional[Mapping[str, str]] = None, root=None) -> CallPlan:
    """The plan of a call of ``T`` rows of ``H`` heads over ``K1`` main and ``K2`` extra candidates per row on
    ``device`` (module doc). ``qk`` / ``launch``: the call's own ``qk_mode=`` / ``launch=``; ``profile_qk`` /
    ``profile_launch``: a machine profile's, under the settings; ``interpret``: default ``TRITON_INTERPRET``;
    ``cap_words``: default ``DSV4_SM120_ATTN_WS_MB``; ``env``: the settings' environment (default the process's);
    ``root``: the launch tables' folder (tests). Raises DecodeInputError for a bad QK mode or launch key at once,
    and for a launch that cannot be resolved when ``entry`` / ``chunks`` are read."""
    return CallPlan(H, T, device, K1, K2, settle_qk(qk, profile_qk, env), launch_keys(launch, profile_launch, env),
                    interpreting() if interpret is None else bool(interpret), cap_words, env, root)
