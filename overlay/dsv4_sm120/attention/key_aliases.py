"""The descriptive names of the sparse-MLA decode's launch flags, and the short spellings still accepted.

Launch texts (``DSV4_SM120_ATTN_CONFIG``, a machine profile's ``dsv4:<keys>`` winner, ``bench --variants``, a
launch sweep's ``variant`` column) and launch-table entries may spell a flag either way; parsing maps the old
spelling to the new one (:func:`canonical`), so a resolved launch, a generated table and a profile written from
now on carry the new names. The kernels keep the short constexpr names (:data:`CONSTEXPR`: renaming them would
change the compiled kernels' source hash and the compile-coverage cache); :mod:`.launch` passes each flag under
its constexpr name.

The flags:

* ``e4m3_int_decode`` (old ``KCVT``; register and tiled bodies): the e4m3 cache bytes become bf16 on the integer
  pipes (inline PTX, exact for every finite code) and the UE8M0 scales fp32 exponent bits, instead of the
  conversion pipe's cast;
* ``late_decode`` (old ``DEC_LATE``; register body): the next candidate block is decoded at the end of an
  iteration and the loop carries the decoded bf16 tiles, not the raw bytes;
* ``spanning_splits`` (old ``SPAN``; register body): the splits cut the concatenated candidates main ++ extra into
  equal whole-block chunks (``plan.plan_span``: the split count with the shortest rounds x program length), so one
  program may run from the end of the main cache into the extra one (instead of splitting each cache on its own).

The bodies (``impl``; docs/attention.md): ``reg`` decodes each K byte once per candidate block into a bf16 tile
that serves as K for QK and as V for PV (bf16 QK only); ``tiled`` keeps the 448 nope dims as seven 64-wide e4m3
tiles until they become MMA operands (both QK paths, pipelined with ``num_stages=2`` on Hopper); ``flat``
dequantizes a ``[BLOCK_N, 512]`` bf16 tile and runs 512-wide dots (both QK paths; large head blocks on Hopper).
Imports nothing.
"""

from __future__ import annotations

from typing import Dict, Mapping

# old spelling -> descriptive name (the one alias table)
ALIASES: Dict[str, str] = {"KCVT": "e4m3_int_decode", "DEC_LATE": "late_decode", "SPAN": "spanning_splits"}
# descriptive name -> the kernels' constexpr name
CONSTEXPR: Dict[str, str] = dict({new: old for old, new in ALIASES.items()}, balanced="BALANCED")


def canonical(key: str) -> str:
    """The descriptive name of a launch key (unchanged when it has no old spelling)."""
    return ALIASES.get(key, key)


def canonical_entry(entry: Mapping[str, object]) -> Dict[str, object]:
    """A launch (key -> value) with every key under its descriptive name, in the same order."""
    return {canonical(k): v for k, v in entry.items()}
