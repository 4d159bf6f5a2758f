"""Format code in dsv4_sm120.nvfp4 against independent float64 references.

The references below are written from the format definitions (bit fields,
brute-force nearest-value search), not from the code under test.
"""

import math

import pytest
import torch

from dsv4_sm120 import nvfp4 as F


def _e2m1_ref(code: int) -> float:
    """e2m1 from its bit fields: s | e e | m, bias 1, subnormal at e == 0."""
    s = -1.0 if code & 8 else 1.0
    e = (code >> 1) & 3
    m = code & 1
    mag = (m * 0.5) if e == 0 else (2.0 ** (e - 1)) * (1.0 + m / 2.0)
    return s * mag


def _e4m3_all():
    """All finite float8_e4m3fn values (from the bit fields), as float64."""
    vals = {}
    for b in range(256):
        s = -1.0 if b & 0x80 else 1.0
        e = (b >> 3) & 0xF
        m = b & 7
        if e == 15 and m == 7:
            continue  # NaN
        v = (m / 8.0) * 2.0**-6 if e == 0 else (1 + m / 8.0) * 2.0 ** (e - 7)
        vals[b] = s * v
    return vals


def _rne_to_grid(x: float, grid):
    """Nearest grid value to x; ties go to the entry with the even index."""
    best = None
    for i, g in enumerate(grid):
        d = abs(x - g)
        if best is None or d < best[0] - 1e-300 or (d == best[0] and i % 2 == 0 and best[1] % 2 == 1):
            best = (d, i)
    return best[1]


def _e2m1_rne_ref(x: float) -> int:
    """Reference RNE, saturating, sign-preserving e2m1 encoder."""
    mags = [_e2m1_ref(c) for c in range(8)]
    a = min(abs(x), 6.0)
    c = _rne_to_grid(a, mags)
    return c | (8 if math.copysign(1.0, x) < 0 else 0)


def test_value_table_matches_bit_fields():
    for c in range(16):
        assert F.E2M1_VALUES[c].item() == _e2m1_ref(c)
    assert torch.signbit(F.E2M1_VALUES[8])  # code 8 is -0.0


def test_pack_unpack_low_nibble_is_even_index():
    b = torch.tensor([[0x21, 0xF0, 0x8A]], dtype=torch.uint8)
    codes = F.unpack_e2m1(b)
    assert codes.tolist() == [[1, 2, 0, 15, 10, 8]]
    assert torch.equal(F.pack_e2m1(codes), b)
    g = torch.Generator().manual_seed(1234)
    w = torch.randint(0, 256, (3, 5, 8), dtype=torch.uint8, generator=g)
    assert torch.equal(F.pack_e2m1(F.unpack_e2m1(w)), w)
    # int8 storage (how the DSv4 checkpoint declares it) is the same bytes
    assert torch.equal(F.unpack_e2m1(w.view(torch.int8)), F.unpack_e2m1(w))
    with pytest.raises(ValueError):
        F.pack_e2m1(torch.zeros(3, dtype=torch.uint8))
    # the byte-table lookup agrees with unpack + value table for every byte
    allb = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    ref = torch.tensor([[_e2m1_ref(int(b) & 15) if i % 2 == 0 else _e2m1_ref(int(b) >> 4)
                         for b in row for i in (0, 1)] for row in allb], dtype=torch.float64)
    for dt in (torch.float32, torch.float64):
        got = F.packed_e2m1_to_float(allb, dt)
        assert got.dtype == dt and torch.equal(got.double(), ref)
        assert torch.equal(torch.signbit(got), torch.signbit(ref))
    assert torch.equal(F.e2m1_to_float(F.unpack_e2m1(allb)).double(), ref)


def test_rne_encoder_against_brute_force():
    mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    mids = [(a + b) / 2 for a, b in zip(mags, mags[1:])]
    specials = mags + mids + [m * (1 + 2**-20) for m in mids] + [m * (1 - 2**-20) for m in mids]
    specials += [6.5, 7.0, 100.0, 1e30, 1e-30, 2**-126]
    g = torch.Generator().manual_seed(7)
    rand = (torch.rand(2000, generator=g, dtype=torch.float64) * 8).tolist()
    xs = specials + rand
    xs = xs + [-x for x in xs]
    t = torch.tensor(xs, dtype=torch.float32)
    got = F.float_to_e2m1_rne(t).tolist()
    for x32, c in zip(t.tolist(), got):
        assert c == _e2m1_rne_ref(x32), (x32, c)
    with pytest.raises(ValueError):
        F.float_to_e2m1_rne(torch.tensor([float("nan")]))


def _mx_ref(w, s):
    """float64 MXFP4 reference, element by element."""
    rows = []
    for r in range(w.shape[0]):
        row = []
        for i in range(w.shape[1] * 2):
            byte = int(w[r, i // 2])
            code = (byte & 0xF) if i % 2 == 0 else (byte >> 4)
            row.append(_e2m1_ref(code) * 2.0 ** (int(s[r, i // 32]) - 127))
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64)


def test_dequant_mxfp4_against_reference():
    g = torch.Generator().manual_seed(11)
    w = torch.randint(0, 256, (3, 32), dtype=torch.uint8, generator=g)
    s = torch.randint(100, 150, (3, 2), dtype=torch.uint8, generator=g)
    s[0, 0] = 0  # 2^-127: a float32 subnormal, still exact
    s[2, 1] = 254
    ref = _mx_ref(w, s)
    got64 = F.dequant_mxfp4(w, s, out_dtype=torch.float64)
    assert torch.equal(got64, ref)
    got = F.dequant_mxfp4(w, s)
    assert got.dtype == torch.float32
    fin = ref.abs() <= torch.finfo(torch.float32).max
    assert torch.equal(got.double()[fin], ref[fin])
    assert torch.isinf(got[~fin]).all() and (~fin).any()  # 2^127 * 4 overflows float32
    # float8_e8m0fnu storage gives the same result
    assert torch.equal(F.dequant_mxfp4(w, s.view(torch.float8_e8m0fnu)), got)
    bad = s.clone()
    bad[1, 1] = 255
    with pytest.raises(ValueError, match="NaN"):
        F.dequant_mxfp4(w, bad)
    with pytest.raises(ValueError, match="scale shape"):
        F.dequant_mxfp4(w, s[:, :1])


def test_dequant_nvfp4_against_reference():
    g = torch.Generator().manual_seed(12)
    w = torch.randint(0, 256, (2, 16), dtype=torch.uint8, generator=g)
    sc_bytes = torch.randint(0, 0x7E, (2, 2), dtype=torch.uint8, generator=g)
    sc = sc_bytes.view(torch.float8_e4m3fn)
    e4 = _e4m3_all()
    s2 = 0.3125
    got = F.dequant_nvfp4(w, sc, torch.tensor(s2))
    for r in range(2):
        for i in range(32):
            byte = int(w[r, i // 2])
            code = (byte & 0xF) if i % 2 == 0 else (byte >> 4)
            ref = _e2m1_ref(code) * e4[int(sc_bytes[r, i // 16])] * s2
            assert got[r, i].item() == pytest.approx(ref, rel=1e-6, abs=0)
    with pytest.raises(TypeError):
        F.dequant_nvfp4(w, sc.float(), 1.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quantize_nvfp4_is_nearest_on_its_grid(seed):
    g = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(4, 64, generator=g) * torch.exp(torch.randn(4, 1, generator=g) * 3)
    x[0, :16] = 0.0  # an all-zero block
    x[1, 3] = 1e4  # an outlier block
    w, sc, s2 = F.quantize_nvfp4(x)
    assert w.dtype == torch.uint8 and w.shape == (4, 32)
    assert sc.dtype == torch.float8_e4m3fn and sc.shape == (4, 4)
    amax = x.abs().max().double().item()
    assert s2.item() == pytest.approx(amax / (448 * 6), rel=1e-6)
    e4 = _e4m3_all()
    pos = sorted({v for b, v in e4.items() if v >= 0 and b < 0x80})
    codes = F.unpack_e2m1(w)
    s2d = float(s2)
    for r in range(4):
        for b in range(4):
            blk = x[r, b * 16 : (b + 1) * 16].double()
            want = min(blk.abs().max().item() / (6 * s2d), 448.0)
            # block scale: the float32 value RNE-rounded onto the E4M3 grid
            want32 = torch.tensor(want, dtype=torch.float32).item()
            i = _rne_to_grid(want32, pos)
            assert sc[r, b].float().item() == pos[i]
            denom = pos[i] * s2d
            for j in range(16):
                c = int(codes[r, b * 16 + j])
                if denom == 0:
                    assert c & 7 == 0
                    continue
                q = torch.tensor(blk[j].item() / denom, dtype=torch.float32).item()
                assert c == _e2m1_rne_ref(q) or (q == 0 and c & 7 == 0)
    # dequantized error: at most half the top e2m1 step (1 unit of the block
    # scale), or the saturation loss when the E4M3 scale rounded down (which
    # is large only for blocks whose scale falls in E4M3's subnormal range)
    y = F.dequant_nvfp4(w, sc, s2)
    err = (y.double() - x.double()).abs().reshape(4, 4, 16).amax(-1)
    unit = sc.double() * s2d
    bamax = x.double().abs().reshape(4, 4, 16).amax(-1)
    bound = torch.maximum(unit, bamax - 6 * unit) * (1 + 1e-6) + 1e-30
    assert (err <= bound).all()
    normal = sc.double() >= 2.0**-6
    assert (err[normal] <= unit[normal] * (1 + 1e-6)).all()


def test_quantize_nvfp4_shared_scale_2_and_errors():
    x = torch.randn(2, 32)
    _, _, s2 = F.quantize_nvfp4(x, scale_2=0.5)
    assert s2.item() == 0.5
    with pytest.raises(ValueError):
        F.quantize_nvfp4(x, scale_2=0.0)
    with pytest.raises(ValueError):
        F.quantize_nvfp4(torch.randn(2, 20))
    with pytest.raises(ValueError):
        F.quantize_nvfp4(torch.tensor([float("inf")] * 16))
    _, sc, s2 = F.quantize_nvfp4(torch.zeros(1, 16))
    assert s2.item() == 1.0 and sc.float().abs().sum() == 0


def _random_mx(rows, k, lo, hi, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 256, (rows, k // 2), dtype=torch.uint8, generator=g)
    s = torch.randint(lo, hi + 1, (rows, k // 32), dtype=torch.uint8, generator=g)
    return w, s


@pytest.mark.parametrize("lo,hi", [(127 - 17, 127), (0, 17), (254 - 17, 254), (120, 120)])
def test_mxfp4_to_nvfp4_bit_exact_in_range(lo, hi):
    w, s = _random_mx(8, 128, lo, hi, seed=lo + hi)
    s[0, 0], s[0, 1] = lo, hi  # both ends of the exact range present
    out_w, sc, s2, st = F.mxfp4_to_nvfp4(w, s)
    assert st.out_of_range == 0 and st.lossy == 0 and st.max_abs_err == 0.0
    assert torch.equal(out_w, w)  # nibbles verbatim
    assert sc.shape == (8, 8) and sc.dtype == torch.float8_e4m3fn
    assert s2.dtype == torch.float32 and s2.dim() == 0
    m = hi - 127 - 8
    assert s2.item() == 2.0**m and st.global_exponent == m
    # every E4M3 block scale is exactly 2^(k_j - m), twice per 32-block
    k = s.long() - 127
    want = torch.pow(2.0, (k - m).double()).repeat_interleave(2, -1)
    assert torch.equal(sc.double().float().double(), want)
    ref = _mx_ref(w, s)
    got = F.dequant_nvfp4(out_w, sc, 1.0).double() * 2.0**m
    assert torch.equal(got, ref)
    got2 = F.dequant_nvfp4(out_w, sc, torch.tensor(2.0**m, dtype=torch.float64), out_dtype=torch.float64)
    assert torch.equal(got2, ref)


def test_mxfp4_to_nvfp4_shared_global_scale_w1_w3():
    w1, s1 = _random_mx(4, 64, 118, 125, seed=5)
    w3, s3 = _random_mx(4, 64, 120, 130, seed=6)
    m = F.mxfp4_global_exponent(s1, s3)
    assert m == max(int(s1.max()), int(s3.max())) - 127 - 8
    a = F.mxfp4_to_nvfp4(w1, s1, m)
    b = F.mxfp4_to_nvfp4(w3, s3, m)
    assert a[2].item() == b[2].item() == 2.0**m
    assert torch.equal(F.dequant_nvfp4(*a[:3], out_dtype=torch.float64), _mx_ref(w1, s1))
    assert torch.equal(F.dequant_nvfp4(*b[:3], out_dtype=torch.float64), _mx_ref(w3, s3))
    with pytest.raises(ValueError, match="too small"):
        F.mxfp4_to_nvfp4(w3, s3, m - 1)


def test_mxfp4_to_nvfp4_out_of_range_clamped_and_measured():
    w, s = _random_mx(4, 128, 125, 130, seed=9)
    s[1, 2] = 130 - 18  # d = -10: one step out of range
    s[2, 0] = 130 - 30  # far out of range
    s[3, 3] = 130 - 9 - 8  # d = -9 exactly: still exact
    w[2, :16] = 0x77  # all codes 6.0 / 6.0 in the far block
    out_w, sc, s2, st = F.mxfp4_to_nvfp4(w, s)
    assert st.out_of_range == 2
    m = st.global_exponent
    assert m == 130 - 127 - 8
    ref = _mx_ref(w, s)
    got = F.dequant_nvfp4(out_w, sc, 1.0).double() * 2.0**m
    # in-range blocks are untouched and exact
    mask = torch.ones_like(ref, dtype=torch.bool)
    mask[1, 64:96] = False
    mask[2, 0:32] = False
    assert torch.equal(got[mask], ref[mask])
    # clamped blocks: scale 2^-9, values are the RNE rounding of the source onto
    # that grid (independent brute-force reference)
    assert sc.float()[1, 4].item() == 2.0**-9 and sc.float()[2, 0].item() == 2.0**-9
    step = 2.0 ** (m - 9)
    for r, cols in ((1, range(64, 96)), (2, range(0, 32))):
        for c in cols:
            want = _e2m1_ref(_e2m1_rne_ref(ref[r, c].item() / step) & 15) * step
            assert got[r, c].item() == want
    err = (got - ref).abs().max().item()
    assert st.max_abs_err == err and err > 0
    assert st.lossy >= 1
    assert st.max_rel_err == pytest.approx(err / ref.abs().max().item())


def _oor_reference(w, s):
    """Independent per-32-block expectation for mxfp4_to_nvfp4 (float64, element by element):
    (out_of_range count, lossy count, max abs error, expected dequantized output). The global
    exponent m = max k - 8; an out-of-range block's values are re-rounded (brute-force RNE) onto
    the grid 2^(m - 9), and it is lossy when any value changes."""
    rows, k = w.shape[0], w.shape[1] * 2
    m = max(int(b) for b in s.reshape(-1)) - 127 - 8
    src = _mx_ref(w, s)
    want = src.clone()
    n_oor = n_lossy = 0
    err = 0.0
    for r in range(rows):
        for j in range(k // 32):
            kj = int(s[r, j]) - 127
            if kj - m >= -9:
                continue
            n_oor += 1
            changed = False
            for c in range(j * 32, (j + 1) * 32):
                v = src[r, c].item()
                t = v / 2.0 ** (m - 9)  # exact: a power-of-two division in float64's range
                got = _e2m1_ref(_e2m1_rne_ref(t)) * 2.0 ** (m - 9)
                want[r, c] = got
                if got != v:
                    changed = True
                    err = max(err, abs(got - v))
            n_lossy += changed
    return n_oor, n_lossy, err, want, m


@pytest.mark.parametrize("case", ["sweep", "far_only"])
def test_mxfp4_to_nvfp4_counts_far_out_of_range_blocks(case):
    """Scale bytes up to 254 binades apart (0 next to 254): every out-of-range block is counted
    as lossy exactly when a value changes, however far below the maximum, and the max error is
    measured; checked against an element-by-element float64 reference."""
    g = torch.Generator().manual_seed(31)
    rows = 64
    w = torch.randint(0, 256, (rows, 64), dtype=torch.uint8, generator=g)  # K = 128: 4 blocks per row
    if case == "sweep":
        # every shift s = 237 - b from 1 to 237 binades below the clamped scale, plus in-range blocks
        s = torch.tensor(list(range(0, 256 - 1)) + [254], dtype=torch.uint8)[:rows * 4].reshape(rows, 4)
        s[0, 0], s[0, 1] = 254, 0
    else:
        # only blocks > 158 binades below (where a float32 shift underflows) and in-range ones
        s = torch.randint(0, 60, (rows, 4), dtype=torch.uint8, generator=g)
        s[::3, 2] = torch.randint(240, 255, (len(range(0, rows, 3)),), dtype=torch.uint8, generator=g)
        s[0, 0] = 254
    # blocks whose codes survive small shifts, or any shift: 6.0 (12 half units), 4.0, zeros, -0
    for r, byte in ((1, 0x77), (2, 0x66), (3, 0x00), (4, 0x88), (5, 0x22), (6, 0x73)):
        w[r, :] = byte
    n_oor, n_lossy, err, want, m = _oor_reference(w, s)
    out_w, sc, s2, st = F.mxfp4_to_nvfp4(w, s)
    assert st.global_exponent == m and s2.item() == 2.0**m
    assert st.out_of_range == n_oor and n_oor > 0
    assert st.lossy == n_lossy and 0 < n_lossy < n_oor
    assert st.max_abs_err == err and err > 0
    assert st.max_rel_err == pytest.approx(err / _mx_ref(w, s).abs().max().item())
    got = F.dequant_nvfp4(out_w, sc, torch.tensor(2.0**m, dtype=torch.float64), out_dtype=torch.float64)
    assert torch.equal(got, want)


def test_mxfp4_to_nvfp4_rejects_bad_input():
    w, s = _random_mx(2, 64, 120, 125, seed=3)
    with pytest.raises(ValueError):
        F.mxfp4_to_nvfp4(w, s[:, :1])
    s2 = s.clone()
    s2[0, 0] = 255
    with pytest.raises(ValueError, match="NaN"):
        F.mxfp4_to_nvfp4(w, s2)
    with pytest.raises(TypeError):
        F.mxfp4_to_nvfp4(w.float(), s)
