"""Pre-indexer (spec §3): compressed index keys into the paged index cache, and index queries.

Both kernels run the same per-vector pipeline on a block: load into shared float32, Gemma RMSNorm
``x / sqrt(mean(x^2) + eps) * (1 + w)`` (tree-reduced sum of squares: deterministic), then NeoX RoPE
of the first ``rot`` dims. Angles are formed and reduced in float64 (``pos * theta^(-2j/rot)``
reaches 1e6 rad at 1M tokens, where a float32 angle would be off by ~0.06 rad); everything else is
float32.
"""
import functools
import math

from numba import cuda, float32, float64, int32, uint32
from numba.cuda.types import float16

from ..jit import SIMULATOR, device_jit, jit
from .common import row_state


def pre_threads(di):
    """Threads per vector: one per dim up to 128 on a GPU; 16 in the simulator."""
    t = 16 if SIMULATOR else 128
    while t > 1 and t // 2 >= di:
        t //= 2
    return t


@functools.lru_cache(maxsize=None)
def _make_norm_rope(threads, di, rot):
    """Device fn ``norm_rope(x_s, red_s, tid, w, eps, pos, theta)``: in place on shared ``x_s [Di]``."""
    NT, DI, HALF = threads, di, rot // 2

    @device_jit
    def norm_rope(x_s, red_s, tid, w, eps, pos, theta):
        ss = float32(0.0)
        for d in range(tid, uint32(DI), uint32(NT)):
            v = x_s[d]
            ss += v * v
        red_s[tid] = ss
        cuda.syncthreads()
        half = uint32(NT) // uint32(2)
        while half > uint32(0):
            if tid < half:
                red_s[tid] = red_s[tid] + red_s[tid + half]
            cuda.syncthreads()
            half //= uint32(2)
        inv = float32(1.0) / math.sqrt(red_s[0] / float32(DI) + float32(eps))
        cuda.syncthreads()
        for d in range(tid, uint32(DI), uint32(NT)):
            x_s[d] = x_s[d] * inv * (float32(1.0) + float32(w[d]))
        cuda.syncthreads()
        for j in range(tid, uint32(HALF), uint32(NT)):
            ang = float64(pos) * math.pow(float64(theta), float64(-2.0) * float64(j) / float64(2 * HALF))
            c = float32(math.cos(ang))
            s = float32(math.sin(ang))
            x1 = x_s[j]
            x2 = x_s[j + uint32(HALF)]
            x_s[j] = x1 * c - x2 * s
            x_s[j + uint32(HALF)] = x2 * c + x1 * s
        cuda.syncthreads()
    return norm_rope


@functools.lru_cache(maxsize=None)
def make_index_keys_kernel(threads, r, di, rot, emulate_f16):
    """Compressed keys: one block of ``threads`` threads per complete group (grid ``G``).

    Thread ``t`` pools dims ``t, t + threads, ...`` over the group's ``r`` raw keys in float32
    (optionally rounding the mean to float16, ``emulate_dtype``), then the block normalises and
    rotates at ``r * group_id`` (or ``rope_pos[g]`` when ``has_rope_pos``). Writes the float32 key to
    ``kc [G, Di]`` and, when the destination page is valid, the cache-dtype key to
    ``index_cache[index_block_table[q, e // R], e % R]``. Shared memory: ``4*Di + 4*threads`` bytes.
    """
    NT, R, DI = threads, r, di
    norm_rope = _make_norm_rope(threads, di, rot)

    @jit
    def index_keys(k_raw, w_k, group_req_ids, group_ids, rope_pos, has_rope_pos, eps, theta,
                   index_cache, index_block_table, kc):
        x_s = cuda.shared.array(DI, float32)
        red_s = cuda.shared.array(NT, float32)
        tid = uint32(cuda.threadIdx.x)
        g = uint32(cuda.blockIdx.x)
        for d in range(tid, uint32(DI), uint32(NT)):
            s = float32(0.0)
            for j in range(R):
                s += float32(k_raw[g, j, d])
            m = s / float32(R)
            if emulate_f16:
                m = float32(float16(m))
            x_s[d] = m
        cuda.syncthreads()
        e = int32(group_ids[g])
        pos = int32(R) * e
        if has_rope_pos:
            pos = int32(rope_pos[g])
        norm_rope(x_s, red_s, tid, w_k, eps, pos, theta)
        q = int32(group_req_ids[g])
        page = int32(-1)
        row = int32(0)
        rpp = int32(index_cache.shape[1])
        if q >= int32(0) and q < int32(index_block_table.shape[0]) and e >= int32(0):
            col = e // rpp
            row = e - col * rpp
            if col < int32(index_block_table.shape[1]):
                page = int32(index_block_table[q, col])
        ok = page >= int32(0) and page < int32(index_cache.shape[0])
        for d in range(tid, uint32(DI), uint32(NT)):
            y = x_s[d]
            kc[g, d] = y
            if ok:
                index_cache[page, row, d] = y

    index_keys.threads = NT
    return index_keys


@functools.lru_cache(maxsize=None)
def make_index_queries_kernel(threads, di, rot):
    """Index queries: one block per (row, head), grid ``(rows, Hi)``; norm then RoPE at the row's
    clamped position (or ``rope_pos[i]``); inert rows write zeros. Shared memory ``4*Di + 4*threads``."""
    NT, DI = threads, di
    norm_rope = _make_norm_rope(threads, di, rot)

    @jit
    def index_queries(q_raw, w_q, req_ids, positions, seq_lens, rope_pos, has_rope_pos, eps, theta,
                      qi):
        x_s = cuda.shared.array(DI, float32)
        red_s = cuda.shared.array(NT, float32)
        tid = uint32(cuda.threadIdx.x)
        i = uint32(cuda.blockIdx.x)
        h = uint32(cuda.blockIdx.y)
        req, p, nb = row_state(i, req_ids, positions, seq_lens, 1)
        # uniform per block: an inert row skips the norm (and its barriers) entirely
        if req < int32(0):
            for d in range(tid, uint32(DI), uint32(NT)):
                qi[i, h, d] = 0
            return
        for d in range(tid, uint32(DI), uint32(NT)):
            x_s[d] = float32(q_raw[i, h, d])
        cuda.syncthreads()
        pos = p
        if has_rope_pos:
            pos = int32(rope_pos[i])
        norm_rope(x_s, red_s, tid, w_q, eps, pos, theta)
        for d in range(tid, uint32(DI), uint32(NT)):
            qi[i, h, d] = x_s[d]

    index_queries.threads = NT
    return index_queries


def launch_index_keys(k_raw, w_k, group_req_ids, group_ids, rope_pos, has_rope_pos, index_cache,
                      index_block_table, kc, stream, *, eps, rot, theta, emulate_f16=False):
    G, r, di = k_raw.shape
    if G == 0:
        return kc
    k = make_index_keys_kernel(pre_threads(di), int(r), int(di), int(rot), bool(emulate_f16))
    k[G, k.threads, stream](k_raw, w_k, group_req_ids, group_ids, rope_pos, bool(has_rope_pos),
                            float(eps), float(theta), index_cache, index_block_table, kc)
    return kc


def launch_index_queries(q_raw, w_q, req_ids, positions, seq_lens, rope_pos, has_rope_pos, qi,
                         stream, *, eps, rot, theta):
    rows, hi, di = q_raw.shape
    if rows == 0 or hi == 0:
        return qi
    k = make_index_queries_kernel(pre_threads(di), int(di), int(rot))
    k[(rows, hi), k.threads, stream](q_raw, w_q, req_ids, positions, seq_lens, rope_pos,
                                     bool(has_rope_pos), float(eps), float(theta), qi)
    return qi


RESOURCE_CASES = []
for _dt in ("float16", "float32"):
    for _cc in ((7, 0), (9, 0)):
        RESOURCE_CASES.append((
            f"index_keys.{_dt}", make_index_keys_kernel(128, 4, 128, 64, _dt == "float16"),
            f"void({_dt}[:, :, :], {_dt}[:], int32[:], int32[:], int32[:], boolean, float64, float64, "
            f"{_dt}[:, :, :], int32[:, :], float32[:, :])", 128, 0, _cc))
        RESOURCE_CASES.append((
            f"index_queries.{_dt}", make_index_queries_kernel(128, 128, 64),
            f"void({_dt}[:, :, :], {_dt}[:], int32[:], int32[:], int32[:], int32[:], boolean, "
            f"float64, float64, {_dt}[:, :, :])", 128, 0, _cc))
