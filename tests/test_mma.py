"""Tensor-core primitives (numqsa/kernels/mma.py): fragment layouts, packing, the mma stand-ins.

The same bodies run in the simulator (CI, tiny sizes) and on a GPU, where they check our reading of
the PTX fragment tables against the hardware. Small-integer inputs make every product and partial
sum exact in float32, so those cases compare bit for bit; random-normal cases go through the
comparator. The ``gpu`` tier runs the demo GEMM at real sizes.
"""
import functools

import numpy as np
import pytest
from numba import cuda, float32, uint32

from numqsa.jit import SIMULATOR, jit
from numqsa.kernels import mma
from numqsa.kernels.mma import SCRATCH_WORDS   # a plain global: shared.array needs a constant
from numqsa.testing import assert_matches_oracle, float32_sum_tolerance, matmul_accumulating_in


def _round_bf16(x):
    """float32 -> nearest-even bfloat16, returned as float32 (NumPy has no bfloat16)."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _launch(kernel, blocks, threads, *args):
    dev = [cuda.to_device(a) for a in args]
    kernel[blocks, threads](*dev)
    return [d.copy_to_host() for d in dev]


# ---------------------------------------------------------------- single tiles through *_pos helpers

@functools.lru_cache(maxsize=None)
def _word_gatherers(bf16):
    """Device functions building one A / B register of tile t from m16n8k16_a_pos / _b_pos."""
    pack = mma.pack_bf16x2 if bf16 else mma.pack_f16x2

    @jit(device=True)
    def a_word(a, t, lane, j):
        r0, k0 = mma.m16n8k16_a_pos(lane, j, 0)
        r1, k1 = mma.m16n8k16_a_pos(lane, j, 1)
        return pack(a[t, r0, k0], a[t, r1, k1])

    @jit(device=True)
    def b_word(b, t, n0, lane, j):
        k0, n = mma.m16n8k16_b_pos(lane, j, 0)
        k1, n1 = mma.m16n8k16_b_pos(lane, j, 1)
        return pack(b[t, k0, n0 + n], b[t, k1, n0 + n1])
    return a_word, b_word


@functools.lru_cache(maxsize=None)
def _tile16816_kernel(warps, bf16):
    """d[t] = a[t] @ b[t] + c[t] for 16x16 @ 16x8 tiles, one tile per warp; fragments gathered with
    m16n8k16_a_pos / _b_pos and stored with _c_pos, so the helpers are checked against the mma."""
    op = mma.mma_m16n8k16_bf16 if bf16 else mma.mma_m16n8k16_f16
    a_word, b_word_n = _word_gatherers(bf16)

    @jit(device=True)
    def b_word(b, t, lane, j):
        return b_word_n(b, t, uint32(0), lane, j)

    def kernel(a, b, c, d):
        scr = cuda.shared.array((warps, SCRATCH_WORDS), uint32)
        tid = uint32(cuda.threadIdx.x)
        warp = tid >> uint32(5)
        lane = tid & uint32(31)
        t = uint32(cuda.blockIdx.x) * uint32(warps) + warp
        live = t < uint32(a.shape[0])
        tt = t if live else uint32(0)   # idle warps still reach the mma (simulator contract)
        fa = (a_word(a, tt, lane, 0), a_word(a, tt, lane, 1),
              a_word(a, tt, lane, 2), a_word(a, tt, lane, 3))
        fb = (b_word(b, tt, lane, 0), b_word(b, tt, lane, 1))
        r0, c0 = mma.m16n8k16_c_pos(lane, 0)
        r1, c1 = mma.m16n8k16_c_pos(lane, 1)
        r2, c2 = mma.m16n8k16_c_pos(lane, 2)
        r3, c3 = mma.m16n8k16_c_pos(lane, 3)
        acc = (c[tt, r0, c0], c[tt, r1, c1], c[tt, r2, c2], c[tt, r3, c3])
        out = op(fa, fb, acc, scr[warp], lane)
        if live:
            d[t, r0, c0] = out[0]
            d[t, r1, c1] = out[1]
            d[t, r2, c2] = out[2]
            d[t, r3, c3] = out[3]
    return jit(kernel)


@functools.lru_cache(maxsize=None)
def _chain16816_kernel(warps, bf16):
    """s[t] = a[t] @ b[t] (two n8 tiles, stored with store_c_m16n8k16), then
    o[t] = s[t] @ v[t] with s taken from the accumulators by c_pair_to_a_*: the flash-attention
    P @ V step, all in registers."""
    op = mma.mma_m16n8k16_bf16 if bf16 else mma.mma_m16n8k16_f16
    to_a = mma.c_pair_to_a_bf16 if bf16 else mma.c_pair_to_a_f16
    a_word, b_word = _word_gatherers(bf16)

    def kernel(a, b, v, s, o):
        scr = cuda.shared.array((warps, SCRATCH_WORDS), uint32)
        tid = uint32(cuda.threadIdx.x)
        warp = tid >> uint32(5)
        lane = tid & uint32(31)
        t = uint32(cuda.blockIdx.x) * uint32(warps) + warp
        live = t < uint32(a.shape[0])
        tt = t if live else uint32(0)
        z = float32(0)
        fa = (a_word(a, tt, lane, 0), a_word(a, tt, lane, 1),
              a_word(a, tt, lane, 2), a_word(a, tt, lane, 3))
        s0 = op(fa, (b_word(b, tt, uint32(0), lane, 0), b_word(b, tt, uint32(0), lane, 1)),
                (z, z, z, z), scr[warp], lane)
        s1 = op(fa, (b_word(b, tt, uint32(8), lane, 0), b_word(b, tt, uint32(8), lane, 1)),
                (z, z, z, z), scr[warp], lane)
        out = op(to_a(s0, s1), (b_word(v, tt, uint32(0), lane, 0),
                                b_word(v, tt, uint32(0), lane, 1)),
                 (z, z, z, z), scr[warp], lane)
        if live:
            mma.store_c_m16n8k16(s[t], uint32(0), uint32(0), s0, lane)
            mma.store_c_m16n8k16(s[t], uint32(0), uint32(8), s1, lane)
            mma.store_c_m16n8k16(o[t], uint32(0), uint32(0), out, lane)
    return jit(kernel)


@functools.lru_cache(maxsize=None)
def _tile884_kernel(warps):
    """d[t, q] = a[t, q] @ b[t, q] + c[t, q]: the four 8x8x4 products of quad-pairs q = 0..3."""
    @jit(device=True)
    def word(x, t, q, lane, j, is_a):
        if is_a:
            r0, k0 = mma.m8n8k4_a_pos(lane, j, 0)
            r1, k1 = mma.m8n8k4_a_pos(lane, j, 1)
            return mma.pack_f16x2(x[t, q, r0, k0], x[t, q, r1, k1])
        k0, n0 = mma.m8n8k4_b_pos(lane, j, 0)
        k1, n1 = mma.m8n8k4_b_pos(lane, j, 1)
        return mma.pack_f16x2(x[t, q, k0, n0], x[t, q, k1, n1])

    def kernel(a, b, c, d, d2):
        scr = cuda.shared.array((warps, SCRATCH_WORDS), uint32)
        tid = uint32(cuda.threadIdx.x)
        warp = tid >> uint32(5)
        lane = tid & uint32(31)
        q = mma.m8n8k4_quadpair(lane)
        t = uint32(cuda.blockIdx.x) * uint32(warps) + warp
        live = t < uint32(a.shape[0])
        tt = t if live else uint32(0)
        a0 = word(a, tt, q, lane, 0, True)
        a1 = word(a, tt, q, lane, 1, True)
        b0 = word(b, tt, q, lane, 0, False)
        b1 = word(b, tt, q, lane, 1, False)
        acc = cuda.local.array(8, np.float32)
        for i in range(8):
            r, col = mma.m8n8k4_c_pos(lane, i)
            acc[i] = c[tt, q, r, col]
        out = mma.mma_m8n8k4_f16(a0, a1, b0, b1, (acc[0], acc[1], acc[2], acc[3], acc[4],
                                                  acc[5], acc[6], acc[7]), scr[warp], lane)
        if live:
            for i in range(8):
                r, col = mma.m8n8k4_c_pos(lane, i)
                d[t, q, r, col] = out[i]
            mma.store_c_m8n8k4(d2[t, q], uint32(0), uint32(0), out, lane)
    return jit(kernel)


def _small_ints(rng, shape, lo=-4, hi=5):
    return rng.integers(lo, hi, size=shape).astype(np.float32)


@pytest.mark.parametrize("tiles,warps", [(1, 1), (5, 2), (3, 4)])
@pytest.mark.parametrize("bf16", [False, True], ids=["f16", "bf16"])
def test_m16n8k16_tiles_exact(rng, tiles, warps, bf16):
    """Integer tiles: D must equal A @ B + C exactly; several warps (and idle warps) per block."""
    a, b = _small_ints(rng, (tiles, 16, 16)), _small_ints(rng, (tiles, 16, 8))
    c = _small_ints(rng, (tiles, 16, 8), -50, 51)
    d = np.full((tiles, 16, 8), np.nan, np.float32)
    dt = np.float32 if bf16 else np.float16
    blocks = -(-tiles // warps)
    *_, got = _launch(_tile16816_kernel(warps, bf16), blocks, 32 * warps,
                      a.astype(dt), b.astype(dt), c, d)
    want = a.astype(np.float64) @ b.astype(np.float64) + c
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("tiles,warps", [(1, 1), (3, 2)])
@pytest.mark.parametrize("bf16", [False, True], ids=["f16", "bf16"])
def test_m16n8k16_accumulators_feed_next_mma(rng, tiles, warps, bf16):
    """S = A @ B (16x16), then O = S @ V with S moved from accumulators to A registers. Integer
    inputs keep |S| <= 32 (exact in float16 and bfloat16) and O exact in float32."""
    a, b = _small_ints(rng, (tiles, 16, 16), -2, 3), _small_ints(rng, (tiles, 16, 16), -1, 2)
    v = _small_ints(rng, (tiles, 16, 8), -2, 3)
    s = np.full((tiles, 16, 16), np.nan, np.float32)
    o = np.full((tiles, 16, 8), np.nan, np.float32)
    dt = np.float32 if bf16 else np.float16
    *_, got_s, got_o = _launch(_chain16816_kernel(warps, bf16), -(-tiles // warps), 32 * warps,
                               a.astype(dt), b.astype(dt), v.astype(dt), s, o)
    want_s = a.astype(np.float64) @ b
    np.testing.assert_array_equal(got_s, want_s, err_msg="S through store_c_m16n8k16")
    np.testing.assert_array_equal(got_o, want_s @ v, err_msg="O through c_pair_to_a")


@pytest.mark.parametrize("tiles,warps", [(1, 1), (3, 2)])
def test_m8n8k4_tiles_exact(rng, tiles, warps):
    """Integer tiles: each quad-pair's D must equal its A @ B + C exactly."""
    a, b = _small_ints(rng, (tiles, 4, 8, 4)), _small_ints(rng, (tiles, 4, 4, 8))
    c = _small_ints(rng, (tiles, 4, 8, 8), -50, 51)
    d = np.full((tiles, 4, 8, 8), np.nan, np.float32)
    blocks = -(-tiles // warps)
    *_, got, got2 = _launch(_tile884_kernel(warps), blocks, 32 * warps,
                            a.astype(np.float16), b.astype(np.float16), c, d, d.copy())
    want = a.astype(np.float64) @ b.astype(np.float64) + c
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got2, want, err_msg="store_c_m8n8k4")


@jit
def _uneven_warps_kernel(a, bt, d):
    """Warp w accumulates a @ bt.T (w + 1) times: warps of one block run different mma counts."""
    scr = cuda.shared.array((4, SCRATCH_WORDS), uint32)
    tid = uint32(cuda.threadIdx.x)
    warp = tid >> uint32(5)
    lane = tid & uint32(31)
    z = float32(0)
    u0 = uint32(0)
    acc = (z, z, z, z)
    for _ in range(warp + uint32(1)):
        acc = mma.mma_m16n8k16_f16(mma.load_a_m16n8k16(a, u0, u0, lane),
                                   mma.load_bt_m16n8k16(bt, u0, u0, lane), acc, scr[warp], lane)
    mma.store_c_m16n8k16(d[warp], u0, u0, acc, lane)


def test_warps_may_run_different_mma_counts(rng):
    a = _small_ints(rng, (16, 16)).astype(np.float16)
    bt = _small_ints(rng, (8, 16)).astype(np.float16)
    d = np.full((4, 16, 8), np.nan, np.float32)
    *_, got = _launch(_uneven_warps_kernel, 1, 128, a, bt, d)
    prod = a.astype(np.float64) @ bt.astype(np.float64).T
    np.testing.assert_array_equal(got, np.arange(1, 5)[:, None, None] * prod)


# ---------------------------------------------------------------- the load_* helpers

@functools.lru_cache(maxsize=None)
def _loaders_kernel(warps, shape):
    """d1[t] = a[t] @ bt[t].T through the element loaders (load_a_*, load_bt_*) and d2[t] the same
    through the packed-word loaders (*_u32), one 16x8 (m16n8k16) or 16x16 (m8n8k4) tile per warp."""
    def kernel(a16, bt16, a32, bt32, d1, d2):
        scr = cuda.shared.array((warps, SCRATCH_WORDS), uint32)
        tid = uint32(cuda.threadIdx.x)
        warp = tid >> uint32(5)
        lane = tid & uint32(31)
        t = uint32(cuda.blockIdx.x) * uint32(warps) + warp
        live = t < uint32(a16.shape[0])
        tt = t if live else uint32(0)
        z = float32(0)
        u0 = uint32(0)
        if shape == "m16n8k16":
            acc1 = mma.mma_m16n8k16_f16(mma.load_a_m16n8k16(a16[tt], u0, u0, lane),
                                        mma.load_bt_m16n8k16(bt16[tt], u0, u0, lane),
                                        (z, z, z, z), scr[warp], lane)
            acc2 = mma.mma_m16n8k16_f16(mma.load_a_m16n8k16_u32(a32[tt], u0, u0, lane),
                                        mma.load_bt_m16n8k16_u32(bt32[tt], u0, u0, lane),
                                        (z, z, z, z), scr[warp], lane)
            if live:
                mma.store_c_m16n8k16(d1[t], u0, u0, acc1, lane)
                mma.store_c_m16n8k16(d2[t], u0, u0, acc2, lane)
        else:
            q = mma.m8n8k4_quadpair(lane)
            qr = uint32(8) * (q & uint32(1))
            qn = uint32(8) * (q >> uint32(1))
            acc1 = (z, z, z, z, z, z, z, z)
            acc2 = (z, z, z, z, z, z, z, z)
            for kk in range(0, 16, 4):
                a0, a1 = mma.load_a_m8n8k4(a16[tt], qr, kk, lane)
                b0, b1 = mma.load_bt_m8n8k4(bt16[tt], qn, kk, lane)
                acc1 = mma.mma_m8n8k4_f16(a0, a1, b0, b1, acc1, scr[warp], lane)
                a0, a1 = mma.load_a_m8n8k4_u32(a32[tt], qr, kk // 2, lane)
                b0, b1 = mma.load_bt_m8n8k4_u32(bt32[tt], qn, kk // 2, lane)
                acc2 = mma.mma_m8n8k4_f16(a0, a1, b0, b1, acc2, scr[warp], lane)
            if live:
                mma.store_c_m8n8k4(d1[t], qr, qn, acc1, lane)
                mma.store_c_m8n8k4(d2[t], qr, qn, acc2, lane)
    return jit(kernel)


@pytest.mark.parametrize("shape", ["m16n8k16", "m8n8k4"])
def test_loaders_exact(rng, shape):
    tiles, warps = 3, 2
    n = 8 if shape == "m16n8k16" else 16
    a = _small_ints(rng, (tiles, 16, 16)).astype(np.float16)
    bt = _small_ints(rng, (tiles, n, 16)).astype(np.float16)
    d = np.full((tiles, 16, n), np.nan, np.float32)
    *_, d1, d2 = _launch(_loaders_kernel(warps, shape), -(-tiles // warps), 32 * warps,
                         a, bt, a.view(np.uint32), bt.view(np.uint32), d, d.copy())
    want = a.astype(np.float64) @ bt.astype(np.float64).transpose(0, 2, 1)
    np.testing.assert_array_equal(d1, want, err_msg="element loaders")
    np.testing.assert_array_equal(d2, want, err_msg="packed-word loaders")


# ---------------------------------------------------------------- layouts are bijections

@jit
def _positions_kernel(out16816a, out16816b, out16816c, out884a, out884b, out884c):
    lane = uint32(cuda.threadIdx.x)
    for j in range(4):
        for h in range(2):
            r, k = mma.m16n8k16_a_pos(lane, j, h)
            out16816a[lane, j, h, 0] = r
            out16816a[lane, j, h, 1] = k
    for j in range(2):
        for h in range(2):
            k, n = mma.m16n8k16_b_pos(lane, j, h)
            out16816b[lane, j, h, 0] = k
            out16816b[lane, j, h, 1] = n
            r, k2 = mma.m8n8k4_a_pos(lane, j, h)
            out884a[lane, j, h, 0] = r
            out884a[lane, j, h, 1] = k2
            k3, n3 = mma.m8n8k4_b_pos(lane, j, h)
            out884b[lane, j, h, 0] = k3
            out884b[lane, j, h, 1] = n3
    for i in range(4):
        r, col = mma.m16n8k16_c_pos(lane, i)
        out16816c[lane, i, 0] = r
        out16816c[lane, i, 1] = col
    q = mma.m8n8k4_quadpair(lane)
    for i in range(8):
        r, col = mma.m8n8k4_c_pos(lane, i)
        out884c[lane, i, 0] = q
        out884c[lane, i, 1] = r * uint32(8) + col


def test_fragment_layouts_cover_each_element_once():
    shapes = [(32, 4, 2, 2), (32, 2, 2, 2), (32, 4, 2), (32, 2, 2, 2), (32, 2, 2, 2), (32, 8, 2)]
    outs = [np.full(s, -1, np.int32) for s in shapes]
    a16, b16, c16, a4, b4, c4 = _launch(_positions_kernel, 1, 32, *outs)

    def once(pairs, dims):
        flat = np.ravel_multi_index(tuple(pairs.reshape(-1, 2).T), dims)
        assert np.array_equal(np.sort(flat), np.arange(np.prod(dims))), "not a bijection"

    once(a16, (16, 16))
    once(b16, (16, 8))
    once(c16, (16, 8))
    once(c4, (4, 64))   # (quad-pair, 8x8 element) over the warp
    # m8n8k4 A/B: within each quad-pair the 8 lanes hold the 8x4 A / 4x8 B once each.
    q = (np.arange(32) >> 2) & 3
    for qp in range(4):
        once(a4[q == qp], (8, 4))
        once(b4[q == qp][..., ::-1], (8, 4))
    # The register pairs hold consecutive columns / k: the low half first.
    assert np.all(a16[:, :, 1, 1] == a16[:, :, 0, 1] + 1)
    assert np.all(b16[:, :, 1, 0] == b16[:, :, 0, 0] + 1)


# ---------------------------------------------------------------- packing and loads

@jit
def _pack_kernel(x16, y32, w, out_f16, out_f32, out_bf16, out_unpack):
    i = cuda.grid(1)
    if i < out_f16.shape[0]:
        out_f16[i] = mma.pack_f16x2(x16[2 * i], x16[2 * i + 1])
        out_f32[i] = mma.pack_f16x2(y32[2 * i], y32[2 * i + 1])
        out_bf16[i] = mma.pack_bf16x2(y32[2 * i], y32[2 * i + 1])
        lo, hi = mma.unpack_f16x2(w[i])
        out_unpack[2 * i] = lo
        out_unpack[2 * i + 1] = hi


def test_pack_unpack_bits(rng):
    n = 48
    special = np.array([0.0, -0.0, 1.0, -2.5, 65504.0, 70000.0, -1e9, np.inf, -np.inf, 1e-8,
                        6e-8, 3e-5, 1.00048828125, 1.0009765625, 1.0 + 2.0 ** -8, 3.0 + 2.0 ** -7],
                       np.float32)
    y32 = np.concatenate([special, (rng.standard_normal(2 * n - special.size) *
                                    10.0 ** rng.integers(-6, 6, 2 * n - special.size))]).astype(np.float32)
    x16 = rng.standard_normal(2 * n).astype(np.float16)
    w = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
    w[np.isnan(w.view(np.float16).reshape(n, 2)).any(axis=1)] = 0x3C00BC00   # keep NaN bits out
    outs = [np.zeros(n, np.uint32) for _ in range(3)] + [np.zeros(2 * n, np.float16)]
    *_, f16, f32, bf16, unpacked = _launch(_pack_kernel, 2, 32, x16, y32, w, *outs)
    np.testing.assert_array_equal(f16, x16.view(np.uint32))
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(f32, y32.astype(np.float16).view(np.uint32))
    want_bf = _round_bf16(y32).view(np.uint32) >> np.uint32(16)
    np.testing.assert_array_equal(bf16, want_bf[0::2] | (want_bf[1::2] << np.uint32(16)))
    np.testing.assert_array_equal(unpacked.view(np.uint16), w.view(np.uint16))


@jit
def _ld4_kernel(src, dst):
    i = uint32(cuda.grid(1))
    if i < uint32(dst.shape[0]) // uint32(4):
        v = mma.ld_global_nc_v4_u32(src, uint32(4) * i)
        for j in range(4):
            dst[uint32(4) * i + uint32(j)] = v[j]


def test_ld_global_nc_v4(rng):
    src = rng.integers(0, 2 ** 32, 4 * 70, dtype=np.uint64).astype(np.uint32)
    _, dst = _launch(_ld4_kernel, 3, 32, src, np.zeros_like(src))
    np.testing.assert_array_equal(dst, src)


@jit
def _ex2_kernel(x, y):
    i = cuda.grid(1)
    if i < x.shape[0]:
        y[i] = mma.ex2_approx_ftz(x[i])


def test_ex2_approx_ftz(rng):
    """2^x within 2^-21 relative (PTX: 2^-22 for ex2.approx), 0 (not subnormal) below 2^-126 and
    at -inf, inf from 128 on."""
    x = np.concatenate([np.arange(-126, 128), [-126.5, -130.0, -149.0, -1e30, -np.inf, 128.5],
                        rng.uniform(-125.0, 127.0, 400)]).astype(np.float32)
    _, y = _launch(_ex2_kernel, 3, 256, x, np.full_like(x, np.nan))
    want = np.exp2(x.astype(np.float64))
    normal = (want >= 2.0 ** -126) & (want < 2.0 ** 128)
    np.testing.assert_allclose(y[normal], want[normal], rtol=2.0 ** -21, atol=0)
    assert np.all(y[want < 2.0 ** -126] == 0.0)
    assert np.all(np.isposinf(y[want >= 2.0 ** 128]))


@pytest.mark.skipif(not SIMULATOR, reason="the scratch is only used by the simulator stand-ins")
def test_scratch_too_small_is_reported():
    @jit
    def k(out):
        scr = cuda.shared.array(8, uint32)
        lane = uint32(cuda.threadIdx.x)
        z = uint32(0)
        r = mma.mma_m16n8k16_f16((z, z, z, z), (z, z), (out[0], out[0], out[0], out[0]), scr, lane)
        out[lane] = r[0]

    with pytest.raises(Exception, match="SCRATCH_WORDS"):
        k[1, 32](np.zeros(32, np.float32))


# ---------------------------------------------------------------- the demo GEMM

def _gemm_case(rng, kind, m, k, n):
    dt = np.float32 if kind == "m16n8k16_bf16" else np.float16
    a = rng.standard_normal((m, k)).astype(dt)
    b = rng.standard_normal((k, n)).astype(dt)
    if kind == "m16n8k16_bf16":
        a64, b64 = _round_bf16(a).astype(np.float64), _round_bf16(b).astype(np.float64)
    else:
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return a, b, a64 @ b64


# (m, k, n) odd, with K not a multiple of 16 and tiles that leave warps idle.
@pytest.mark.parametrize("kind,m,k,n,warps", [
    ("m16n8k16", 37, 40, 19, 2),
    ("m16n8k16", 16, 16, 8, 1),
    ("m16n8k16_bf16", 17, 33, 9, 3),
    ("m8n8k4", 21, 36, 29, 2),
    ("m8n8k4", 3, 5, 7, 1),
])
def test_demo_gemm(rng, kind, m, k, n, warps):
    _check_gemm(rng, kind, m, k, n, warps)


def _check_gemm(rng, kind, m, k, n, warps):
    """Inputs are exact in the mma's input type, so only float32 accumulation error remains: one
    accumulator update per mma k-step, which the tensor cores may truncate. The same products
    accumulated in float16 must fail that tolerance (the exact integer-tile tests above are the
    sharp check of the layouts)."""
    a, b, want = _gemm_case(rng, kind, m, k, n)
    got = mma.demo_gemm(a, b, kind, warps=warps)
    tol = float32_sum_tolerance(-(-k // (4 if kind == "m8n8k4" else 16)))
    assert_matches_oracle(got, want, dtype=tol, what=f"demo gemm {kind} {m}x{k}x{n}")
    a64, b64 = (x.astype(np.float64) for x in (a, b))
    if kind == "m16n8k16_bf16":
        a64, b64 = _round_bf16(a).astype(np.float64), _round_bf16(b).astype(np.float64)
    rows = slice(0, 16)                   # the emulation materialises [rows, K, N] products
    with pytest.raises(AssertionError):
        assert_matches_oracle(matmul_accumulating_in(a64[rows], b64, np.float16), want[rows],
                              dtype=tol, what="float16 accumulation")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", mma.DEMO_KINDS)
@pytest.mark.parametrize("m,k,n", [(1031, 517, 263), (256, 4096, 128)])
def test_demo_gemm_gpu(rng, kind, m, k, n):
    _check_gemm(rng, kind, m, k, n, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("bf16", [False, True], ids=["f16", "bf16"])
def test_m16n8k16_tiles_exact_gpu(rng, bf16):
    test_m16n8k16_tiles_exact(rng, 1000, 8, bf16)


@pytest.mark.gpu
def test_ex2_approx_ftz_gpu(rng):
    test_ex2_approx_ftz(rng)


@pytest.mark.gpu
def test_m8n8k4_tiles_exact_gpu(rng):
    test_m8n8k4_tiles_exact(rng, 1000, 8)
