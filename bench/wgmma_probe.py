"""Hopper's warpgroup MMA from numba, checked: ``wgmma.mma_async`` m64n32k16 (A from registers, B
from shared memory through a matrix descriptor, 128-byte swizzle, K-major) against NumPy and,
bitwise, against a chain of ``mma.sync`` m16n8k16 over the same k-steps (sm_90 only).

    python3 bench/wgmma_probe.py [--seeds 3]

The building block of a union-scored attention design (docs/kernels/grouped.md, "The next step
(after session 25)"): S = Q K^T of a stage's union tokens for every row of a window in one
instruction stream, B (the stage's K rows) read by the tensor cores from the ring, not through
``ldmatrix``. Prints, per seed, the largest error against float64 and whether the bits equal the
``mma.sync`` chain's; on a layout mismatch, where each output value was found instead.
"""
import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from llvmlite import ir                                             # noqa: E402
from numba import cuda, float32, uint32, uint64                     # noqa: E402
from numba.cuda import types                                        # noqa: E402
from numba.cuda.extending import intrinsic                          # noqa: E402

from numqsa.kernels.mma import mma_m16n8k16_bf16, mma_m16n8k16_f16  # noqa: E402
from numqsa.kernels.smem import shared_base                        # noqa: E402

M, N, K = 64, 32, 64           # one warpgroup's tile; K = 4 k-steps of 16 (one 128-byte atom)
STEPS = K // 16


def _wgmma_text(ab, steps):
    acc = ",".join(f"${i}" for i in range(16))
    na = 32 + 4 * steps
    lines = ["{", ".reg .pred p;", f"setp.ne.b32 p, ${na + steps}, 0;", "wgmma.fence.sync.aligned;"]
    for s in range(steps):
        a = ",".join(f"${32 + 4 * s + j}" for j in range(4))
        scale = "p" if s == 0 else "1"
        lines.append(f"wgmma.mma_async.sync.aligned.m64n32k16.f32.{ab}.{ab} {{{acc}}}, {{{a}}}, "
                     f"${na + s}, {scale}, 1, 1, 0;")
    lines += ["wgmma.commit_group.sync.aligned;", "wgmma.wait_group.sync.aligned 0;", "}"]
    return "\n".join(lines)


def make_wgmma_chain(ab):
    """``chain(acc, a, desc, accumulate)``: D (16 float32 a thread) = the sum over the k-steps, in
    order, of A_s B_s (+ acc when ``accumulate``): ``a`` UniTuple(uint32, 4 * steps) (4 registers a
    k-step, mma.m16n8k16's A layout on the warp's 16 rows), ``desc`` UniTuple(uint64, steps)."""
    @intrinsic
    def wgmma_chain(typingctx, acc, a, desc, accumulate):
        sig = types.UniTuple(types.float32, 16)(acc, a, desc, accumulate)
        steps = len(desc)

        def codegen(context, builder, sig, args):
            f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
            ops = [builder.extract_value(args[0], i) for i in range(16)]
            ops += [builder.extract_value(args[1], i) for i in range(4 * steps)]
            ops += [builder.extract_value(args[2], i) for i in range(steps)]
            ops += [context.cast(builder, args[3], sig.args[3], types.uint32)]
            fnty = ir.FunctionType(ir.LiteralStructType([f32] * 16),
                                   [f32] * 16 + [i32] * (4 * steps) + [i64] * steps + [i32])
            cons = ",".join(["=f"] * 16 + [str(i) for i in range(16)] + ["r"] * (4 * steps)
                            + ["l"] * steps + ["r"] + ["~{memory}"])
            res = builder.call(ir.InlineAsm(fnty, _wgmma_text(ab, steps), cons, side_effect=True),
                               ops)
            return context.make_tuple(builder, sig.return_type,
                                      [builder.extract_value(res, i) for i in range(16)])
        return sig, codegen
    return wgmma_chain


def swizzled_byte(n, k):
    """Byte offset of B element (token n, dim k) in the 128-byte-swizzled K-major tile: 8-row atoms
    of 1024 bytes, a row's 16-byte chunk c at c ^ (n % 8)."""
    c = (2 * k) // 16
    return (n // 8) * 1024 + (n % 8) * 128 + ((c ^ (n % 8)) * 16) + (2 * k) % 16


@cuda.jit(device=True)
def descriptor(addr):
    """sm_90 shared-memory matrix descriptor: start address, leading byte offset 16 (unused by a
    swizzled K-major tile), stride byte offset 1024 (the next 8-row atom), all >> 4; 128-byte
    swizzle (mode 1 in bits 62-63)."""
    return (uint64((addr & uint32(0x3FFFF)) >> uint32(4))
            | (uint64(1) << uint64(16)) | (uint64(64) << uint64(32)) | (uint64(1) << uint64(62)))


swizzled_byte_dev = cuda.jit(device=True)(swizzled_byte)    # the same layout, in the kernel


def make_probe(ab):
    chain = make_wgmma_chain(ab)
    mma = mma_m16n8k16_bf16 if ab == "bf16" else mma_m16n8k16_f16

    @cuda.jit
    def probe(qw, kw_sw, out_wg, out_mma, out_eo):
        """qw: Q as [M, K/2] uint32 words; kw_sw: K's words already in the swizzled layout [N*K/2]."""
        buf = cuda.shared.array(2048 + 256, uint32)      # 8 KB + room to align to 1024 bytes
        scr = cuda.shared.array((4, 1), uint32)
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        g = lane >> 2
        t = lane & 3
        base = shared_base(buf)
        aligned = (base + uint32(1023)) & uint32(0xFFFFFC00)
        w0 = (aligned - base) >> uint32(2)
        for i in range(tid, N * K // 2, 128):
            buf[w0 + i] = kw_sw[i]
        cuda.syncthreads()
        r0 = 16 * warp + g
        a = cuda.local.array(16, uint32)
        for s in range(STEPS):
            a[4 * s + 0] = qw[r0, 8 * s + t]
            a[4 * s + 1] = qw[r0 + 8, 8 * s + t]
            a[4 * s + 2] = qw[r0, 8 * s + 4 + t]
            a[4 * s + 3] = qw[r0 + 8, 8 * s + 4 + t]
        at = (a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13],
              a[14], a[15])
        dt = (descriptor(aligned), descriptor(aligned + uint32(32)), descriptor(aligned + uint32(64)),
              descriptor(aligned + uint32(96)))
        z = float32(0)
        zz = (z, z, z, z, z, z, z, z, z, z, z, z, z, z, z, z)
        d = chain(zz, at, dt, uint32(0))
        for i in range(16):
            out_wg[tid, i] = d[i]
        # two chains, the even and the odd k-steps, summed (the grouped kernel's S^T)
        de = chain(zz, (a[0], a[1], a[2], a[3], a[8], a[9], a[10], a[11]), (dt[0], dt[2]),
                   uint32(0))
        do = chain(zz, (a[4], a[5], a[6], a[7], a[12], a[13], a[14], a[15]), (dt[1], dt[3]),
                   uint32(0))
        for i in range(16):
            out_eo[tid, i] = de[i] + do[i]
        # the same products as mma.sync m16n8k16, a n8 block at a time: one chain over the k-steps
        # in order (columns 0-15 of out_mma), and the even and odd chains summed (16-31)
        for nb in range(N // 8):
            c = (z, z, z, z)
            ce = (z, z, z, z)
            co = (z, z, z, z)
            for s in range(STEPS):
                n = 8 * nb + g
                b0 = buf[w0 + (swizzled_byte_dev(n, 16 * s + 2 * t) >> 2)]
                b1 = buf[w0 + (swizzled_byte_dev(n, 16 * s + 8 + 2 * t) >> 2)]
                c = mma((a[4 * s], a[4 * s + 1], a[4 * s + 2], a[4 * s + 3]), (b0, b1), c,
                        scr[warp], lane)
                if s % 2 == 0:
                    ce = mma((a[4 * s], a[4 * s + 1], a[4 * s + 2], a[4 * s + 3]), (b0, b1), ce,
                             scr[warp], lane)
                else:
                    co = mma((a[4 * s], a[4 * s + 1], a[4 * s + 2], a[4 * s + 3]), (b0, b1), co,
                             scr[warp], lane)
            for j in range(4):
                out_mma[tid, 4 * nb + j] = c[j]
                out_mma[tid, 16 + 4 * nb + j] = ce[j] + co[j]

    return probe


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    import ml_dtypes
    for ab, dt in (("f16", np.float16), ("bf16", ml_dtypes.bfloat16)):
        probe = make_probe(ab)
        for seed in range(args.seeds):
            run_case(probe, ab, dt, seed)


def run_case(probe, ab, dt, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((M, K)).astype(dt)
    k = rng.standard_normal((N, K)).astype(dt)
    sw = np.zeros(N * K, dt)
    for n in range(N):
        for kk in range(K):
            sw[swizzled_byte(n, kk) // 2] = k[n, kk]
    out_wg = cuda.device_array((128, 16), np.float32)
    out_mma = cuda.device_array((128, 32), np.float32)
    out_eo = cuda.device_array((128, 16), np.float32)
    probe[1, 128](cuda.to_device(q.view(np.uint32)), cuda.to_device(sw.view(np.uint32)),
                  out_wg, out_mma, out_eo)
    wg, mm2, eo = out_wg.copy_to_host(), out_mma.copy_to_host(), out_eo.copy_to_host()
    mm, mmeo = np.ascontiguousarray(mm2[:, :16]), np.ascontiguousarray(mm2[:, 16:])
    ref = q.astype(np.float64) @ k.astype(np.float64).T
    got = np.zeros((M, N))
    for tid in range(128):
        w, lane = divmod(tid, 32)
        g, t = lane >> 2, lane & 3
        for i in range(16):
            nb, j = divmod(i, 4)
            got[16 * w + g + 8 * (j >> 1), 8 * nb + 2 * t + (j & 1)] = wg[tid, i]
    err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
    same = bool(np.array_equal(wg.view(np.uint32), mm.view(np.uint32)))
    same_eo = bool(np.array_equal(eo.view(np.uint32), mmeo.view(np.uint32)))
    print(f"{ab} seed {seed}: wgmma vs float64 max rel err {err:.2e}; bitwise equal to the "
          f"mma.sync chain: {same} ({int(np.sum(wg.view(np.uint32) != mm.view(np.uint32)))} "
          f"of {wg.size} differ); even + odd chains: {same_eo}", flush=True)
    if err > 1e-2:
        flat = ref.ravel()
        for tid in (0, 1, 4, 32):
            pos = [divmod(int(np.argmin(np.abs(flat - v))), N) for v in wg[tid]]
            print(f"  thread {tid}: values found at {pos}")


if __name__ == "__main__":
    main()
