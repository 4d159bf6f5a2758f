"""Launch configuration of the sparse MLA decode (dsv4_sm120.attention.config), on the CPU with injected device
facts: the hand-written launch tables against the launches the rules in code chose before they became tables
(tests/data/attention_launches_frozen.json), the tables' own shape, and the rules read as behaviour. The
H200's own tables are generated from its launch sweep (tests/test_launch_sweep.py checks them against the results
file); the H200's frozen launches are those of the architecture table, i.e. of a 132-SM Hopper GPU without a
table of its own."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from dsv4_sm120 import launch_tables as lt
from dsv4_sm120.attention import DecodeInputError, config, plan, plan_span
from dsv4_sm120.attention.key_aliases import canonical

FROZEN = Path(__file__).resolve().parent / "data" / "attention_launches_frozen.json"
H200 = config.Device("NVIDIA H200", (9, 0), 132)
HOPPER_132 = config.Device("NVIDIA H100 SXM5 132-SM", (9, 0), 132)  # no table of its own: arch_sm_90's rules
RTX_PRO_6000 = config.Device("NVIDIA RTX PRO 6000 Blackwell Server Edition", (12, 0), 188)


def _frozen():
    return json.loads(FROZEN.read_text())


def _as_text(launch: config.Launch) -> str:
    return ",".join(f"{k}={v}" for k, v in launch.config.items()) + "|" + ",".join(map(str, launch.plan))


def _parts(text: str):
    if text == "error":
        return text
    keys, plan = text.split("|")
    # the frozen texts spell the flags the old way (KCVT, DEC_LATE, SPAN): compared under their descriptive names
    return {canonical(k): v for k, v in (kv.split("=") for kv in keys.split(","))}, plan


def _new_span_plan(got, want, T, H, K1, K2, dev) -> bool:
    """A spanning register launch whose body keys are the frozen ones and whose split plan is the current
    ``plan_span``'s, which never takes longer than the frozen plan by its rounds x program-length model (the rule
    changed; test_attention.py checks it on its own). The combine keys, which follow the split count, are not
    compared here."""
    if "error" in (got, want) or got[0].get("spanning_splits") != "1":
        return False
    body = {k: v for k, v in got[0].items() if k not in config.COMBINE_KEYS}
    if body != {k: v for k, v in want[0].items() if k not in config.COMBINE_KEYS}:
        return False
    bn, hg = int(body["BLOCK_N"]), -(-H // int(body["BLOCK_H"]))
    S, chunk = plan_span(T, hg, K1, K2, bn, dev.num_sms, float(body["waves"]))
    if got[1] != f"{S},{chunk},0,{bn}":
        return False
    S0, chunk0 = (int(x) for x in want[1].split(",")[:2])
    slots = max(1, int(float(body["waves"]) * dev.num_sms))
    return (-(-T * hg * S // slots) * (chunk // bn + 1)) <= (-(-T * hg * S0 // slots) * (chunk0 // bn + 1))


def test_tables_give_the_launches_the_rules_gave():
    """Over the frozen grid (the H200's rules on a 132-SM Hopper GPU without a table, H100 PCIe, A100, B200, RTX
    PRO 6000 server and workstation, RTX 5090, GB10 and
    the interpreter; H 1..128, rows around every rows-per-SM threshold of each device, two candidate layouts, both
    QK paths, every impl request and the calibration variants of the Makefile as overrides): the resolved launch
    (the keys the chosen body reads, the split plan and the combine launch) is the one of the code before the
    launch tables, but for the spanning register body's split plan, whose rule has changed since (``_new_span_plan``),
    and fp8 QK with the register body is still refused."""
    d = _frozen()
    devices = {k: config.Device(v["name"], tuple(v["capability"]), v["num_sms"]) for k, v in d["devices"].items()}
    devices["interp"] = config.Device("cpu", None, 4)
    devices["h200"] = HOPPER_132
    seen, wrong = 0, []
    for key, (Ts, results) in d["groups"].items():
        dev, H, K1, K2, fp8, impl, ov = key.split("|")
        overrides = config.parse_config(ov)
        if impl:
            overrides["impl"] = impl
        for T, r in zip(Ts, results):
            want = d["results"][r]
            try:
                got = _as_text(config.resolve(int(H), T, int(K1), int(K2), devices[dev], qk="fp8" if fp8 == "1" else "bf16",
                                              overrides=overrides, interpret=dev == "interp"))
            except DecodeInputError:
                got = "error"
            seen += 1
            if _parts(got) != _parts(want) and not _new_span_plan(_parts(got), _parts(want), T, int(H), int(K1),
                                                                  int(K2), devices[dev]):
                wrong.append((key, T, got, want))
    assert seen > 20000 and {k.split("|")[0] for k in d["groups"]} >= {"h200", "rtxpro6000_ws", "a100", "interp"}
    assert not wrong, f"{len(wrong)} of {seen} launches changed, e.g. {wrong[:3]}"


def test_the_comparison_sees_a_changed_table(tmp_path):
    """The frozen comparison is able to fail: one changed entry in a copy of the Hopper architecture table changes
    exactly the launches that entry covers (more than one grid row per SM: from 133 rows on a 132-SM GPU)."""
    root = tmp_path / "tables"
    (root / "attention").mkdir(parents=True)
    for p in (lt.TABLE_DIR / "attention").iterdir():
        (root / "attention" / p.name).write_text(p.read_text())
    path = lt.table_path("attention", "H=16,qk=fp8", "arch_sm_90", root)
    table = json.loads(path.read_text())
    table["2"] = dict(table["2"], waves=3.0)
    path.write_text(json.dumps(table))
    for T, moved in ((1, False), (132, False), (133, True), (264, True), (5000, True)):
        a = config.resolve(16, T, 128, 512, HOPPER_132, qk="fp8")
        b = config.resolve(16, T, 128, 512, HOPPER_132, qk="fp8", root=root)
        assert (a.config != b.config) == moved, (T, a, b)


def test_every_level_holds_every_shape_with_complete_entries():
    """A level (device, architecture, default) that has one shape has them all (a missing one would fall back to
    another level's rules for that shape only), every entry names a body and the keys it reads, and the size keys
    of the device tables are grid rows (buckets written as first and last row); a body that runs on some
    architectures only (impl=wgmma, wgmma_t: Hopper) appears in tables of those architectures only, with its fixed
    launch."""
    files = sorted(p.name for p in (lt.TABLE_DIR / "attention").glob("*.json"))
    shapes = {f"H={h},qk={q}" for h in (16, 32, 64) for q in ("bf16", "fp8")}
    levels = {}
    for name in files:
        shape, dev = name[: -len(".json")].split(",device_name=")
        levels.setdefault(dev, set()).add(shape)
    assert set(levels) >= {"NVIDIA_H200", "arch_sm_90", "arch_sm_120", "default"}
    for dev, got in levels.items():
        assert got - {"impl=reg"} == shapes, (dev, got)
    assert "impl=reg" in levels["default"]
    for name in files:
        for size, cfg in lt.read_table(lt.TABLE_DIR / "attention" / name).items():
            impl = cfg["impl"]
            assert impl in config.IMPLS and impl in ("tiled", "flat", "reg", "wspec", "wgmma", "wgmma_t"), (name, size)
            if impl in config.FIXED_LAUNCHES:
                config.check_fixed_keys(cfg, name)  # a table entry of a fixed-launch body keeps its launch
            if impl in config.IMPL_ARCHS:
                dev = name[: -len(".json")].split(",device_name=")[1]
                major = {"NVIDIA_H200": 9}.get(dev) or (int(dev[len("arch_sm_"):]) // 10 if dev.startswith("arch_sm_") else None)
                assert major is not None and config.runs_on(impl, major), (name, size, impl)
            need = (set(config.COMMON_KEYS) | set(config.BODY_KEYS[impl])) - set(config.OPTIONAL_ENTRY_KEYS)
            assert need <= set(cfg) and set(cfg) <= set(config.KEYS), (name, size, sorted(set(cfg) ^ need))
            assert not set(cfg) & set(config.COMBINE_KEYS), (name, size)  # combine keys come from the plan


def test_launch_rules_read_as_behaviour():
    """The rules the hand-written tables encode (the H200's, as the architecture table of a 132-SM Hopper GPU
    without its own table), checked through resolve: H <= 16 with bf16 QK runs the spanning register body
    up to 4 grid rows per SM (its split count fills 2 x SMs program slots in one round), past it the tiled body
    (Hopper: one wave, scale prefetch, two stages when a program owns >= 2 blocks, no register cap then); fp8 QK
    never runs the register body; H > 16 on Hopper takes the flat body with 64-row head blocks past 2 (fp8) or
    4 (bf16) grid rows per SM; sm_120 runs the register body at every size with bf16 QK up to 16 heads, and with fp8 QK never
    pipelines and keeps head blocks at <= 32 rows; bf16 QK above 16 heads the warp-specialized body with 32 / 64
    heads per program."""
    for T in (1, 4, 16, 64, 128, 528):
        L = config.resolve(16, T, 128, 512, HOPPER_132)
        assert (L.config["impl"], L.config["BLOCK_N"], L.config["num_warps"], L.config["spanning_splits"]) == ("reg", 32, 4, 1)
        assert L.plan[0] == plan_span(T, 1, 128, 512, 32, 132, 2.0)[0] and L.plan[2] == 0
    big = config.resolve(16, 529, 128, 8192, HOPPER_132).config
    assert (big["impl"], big["waves"], big["PREFETCH"], big["num_stages"], big["maxnreg"]) == ("tiled", 1.0, 2, 2, 0)
    one_block = config.resolve(16, 529, 64, 0, HOPPER_132).config
    assert (one_block["num_stages"], one_block["maxnreg"]) == (1, 128)
    assert [config.resolve(16, T, 128, 512, HOPPER_132, qk="fp8").config["waves"] for T in (99, 100, 125, 126)] == \
        [4.0, 2.0, 2.0, 1.0]
    assert config.resolve(64, 66, 128, 512, HOPPER_132, qk="fp8").config["impl"] == "tiled"  # 264 grid rows
    assert config.resolve(64, 67, 128, 512, HOPPER_132, qk="fp8").config["BLOCK_H"] == 64  # 268: flat
    assert config.resolve(128, 66, 128, 512, HOPPER_132).config["impl"] == "reg"  # 528 grid rows
    assert config.resolve(128, 67, 128, 512, HOPPER_132).config["impl"] == "flat"
    for dev in (RTX_PRO_6000, config.Device("NVIDIA GeForce RTX 5090", (12, 0), 170)):
        n = dev.num_sms
        # bf16 QK: the register body at every size up to 16 heads (16-row head groups), the warp-specialized body
        # with 32 / 64 heads per program above (every block gathered once per program)
        for H, T in ((16, 1), (16, 4 * n), (16, 4 * n + 1), (16, 40 * n), (8, 3)):
            got = config.resolve(H, T, 128, 8192, dev).config
            assert (got["impl"], got["BLOCK_H"], got["spanning_splits"]) == ("reg", 16, 1), (dev.name, H, T)
        # (64 heads: 32 per program up to 3 grid rows per SM, 64 from 4; four grid rows per row)
        for H, T, bh in ((32, 1, 32), (32, 2 * n + 1, 32), (24, 5, 32), (64, 1, 32), (64, 3 * n // 4, 32),
                         (64, 3 * n // 4 + 1, 64), (64, 20 * n, 64), (40, 7, 32), (128, 3, 32)):
            got = config.resolve(H, T, 128, 8192, dev).config
            assert (got["impl"], got["BLOCK_H"], got["num_warps"], got["maxnreg"]) == ("wspec", bh, 8, 168), (H, T)
        # too few blocks for the warp-specialized body's fixed cost: the register body (plan.few_blocks)
        for H, T, K, impl in ((32, 24, 128, "reg"), (32, 48, 128, "wspec"), (64, 8, 128, "reg"), (64, 24, 128, "wspec"),
                              (32, 8, 640, "wspec")):
            assert config.resolve(H, T, K, 0, dev).config["impl"] == impl, (H, T, K)
        # fp8 QK (no register body): one-stage tiled at every size, head blocks <= 32 rows
        past = config.resolve(16, 4 * n + 1, 128, 8192, dev, qk="fp8").config
        assert (past["impl"], past["num_stages"], past["BLOCK_H"]) == ("tiled", 1, 16)
        assert config.resolve(64, 1, 128, 512, dev, qk="fp8").config["BLOCK_H"] == 32
    # a body asked for by name gets its own launch at any shape; the register body has no fp8 QK path
    assert config.resolve(16, 1, 128, 512, H200, overrides={"impl": "tiled"}).config["BLOCK_N"] == 64
    # the H200's generated fp8 table holds only flat launches at H=64: a tiled request takes the Hopper table's
    # tiled launch (16-row head groups up to 2 grid rows per SM) instead of the flat entry's keys
    asked = config.resolve(64, 4, 128, 512, H200, overrides={"impl": "tiled"})
    assert (asked.config["impl"], asked.config["BLOCK_H"]) == ("tiled", 16) and "arch_sm_90" in asked.source
    assert config.resolve(64, 4, 128, 512, H200, qk="fp8").config["impl"] == "flat"  # the table's own choice
    assert config.resolve(128, 1024, 128, 512, H200, overrides={"impl": "reg"}).config["BLOCK_H"] == 16
    with pytest.raises(DecodeInputError, match="impl=reg has no fp8"):
        config.resolve(16, 1, 128, 512, H200, qk="fp8", overrides={"impl": "reg"})


def test_architecture_tables_scale_with_the_sm_count():
    """A Hopper GPU without its own table follows the H200's rules relative to its SM count: random SM counts and
    rows give the same body, waves and prefetch as the rules written out."""
    rng = random.Random()
    for _ in range(300):
        n = rng.randint(8, 200)
        dev = config.Device("NVIDIA Some Hopper", (9, 0), n)
        T = rng.randint(1, 6 * n)
        qk = rng.choice(["bf16", "fp8"])
        cfg = config.resolve(16, T, 128, 512, dev, qk=qk).config
        if qk == "bf16" and T <= 4 * n:
            assert cfg["impl"] == "reg", (n, T)
            continue
        waves = 4.0 if 4 * T <= 3 * n else (1.0 if 20 * T >= 19 * n else 2.0)
        assert (cfg["impl"], cfg["waves"], cfg["PREFETCH"]) == ("tiled", waves, 2 if 3 * T >= n else 0), (n, T, qk)


def test_unknown_gpus_and_the_interpreter():
    """A GPU of another architecture reads the default tables (the tiled body, head blocks up to 64 rows, no
    register body unless asked for); the interpreter runs its small tiled launch whatever the device."""
    a100 = config.Device("NVIDIA A100-SXM4-80GB", (8, 0), 108)
    for H, bh in ((8, 16), (24, 32), (128, 64)):
        L = config.resolve(H, 1, 128, 512, a100)
        assert (L.config["impl"], L.config["BLOCK_H"]) == ("tiled", bh) and L.source.endswith("default.json[1]")
    L = config.resolve(16, 3, 128, 512, H200, interpret=True)
    assert (L.config["impl"], L.config["BLOCK_N"], L.config["num_warps"], L.source) == ("tiled", 16, 4, "interpreter")
    assert config.resolve(16, 8, 128, 512, H200).source == "H=16,qk=bf16,device_name=NVIDIA_H200.json[1]"
    # sm_121 shares sm_120's tables
    gb10 = config.Device("NVIDIA GB10", (12, 1), 48)
    assert "arch_sm_120" in config.resolve(64, 1, 128, 512, gb10, qk="fp8").source


def test_check_env_reports_each_problem_on_one_line():
    assert config.check_env({}) == []
    assert config.check_env({"DSV4_SM120_ATTN_CONFIG": "impl=reg,KCVT=0", "DSV4_SM120_ATTN_QK": "bf16"}) == []
    probs = config.check_env({"DSV4_SM120_ATTN_CONFIG": "impl=reg", "DSV4_SM120_ATTN_QK": "fp8"})
    assert len(probs) == 1 and "impl=reg has no fp8 QK path" in probs[0]
    probs = config.check_env({"DSV4_SM120_ATTN_CONFIG": "QPRE=1", "DSV4_SM120_ATTN_QK": "int8"})
    assert len(probs) == 2 and all("\n" not in p for p in probs)
    assert any("unknown key 'QPRE'" in p for p in probs) and any("DSV4_SM120_ATTN_QK" in p for p in probs)


def test_the_warp_specialized_body_launch_rules():
    """impl=wspec: the register body's splits with its fixed launch (16 heads, 32-candidate blocks, 4 consumer warps,
    spanning splits), a register cap of 128 on Hopper only (two CTAs per SM there; none on sm_120), a user's maxnreg
    kept, a clash with the fixed keys refused, the interpreter and fp8 QK refused with a clear error."""
    for cap, cap_nreg in (((9, 0), 128), ((12, 0), 0), ((10, 0), 0)):
        L = config.resolve(16, 384, 128, 512, config.Device("x", cap, 132), overrides={"impl": "wspec"})
        c = L.config
        assert (c["impl"], c["BLOCK_H"], c["BLOCK_N"], c["num_warps"], c["spanning_splits"]) == ("wspec", 16, 32, 4, 1)
        assert c["maxnreg"] == cap_nreg, cap
        assert L.plan == config.resolve(16, 384, 128, 512, config.Device("x", cap, 132),
                                        overrides={"impl": "reg", "BLOCK_N": 32, "waves": c["waves"]}).plan
    assert config.resolve(16, 6, 128, 512, HOPPER_132, overrides={"impl": "wspec", "maxnreg": 0}).config["maxnreg"] == 0
    with pytest.raises(DecodeInputError, match="impl=wspec runs"):
        config.resolve(16, 6, 128, 512, HOPPER_132, overrides={"impl": "wspec", "BLOCK_N": 64})
    with pytest.raises(DecodeInputError, match="DSV4_SM120_ATTN_CONFIG: impl=wspec runs"):  # the preflight's check
        config.parse_config("impl=wspec,num_warps=8", "DSV4_SM120_ATTN_CONFIG")
    assert config.parse_config("impl=wspec,BLOCK_N=32,maxnreg=0") == {"impl": "wspec", "BLOCK_N": 32, "maxnreg": 0}
    with pytest.raises(DecodeInputError, match="interpreter cannot run it"):
        config.resolve(16, 6, 128, 512, config.Device("cpu", None, 4), overrides={"impl": "wspec"}, interpret=True)
    with pytest.raises(DecodeInputError, match="no fp8 QK path"):
        config.resolve(16, 6, 128, 512, HOPPER_132, qk="fp8", overrides={"impl": "wspec"})


@pytest.mark.parametrize("dev", [RTX_PRO_6000, HOPPER_132])
def test_the_warp_specialized_body_at_32_and_64_heads_per_program(dev):
    """impl=wspec,BLOCK_H=32 / 64: 8 consumer warps, 32- / 16-candidate blocks, a register cap of 168 (12 warps fill
    the register file: one CTA per SM, so one program slot per SM unless the user says otherwise) on every
    architecture, spanning splits over ceil(H / BLOCK_H) programs a row; other head counts per program, and a block
    size or warp count of another BLOCK_H, refused when the text is parsed."""
    for H, bh, bn, hg in ((32, 32, 32, 1), (64, 32, 32, 2), (24, 32, 32, 1), (64, 64, 16, 1), (128, 64, 16, 2)):
        L = config.resolve(H, 96, 128, 512, dev, overrides={"impl": "wspec", "BLOCK_H": bh})
        c = L.config
        assert (c["impl"], c["BLOCK_H"], c["BLOCK_N"], c["num_warps"], c["maxnreg"], c["waves"],
                c["spanning_splits"]) == ("wspec", bh, bn, 8, 168, 1.0, 1), (H, bh, c)
        S, chunk = plan_span(96, hg, 128, 512, bn, dev.num_sms, 1.0)
        assert L.plan == (S, chunk, 0, bn), (H, bh, L.plan)
    kept = config.resolve(32, 96, 128, 512, dev, overrides={"impl": "wspec", "BLOCK_H": 32, "waves": 2})
    assert (kept.config["waves"], kept.config["maxnreg"]) == (2.0, 168)
    with pytest.raises(DecodeInputError, match="impl=wspec runs"):   # 12 warps past 168 registers: no launch
        config.resolve(32, 96, 128, 512, dev, overrides={"impl": "wspec", "BLOCK_H": 32, "maxnreg": 0})
    assert config.resolve(32, 96, 128, 512, dev, overrides={"impl": "wspec"}).config["BLOCK_H"] == 16  # as before
    for bad in ("impl=wspec,BLOCK_H=128", "impl=wspec,BLOCK_H=8", "impl=wspec,BLOCK_H=64,BLOCK_N=32",
                "impl=wspec,BLOCK_H=32,num_warps=4", "impl=wspec,BLOCK_H=32,BLOCK_N=16"):
        with pytest.raises(DecodeInputError, match="impl=wspec runs"):
            config.parse_config(bad, "DSV4_SM120_ATTN_CONFIG")
    assert config.parse_config("impl=wspec,BLOCK_H=64,BLOCK_N=16,num_warps=8")["BLOCK_N"] == 16
    from dsv4_sm120.attention.keys import producer_regs
    assert [producer_regs("wspec", 168, bh) for bh in (16, 32, 64)] == [128, 104, 88]
    assert producer_regs("wspec", 128, 16) == 96


def test_register_body_keys_over_a_warp_specialized_entry_keep_their_meaning():
    """sm_120's 32- / 64-head tables name wspec; launch keys given without impl that wspec's fixed launch sets or does
    not read (the calibration variants of the register body, what those tables held before) still run the register
    body with them, while keys wspec takes apply to it."""
    for H in (32, 64):
        default = config.resolve(H, 96, 128, 512, RTX_PRO_6000).config
        assert (default["impl"], default["BLOCK_H"]) == ("wspec", 32)
        for keys in ({"BLOCK_N": 16}, {"late_decode": 0}, {"spanning_splits": 0}, {"BLOCK_H": 16}, {"maxnreg": 0},
                     {"BLOCK_N": 64, "num_warps": 8, "waves": 1}, {"e4m3_int_decode": 0}):
            L = config.resolve(H, 96, 128, 512, RTX_PRO_6000, overrides=keys)
            assert L.config["impl"] == "reg" and "register-body keys over impl=wspec" in L.source, (H, keys)
            assert all(L.config[k] == v for k, v in keys.items()), (H, keys, L.config)
        took = config.resolve(H, 96, 128, 512, RTX_PRO_6000, overrides={"waves": 3, "PART_BF16": 0, "maxnreg": "auto"})
        assert (took.config["impl"], took.config["waves"], took.config["PART_BF16"], took.config["maxnreg"]) == \
            ("wspec", 3.0, 0, 168)


def test_the_warpgroup_mma_body_launch_rules():
    """impl=wgmma: the register body's spanning splits with its fixed launch (64 heads, 64-candidate blocks, 8
    consumer warps, register cap 168: one 384-thread CTA per SM, so one wave), on Hopper only (sm_120 and sm_100 are
    refused with a message naming the architecture), a clash with the fixed keys refused when the text is parsed, the
    interpreter and fp8 QK refused with a clear error; the workspace holds 64 head rows per head block."""
    for H, HG in ((8, 1), (16, 1), (64, 1), (128, 2)):
        L = config.resolve(H, 384, 128, 512, HOPPER_132, overrides={"impl": "wgmma"})
        c = L.config
        assert (c["impl"], c["BLOCK_H"], c["BLOCK_N"], c["num_warps"], c["spanning_splits"], c["maxnreg"]) == \
            ("wgmma", 64, 64, 8, 1, 168)
        assert c["waves"] == 1.0
        S, chunk, s2, _ = L.plan
        assert s2 == 0 and chunk % 64 == 0 and S * chunk >= 640 and (S - 1) * chunk < 640
        assert L.plan == config.resolve(H, 384, 128, 512, HOPPER_132, overrides={
            "impl": "reg", "BLOCK_N": 64, "BLOCK_H": 64, "waves": 1}).plan
    # few rows: the splits fill the SMs once (one CTA each)
    S, chunk, _, _ = config.resolve(64, 6, 128, 512, HOPPER_132, overrides={"impl": "wgmma"}).plan
    assert 6 * S <= 132 and chunk == 64 * -(-10 // S)
    for cap in ((12, 0), (10, 0), (8, 9)):
        with pytest.raises(DecodeInputError, match=rf"impl=wgmma runs on sm_90 only \(this device is sm_{cap[0]}{cap[1]}\)"):
            config.resolve(64, 6, 128, 512, config.Device("x", cap, 132), overrides={"impl": "wgmma"})
    for bad in ("impl=wgmma,BLOCK_N=32", "impl=wgmma,num_warps=4", "impl=wgmma,maxnreg=0", "impl=wgmma,BLOCK_H=16"):
        with pytest.raises(DecodeInputError, match="DSV4_SM120_ATTN_CONFIG: impl=wgmma runs"):
            config.parse_config(bad, "DSV4_SM120_ATTN_CONFIG")
    assert config.parse_config("impl=wgmma,BLOCK_N=64,waves=2") == {"impl": "wgmma", "BLOCK_N": 64, "waves": 2.0}
    assert config.resolve(64, 6, 128, 512, HOPPER_132, overrides={"impl": "wgmma", "waves": 2}).config["waves"] == 2.0
    with pytest.raises(DecodeInputError, match="interpreter cannot run it"):
        config.resolve(64, 6, 128, 512, config.Device("cpu", None, 4), overrides={"impl": "wgmma"}, interpret=True)
    with pytest.raises(DecodeInputError, match="no fp8 QK path"):
        config.resolve(64, 6, 128, 512, HOPPER_132, qk="fp8", overrides={"impl": "wgmma"})
    from dsv4_sm120.attention.launch import row_chunks, writes_output
    from dsv4_sm120.attention.plan import ws_words
    (t0, t1, L), = row_chunks(16, 6, 128, 512, HOPPER_132, "bf16", {"impl": "wgmma"}, False, 1 << 30)
    assert (t0, t1, L.config["BLOCK_H"]) == (0, 6, 64) and ws_words("wgmma", 1) == 258 and ws_words("wgmma", 0) == 514
    # one split per row: the split program writes out / lse and no combine runs; several: partials + combine
    for T, one in ((6, False), (48, False), (96, True), (192, True), (384, True)):
        L = config.resolve(64, T, 128, 512, HOPPER_132, overrides={"impl": "wgmma"})
        assert writes_output(L) == one == (L.plan[0] + L.plan[2] == 1), (T, L.plan)
    assert not writes_output(config.resolve(64, 384, 128, 512, HOPPER_132, overrides={"impl": "reg"}))


def test_the_warpgroup_mma_body_is_chosen_by_work_and_pays_for_its_combine():
    """Where the H200's tables name impl=wgmma: a call of fewer than plan.WGMMA_MIN_BLOCKS 64-candidate blocks (rows x
    blocks per row) takes the register body instead (its fixed cost outweighs a few blocks: 64 heads, 6 SWA-only rows),
    a named impl=wgmma is kept; and its split plan charges a plan of several splits the combine a single split does
    not launch, in proportion to the heads (SWA-only rows: 64 heads at 48 rows in one split, 32 heads at 24 in two)."""
    from dsv4_sm120.attention import plan as P

    h200 = config.Device("NVIDIA H200", (9, 0), 132)
    # (heads, rows, extra candidates, body, by the rule): 6 x 2 blocks < 48 <= 6 x 10; one row of 64 heads is 4 grid
    # rows, where the table itself names the register body
    for H, T, K2, impl, rule in ((64, 6, 0, "reg", True), (64, 6, 512, "wgmma", False), (64, 24, 0, "wgmma", False),
                                 (64, 1, 1024, "reg", False)):
        L = config.resolve(H, T, 128, K2, h200)
        assert L.config["impl"] == impl and ("few blocks" in L.source) == rule, (H, T, K2, L)
    assert config.resolve(64, 6, 128, 0, h200, overrides={"impl": "wgmma"}).config["impl"] == "wgmma"

    def best_splits(H, T, nb):
        # the plan's model written out: rounds of 132 one-CTA slots x (blocks + 5), + the combine for S > 1
        cost = {S: -(-T * S // 132) * (-(-nb // S) + P.WGMMA_PROGRAM_OVERHEAD_BLOCKS)
                + (P.WGMMA_COMBINE_BLOCKS * H / 64 if S > 1 else 0) for S in range(1, nb + 1)}
        return min(cost, key=lambda S: (cost[S], S))

    for H, T, K2, S in ((64, 48, 0, 1), (32, 24, 0, 2), (32, 48, 128, 2), (64, 24, 128, 4), (64, 96, 512, 1)):
        L = config.resolve(H, T, 128, K2, h200, overrides={"impl": "wgmma"})
        assert L.plan[0] + L.plan[2] == S == best_splits(H, T, -(-(128 + K2) // 64)), (H, T, K2, L.plan)


def test_the_candidates_as_m_body_takes_the_heads_as_n():
    """impl=wgmma_t (Hopper only): its fixed launch (64-candidate blocks, 4 consumer warps, one CTA per SM, spanning
    splits) whatever the table entry it came from; the heads as the MMA's N, 16 up to 16 heads and 32 above unless
    the user (or an entry naming the body) says 16; BLOCK_H 64 and other keys of its fixed launch refused by name;
    refused off Hopper; and where a table names it, a call of few blocks takes the register body as for wgmma."""
    h200 = config.Device("NVIDIA H200", (9, 0), 132)
    for H, bh in ((4, 16), (8, 16), (16, 16), (24, 32), (32, 32), (64, 32)):
        c = config.resolve(H, 96, 128, 512, h200, overrides={"impl": "wgmma_t"}).config
        assert (c["impl"], c["BLOCK_H"], c["BLOCK_N"], c["num_warps"], c["maxnreg"], c["spanning_splits"],
                c["waves"]) == ("wgmma_t", bh, 64, 4, 168, 1, 1.0), (H, c)
    assert config.resolve(32, 96, 128, 512, h200, overrides={"impl": "wgmma_t", "BLOCK_H": 16}).config["BLOCK_H"] == 16
    for bad in ({"BLOCK_H": 64}, {"BLOCK_H": 8}, {"num_warps": 8}, {"BLOCK_N": 32}):
        with pytest.raises(DecodeInputError, match="impl=wgmma_t runs"):
            config.resolve(16, 96, 128, 512, h200, overrides=dict(bad, impl="wgmma_t"))
        with pytest.raises(DecodeInputError, match="impl=wgmma_t runs"):
            config.parse_config(",".join(f"{k}={v}" for k, v in dict(bad, impl="wgmma_t").items()))
    with pytest.raises(DecodeInputError, match="sm_90 only"):
        config.resolve(16, 96, 128, 512, config.Device("NVIDIA RTX PRO 6000 Blackwell", (12, 0), 188),
                       overrides={"impl": "wgmma_t"})
    # a table entry naming the body (a root of our own): taken at many blocks, the register body below the rule
    import json
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "attention"
        root.mkdir()
        src = Path(config.lt.TABLE_DIR) / "attention"
        for f in src.glob("*.json"):
            (root / f.name).write_text(f.read_text())
        entry = {"impl": "wgmma_t", "BLOCK_H": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1, "maxnreg": 168,
                 "waves": 1, "spanning_splits": 1, "PART_BF16": 1}
        (root / "H=16,qk=bf16,device_name=NVIDIA_H200.json").write_text(json.dumps({"1": entry}))
        many = config.resolve(16, 96, 128, 512, h200, root=Path(d))
        few = config.resolve(16, 6, 128, 0, h200, root=Path(d))
    assert many.config["impl"] == "wgmma_t" and many.config["BLOCK_H"] == 16, many
    assert few.config["impl"] == "reg" and "few blocks for impl=wgmma_t" in few.source, few
    # the H200's own tables (a launch sweep with wgmma_t a candidate): wgmma_t where a call has >= 64 blocks x 16-head
    # groups (plan.WGMMA_T_MIN_WORK), the register body below; SWA-only rows hold two blocks, c4 rows ten
    for H, T, K2, impl, bh in ((16, 24, 0, "reg", None), (8, 24, 0, "reg", None), (16, 48, 0, "wgmma_t", 16),
                               (32, 24, 0, "wgmma_t", 32), (32, 12, 0, "reg", None), (16, 6, 512, "reg", None),
                               (16, 7, 512, "wgmma_t", 16), (16, 6, 1024, "wgmma_t", 16), (16, 1, 512, "reg", None)):
        L = config.resolve(H, T, 128, K2, h200)
        assert L.config["impl"] == impl and (bh is None or L.config["BLOCK_H"] == bh), (H, T, K2, L)
        assert ("few blocks for impl=wgmma_t" in L.source) == (impl == "reg"), (H, T, K2, L)


def test_balanced_plan_covers_every_block_once_and_the_launch_takes_it():
    """plan.plan_balanced / balanced_runs (impl=wgmma_t,balanced=1): over random shapes, every block of every grid row
    is held by exactly one program, each program's run is W // C or W // C + 1 blocks in one piece per row, a row's
    pieces are numbered 0.. in program order, their count agrees with plan.balanced_cut (which the kernels compute)
    and with a search for the owner of the row's first and last blocks, and S is the most of any row. resolve gives
    that plan (S splits, the chunk a whole row) and refuses balanced=1 for the other bodies."""
    rnd = random.Random(29)
    for _ in range(300):
        T, HG, K, nsm = rnd.randint(1, 400), rnd.choice((1, 1, 2, 4)), rnd.randint(1, 1300), rnd.choice((4, 132, 188))
        C, NB, S = plan.plan_balanced(T, HG, K, nsm)
        W = T * HG * NB
        assert NB == -(-K // 64) and C == min(nsm, W), (T, HG, K, nsm)
        runs = plan.balanced_runs(T, HG, K, nsm)
        held, per_prog, rows = {}, {}, {}
        for c, r, j0, j1, s, n in runs:
            assert 0 <= j0 < j1 <= NB
            for j in range(j0, j1):
                assert (r, j) not in held
                held[(r, j)] = c
            per_prog[c] = per_prog.get(c, 0) + j1 - j0
            rows.setdefault(r, []).append((c, s, n))
        assert len(held) == W and set(per_prog.values()) <= {W // C, W // C + 1}, (T, HG, K, nsm)
        for r, ps in rows.items():
            owner_first, owner_last = held[(r, 0)], held[(r, NB - 1)]
            assert plan.balanced_cut(NB, W, C, r) == (owner_first, owner_last)
            assert [s for _, s, _ in sorted(ps)] == list(range(len(ps))) and {n for _, _, n in ps} == {len(ps)}
            assert len(ps) == owner_last - owner_first + 1
        assert S == max(len(ps) for ps in rows.values())
    h200 = config.Device("NVIDIA H200", (9, 0), 132)
    L = config.resolve(16, 192, 128, 512, h200, overrides={"impl": "wgmma_t", "balanced": 1})
    assert L.config["balanced"] == 1 and L.plan == (plan.plan_balanced(192, 1, 640, 132)[2], 640, 0, 64), L
    # not asked for: where the makespan model says the classic plan leaves SMs idle, at 16 heads per program and
    # rows of >= 10 blocks (plan.balanced_pays; the H200 points it was fitted on: balanced faster at 72 rows of c4 and
    # c128 at 128k, at 138-312 rows of c4; classic at 24-48 and 96-120 rows of c4, 384 rows, SWA-only rows)
    for H, T, K2, want in ((16, 192, 512, 1), (8, 144, 512, 1), (16, 300, 512, 1), (16, 156, 1024, 1),
                           (16, 72, 512, 1), (16, 72, 1024, 1), (8, 72, 1024, 1), (16, 138, 512, 1),
                           (16, 24, 512, 0), (16, 48, 512, 0), (16, 120, 512, 0), (16, 120, 1024, 0),
                           (16, 96, 512, 0), (16, 384, 512, 0), (16, 384, 1024, 0), (16, 192, 0, 0), (16, 72, 0, 0),
                           (32, 192, 512, 0), (16, 192, 1024, 0)):
        assert config.resolve(H, T, 128, K2, h200, overrides={"impl": "wgmma_t"}).config["balanced"] == want, (H, T, K2)
        assert config.resolve(H, T, 128, K2, h200).config.get("balanced", 0) == want, (H, T, K2)
    assert config.resolve(16, 192, 128, 512, h200, overrides={"impl": "wgmma_t", "balanced": 0}).config["balanced"] == 0
    # a table entry naming wgmma_t that sets the key is taken as it is (the rule fills in only where nothing does)
    import json
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "attention"
        root.mkdir()
        for f in (Path(config.lt.TABLE_DIR) / "attention").glob("*.json"):
            (root / f.name).write_text(f.read_text())
        entry = {"impl": "wgmma_t", "BLOCK_H": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1, "maxnreg": 168,
                 "waves": 1, "spanning_splits": 1, "PART_BF16": 1}
        for value, T in ((0, 192), (1, 384)):
            (root / "H=16,qk=bf16,device_name=NVIDIA_H200.json").write_text(json.dumps({"1": dict(entry,
                                                                                                   balanced=value)}))
            assert config.resolve(16, T, 128, 512, h200, root=Path(d)).config["balanced"] == value, (value, T)
    # past the kernels' 32-bit run arithmetic ((W + NB) x C < 2^31) the classic plan runs
    huge = config.resolve(16, 1 << 22, 128, 512, h200, overrides={"impl": "wgmma_t", "balanced": 1})
    assert not plan.balanced_fits(1 << 22, 1, 640, 132) and huge.config["balanced"] == 0, huge
    # 16 heads per program: at 32 heads two head groups, BLOCK_H=32 refused
    L32 = config.resolve(32, 192, 128, 512, h200, overrides={"impl": "wgmma_t", "balanced": 1})
    assert L32.config["BLOCK_H"] == 16 and L32.plan[0] == plan.plan_balanced(192, 2, 640, 132)[2], L32
    with pytest.raises(DecodeInputError, match="balanced=1 runs 16 heads per program"):
        config.resolve(32, 192, 128, 512, h200, overrides={"impl": "wgmma_t", "balanced": 1, "BLOCK_H": 32})
    for impl in ("reg", "wgmma", "tiled"):
        with pytest.raises(DecodeInputError, match="balanced=1 is a launch of impl=wgmma_t only"):
            config.resolve(16, 192, 128, 512, h200, overrides={"impl": impl, "balanced": 1})
    # the same refusals where a launch text is read (DSV4_SM120_ATTN_CONFIG, bench --variants), naming the source
    for text, msg in (("impl=reg,balanced=1", "balanced=1 is a launch of impl=wgmma_t only"),
                      ("impl=wgmma_t,BLOCK_H=32,balanced=1", "balanced=1 runs 16 heads per program")):
        with pytest.raises(DecodeInputError, match=f"DSV4_SM120_ATTN_CONFIG: {msg}"):
            config.parse_config(text, "DSV4_SM120_ATTN_CONFIG")
        assert any(msg in p for p in config.check_env({"DSV4_SM120_ATTN_CONFIG": text})), text
    assert config.parse_config("balanced=1") == {"balanced": 1}
    # without impl it applies where the table's body is wgmma_t (192 rows) and not to the register body (6 rows)
    assert config.resolve(16, 192, 128, 512, h200, overrides={"balanced": 1}).config.get("balanced") == 1
    assert "balanced" not in config.resolve(16, 6, 128, 512, h200, overrides={"balanced": 1}).config
