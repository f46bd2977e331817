"""specserve's native quantized products (specserve/native/csrc/qgemm*) on GGUF Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K weights.

Exact tests: units dequantize to the gguf package's own floats bit for bit; `qgemm` equals, bit
for bit, `reference_qgemm` below (qgemm.h's defined arithmetic in torch), at every CPU level this
machine has and whatever rows share the call; load-time quantization equals the gguf package's.
One tolerance test, kept apart: `qgemm` against float64 products of the dequantized weight, within
the error that int8 activation quantization explains.
"""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from specserve import native
from specserve.hardware import Isa, machine
from tests.helpers import native_levels

ext = native.load()
pytestmark = pytest.mark.skipif(ext is None, reason=f"native kernels unavailable: {native.unavailable_reason()}")

FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
LEVELS = [int(lvl) for lvl in native_levels()]  # generic .. the highest level the kernels run here
# Byte offsets in a raw GGUF block of the fp16 scale d and of the fp16 min (Q4_1) or dmin (K-quants).
SCALE_AT = {"Q4_0": (0, None), "Q4_1": (0, 2), "Q5_0": (0, None), "Q5_1": (0, 2), "Q8_0": (0, None),
            "IQ4_NL": (0, None), "Q2_K": (80, 82), "Q3_K": (108, None), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, None)}
# Raw bytes that put every weight of a block at its largest magnitude: Q5_0 q = 0 (-16), IQ4_NL q = 0
# (-127), Q3_K q = 0 (-4) with scales -32, Q6_K q = 0 (-32) with scales -128, the others every bit set
# (q = 15 or 31, 6-bit scale and min 63); from this byte of the block on (after the fp16 fields).
EXTREME = {"Q2_K": (0, 0xFF), "Q3_K": (0, 0x00), "Q5_0": (2, 0x00), "Q5_1": (4, 0xFF), "IQ4_NL": (2, 0x00), "Q4_K": (4, 0xFF), "Q5_K": (4, 0xFF)}
ROWS, COLS = 40, 512  # 40 rows: the last unit row is padded


def fp16_bytes(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float16).reshape(-1, 1).view(np.uint8)


def random_raw(fmt: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF rows uint8 [rows, row_bytes]. The gguf package quantizes Q4_0, Q4_1 and Q8_0 (from
    normal weights); the other formats' blocks are random bytes (every bit pattern of Q5_0's and
    Q5_1's fifth bits, every IQ4_NL table entry) with sane fp16 scales of either sign, the last
    row takes the largest block sums the formats allow (every weight at its extreme) and the one
    before it every stored value at its largest (the largest int16 sums the AVX2 and AVX-512
    levels add before widening)."""
    rng = np.random.default_rng(seed)
    t = Q[fmt]
    block, size = GGML_QUANT_SIZES[t]
    if fmt in ("Q4_0", "Q4_1", "Q8_0"):
        raw = quantize(rng.standard_normal((rows, cols)).astype(np.float32), t).reshape(rows, cols // block, size)
        if fmt != "Q8_0" and rows > 1:  # every stored value at 15: the largest int16 runs of pair sums (qgemm_simd.inc)
            raw[-2, :, -block // 2:] = 0xFF  # the block's 16 bytes of nibbles, after its fp16 fields
        return raw.reshape(rows, -1)
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    raw[-min(2, rows)] = 0xFF  # every stored value at its largest (the fp16 fields are set below)
    if fmt == "Q6_K":  # q = 0 (weight -32) everywhere, scales -128: |I| = 4096 * 127 * 32, just under 2^24
        raw[-1, :, :192], raw[-1, :, 192:208] = 0, 0x80
    else:
        at, byte = EXTREME[fmt]
        raw[-1, :, at:] = byte
    for at in (a for a in SCALE_AT[fmt] if a is not None):
        d = rng.uniform(1e-3, 1e-1, raw.shape[:2]) * rng.choice([-1.0, 1.0], raw.shape[:2])
        raw[:, :, at:at + 2] = fp16_bytes(d).reshape(raw.shape[0], raw.shape[1], 2)
    return raw.reshape(rows, -1)


def packed(fmt: str, rows: int = ROWS, cols: int = COLS, seed: int = 0):
    raw = random_raw(fmt, rows, cols, seed)
    return raw, ext.repack(int(Q[fmt]), torch.from_numpy(raw), cols)


# ---- the reference: qgemm.h's arithmetic in torch ------------------------------------------------


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 fma(a, b, c) exactly: a * b is exact in float64 (24 + 24 bits); the sum is rounded to
    odd in float64 (TwoSum gives its error; an inexact even result steps one ulp toward the exact
    sum), and rounding a round-to-odd value of >= 24 + 2 bits to float32 is the one correct
    rounding of a * b + c (Boldo and Melquiond), where plain float64 rounding could round twice."""
    p, c = a.double() * b.double(), c.double()
    s = p + c
    bv = s - p
    err = (p - (s - bv)) + (c - bv)
    step = (err != 0) & ((s.view(torch.int64) & 1) == 0)
    toward = torch.where(err > 0, torch.tensor(float("inf"), dtype=torch.float64), torch.tensor(float("-inf"), dtype=torch.float64))
    return torch.where(step, torch.nextafter(s, toward), s).float()


def quantize_act(x: torch.Tensor):
    """ActBlock per 32 elements: q [n, nb, 32] (float64, integers), d [n, nb], sd [n, nb]."""
    xb = x.view(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1)
    inv = torch.where(amax != 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv[..., None]).clamp(-127, 127)  # torch.round: half to even, as nearbyint
    d = amax / 127.0
    return q.double(), d, d * q.sum(-1)


def weight_terms(fmt: str, raw: np.ndarray):
    """Integer weights w [rows, nb, 32] (float64), dw and mw [rows, nb] (float32; mw None without a
    min) and Q2_K's integer mins per half [rows, nb, 2] (float64; else None), read through the gguf
    package: dequantizing with d = 1 and no min gives w exactly."""
    t = Q[fmt]
    block, size = GGML_QUANT_SIZES[t]
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, size)
    d_at, m_at = SCALE_AT[fmt]
    field = lambda at: torch.from_numpy(blocks[:, :, at:at + 2].copy().view(np.float16).astype(np.float32)[..., 0])
    per_32 = lambda v: v.repeat_interleave(block // 32, dim=1)  # a super-block's d serves its 8 blocks

    def deq(d, m=None):
        b = blocks.copy()
        b[:, :, d_at:d_at + 2] = fp16_bytes(np.full(b.shape[:2], d)).reshape(rows, -1, 2)
        if m is not None:
            b[:, :, m_at:m_at + 2] = fp16_bytes(np.full(b.shape[:2], m)).reshape(rows, -1, 2)
        return torch.from_numpy(dequantize(b.reshape(rows, -1), t).reshape(rows, -1, 32).copy())

    w = deq(1.0, 0.0 if m_at is not None else None).double()
    mw = half_mins = None
    if fmt in ("Q4_1", "Q5_1"):
        mw = field(m_at)
    elif fmt == "Q2_K":  # mw = -dmin; m[h] read as -(0 * q - 1 * m[h])
        mw = -per_32(field(m_at))
        half_mins = (0.0 - deq(0.0, 1.0)[..., ::16]).double()
    elif m_at is not None:  # K-quants: mw = -(dmin * m), m read as -(0 * q - 1 * m)
        m = 0.0 - deq(0.0, 1.0)[..., 0]
        mw = -(per_32(field(m_at)) * m)
    return w, per_32(field(d_at)), mw, half_mins


def reference_qgemm(fmt, raw, x, bias=None, residual=None) -> torch.Tensor:
    w, dw, mw, half_mins = weight_terms(fmt, raw)
    q, da, sd = quantize_act(x)
    block_sums = torch.einsum("tbi,rbi->trb", q, w)  # exact: integers far below 2^53
    if half_mins is not None:  # M = sum over halves of m[h] * s16[h], exact
        min_sums = torch.einsum("tbh,rbh->trb", q.view(*q.shape[:2], 2, 16).sum(-1), half_mins)
    acc = torch.zeros(x.shape[0], raw.shape[0])
    for b in range(w.shape[1]):
        acc = fma32(block_sums[:, :, b].float(), dw[None, :, b] * da[:, b, None], acc)
        if half_mins is not None:
            acc = fma32(min_sums[:, :, b].float(), mw[None, :, b] * da[:, b, None], acc)
        elif mw is not None:
            acc = fma32(mw[None, :, b].expand_as(acc), sd[:, b, None].expand_as(acc), acc)
    if bias is not None:
        acc = acc + bias
    if residual is not None:
        acc = acc + residual
    return acc


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


# ---- units ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_units_dequantize_to_gguf_bitwise(fmt):
    raw, units = packed(fmt)
    want = torch.from_numpy(dequantize(raw, Q[fmt]).reshape(ROWS, COLS).copy())
    assert torch.equal(bits(ext.dequantize_units(int(Q[fmt]), units, ROWS, COLS)), bits(want))
    ids = torch.tensor([39, 0, 17, 17, 5])
    assert torch.equal(bits(ext.dequantize_rows(int(Q[fmt]), units, COLS, ids)), bits(want[ids]))


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1"])
def test_quantize_weight_equals_gguf_package(fmt):
    """ggml's reference rounding, as the gguf package has it, bit for bit: on normal weights of
    magnitudes from 1e-9 (subnormal fp16 scales) to 1e7 (scales past fp16's range, to inf), on zero
    and constant rows, and on blocks whose minimum (Q4_1's fp16 m) is a tie of the fp16 rounding."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    w *= np.logspace(-9, 7, 64, dtype=np.float32)[:, None]
    w[0], w[1] = 0.0, 0.25
    ties = np.float32([1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11), 2**-25, 3 * 2**-25, 2**-14 - 2**-25, 65519, 65520])
    w[2:10] = ties[:, None] + np.abs(w[2:10])
    w[2:10, ::32] = ties[:, None]
    with np.errstate(over="ignore"):
        want = quantize(w, Q[fmt])
    got = ext.quantize_weight(int(Q[fmt]), torch.from_numpy(w))
    assert np.array_equal(got.numpy(), want)


# ---- products ------------------------------------------------------------------------------------


def test_activation_blocks_are_the_same_bytes_at_every_level():
    """A row's blocks are quantized 16 at a time where it has 16 (their maxima as one vector) and
    one by one after: rows of 1 to 49 blocks, zero blocks among others, tiny and large values,
    give the generic level's bytes (q, d, sd, the half sums) at every level."""
    g = torch.Generator().manual_seed(7)
    for blocks in (1, 15, 16, 17, 33, 48, 49):
        x = torch.randn(5, 32 * blocks, generator=g) * torch.exp2(torch.randint(-20, 20, (5, 1), generator=g).float())
        x[1, 32 * (blocks // 2):32 * (blocks // 2 + 1)] = 0.0  # a zero block inside a batch of 16
        x[2] = 0.0
        x[3, ::7] = 1e-40  # subnormals
        want = ext.quantize_act(LEVELS[0], x)
        for level in LEVELS[1:]:
            assert torch.equal(ext.quantize_act(level, x), want), f"level {level}, {blocks} blocks"


@pytest.mark.parametrize("fmt", FORMATS)
def test_qgemm_equals_reference_arithmetic_bitwise(fmt):
    raw, units = packed(fmt)
    torch.manual_seed(0)
    x = torch.randn(9, COLS)
    x[1] = 0.0
    x[2] = 3.0  # every activation at 127: with the extreme last rows, the largest block sums
    bias, residual = torch.randn(ROWS), torch.randn(9, ROWS)
    want = reference_qgemm(fmt, raw, x)
    want_br = reference_qgemm(fmt, raw, x, bias, residual)
    for level in LEVELS:
        got = ext.qgemm(level, int(Q[fmt]), units, ROWS, x)
        assert torch.equal(bits(got), bits(want)), f"level {level}"
        got = ext.qgemm(level, int(Q[fmt]), units, ROWS, x, bias, residual)
        assert torch.equal(bits(got), bits(want_br)), f"level {level} with bias and residual"
        # decode-sized calls (AVX2 takes both of a unit's row sets per block: up to 2 rows, up
        # to 5 for signed weights) and verification-sized ones (AVX2's tiles of 5 and 6 rows)
        for n in (1, 2, 3, 4, 5, 6):
            got = ext.qgemm(level, int(Q[fmt]), units, ROWS, x[:n].contiguous(), bias, residual[:n].contiguous())
            assert torch.equal(bits(got), bits(want_br[:n])), f"level {level}, {n} rows, with bias and residual"


@pytest.mark.parametrize("fmt", FORMATS)
def test_levels_bit_identical_and_batch_invariant(fmt):
    """Each activation row alone gives, bit for bit, what it gives inside calls of 2..17, 20 and 24
    rows with other partners (each level tiles rows differently: 4 or 6 (AVX2), 12 or 32 at a
    time; AMX 16, a last tile of 4..15, and fewer through VNNI), at every level."""
    _, units = packed(fmt, seed=2)
    torch.manual_seed(1)
    pool = torch.randn(24, COLS)
    gen = torch.Generator().manual_seed(2)
    alone = None
    for level in LEVELS:
        rows_alone = torch.cat([ext.qgemm(level, int(Q[fmt]), units, ROWS, pool[i:i + 1]) for i in range(len(pool))])
        if alone is None:
            alone = rows_alone
        assert torch.equal(bits(rows_alone), bits(alone)), f"level {level} differs from level {LEVELS[0]}"
        for size in (*range(2, 18), 20, 24):
            idx = torch.randperm(len(pool), generator=gen)[:size]
            got = ext.qgemm(level, int(Q[fmt]), units, ROWS, pool[idx])
            assert torch.equal(bits(got), bits(alone[idx])), f"level {level}, {size} rows"


@pytest.mark.parametrize("fmt", FORMATS)
def test_odd_shapes_equal_reference_at_every_level(fmt):
    """Weights of 1, 17 and 33 rows (one unit row mostly padding; padded rows never reach the
    output) and of one block or an odd number of blocks (super-blocks for K-quants), against
    qgemm.h's arithmetic, bit for bit, at every level and for 1, 3 and 13 activation rows."""
    per = GGML_QUANT_SIZES[Q[fmt]][0]
    for rows, cols in ((1, per), (17, 3 * per), (33, 5 * per)):
        raw = random_raw(fmt, rows, cols, seed=rows)
        units = ext.repack(int(Q[fmt]), torch.from_numpy(raw), cols)
        torch.manual_seed(rows)
        for n in (1, 3, 13):
            x = torch.randn(n, cols)
            want = reference_qgemm(fmt, raw, x)
            for level in LEVELS:
                got = ext.qgemm(level, int(Q[fmt]), units, rows, x)
                assert torch.equal(bits(got), bits(want)), f"{rows}x{cols}, {n} rows, level {level}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_qgemm_within_activation_quantization_error(fmt):
    """Against float64 x @ W.T on the dequantized weight. Activations are rounded to int8 per
    32-element block, each off by at most half a step (amax / 127 / 2), so an output is off by at
    most sum over blocks of amax / 254 * sum |w|; the float32 accumulation adds a few ulps of
    sum |w x| (1e-5 of it allowed) and leaves the bound otherwise tight."""
    raw, units = packed(fmt, seed=3)
    w = torch.from_numpy(dequantize(raw, Q[fmt]).reshape(ROWS, COLS).copy()).double()
    torch.manual_seed(3)
    x = torch.randn(5, COLS) * torch.logspace(-3, 3, 5)[:, None]
    want = x.double() @ w.T
    amax = x.double().view(5, -1, 32).abs().amax(-1)
    bound = amax @ w.abs().view(ROWS, -1, 32).sum(-1).T / 254 + 1e-5 * (x.double().abs() @ w.abs().T)
    got = ext.qgemm(LEVELS[-1], int(Q[fmt]), units, ROWS, x).double()
    assert ((got - want).abs() <= bound).all()
    assert ((got - want).abs() > bound / 50).any()  # the bound is the activation error's, not slack


def test_bad_inputs_are_refused_with_clear_messages():
    raw, units = packed("Q4_K")
    q4k = int(Q.Q4_K)
    with pytest.raises(RuntimeError, match=r"Q4_K columns \(288\) must be a multiple of 256"):
        ext.repack(q4k, torch.zeros(16, 162, dtype=torch.uint8), 288)
    with pytest.raises(RuntimeError, match="raw rows hold 100 bytes, expected 288"):
        ext.repack(q4k, torch.zeros(16, 100, dtype=torch.uint8), COLS)
    with pytest.raises(RuntimeError, match=r"weight format 17 has no kernel; supported GGML types: Q4_0 \(2\)"):
        ext.repack(int(Q.IQ2_XS), torch.zeros(16, 74, dtype=torch.uint8), 256)
    with pytest.raises(RuntimeError, match="units were packed for another format than Q6_K"):
        ext.qgemm(0, int(Q.Q6_K), units, ROWS, torch.randn(1, COLS))
    with pytest.raises(RuntimeError, match="units hold a weight of 512 columns, not 256"):
        ext.qgemm(0, q4k, units, ROWS, torch.randn(1, 256))
    with pytest.raises(RuntimeError, match="units hold at most 48 rows, asked for 49"):
        ext.dequantize_units(q4k, units, 49, COLS)
    with pytest.raises(RuntimeError, match=r"row id 48 is outside the packed rows \[0, 48\)"):
        ext.dequantize_rows(q4k, units, COLS, torch.tensor([3, 48]))
    with pytest.raises(RuntimeError, match="quantize_weight makes Q8_0 or Q4_1 blocks, not Q4_K"):
        ext.quantize_weight(q4k, torch.randn(4, 256))
    with pytest.raises(RuntimeError, match=r"weight columns \(40\) must be a multiple of 32"):
        ext.quantize_weight(int(Q.Q8_0), torch.randn(4, 40))
    with pytest.raises(RuntimeError, match=r"bias must be float32 \[rows\]"):
        ext.qgemm(0, q4k, units, ROWS, torch.randn(1, COLS), torch.randn(ROWS + 1))
