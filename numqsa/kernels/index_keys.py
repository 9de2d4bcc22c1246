"""Pre-indexer (spec §3): compressed index keys into the paged index cache, and index queries.

Both kernels run the same per-vector pipeline on a block: load into shared float32, Gemma RMSNorm
``x / sqrt(mean(x^2) + eps) * (1 + w)`` (tree-reduced sum of squares: deterministic), then NeoX RoPE
of the first ``rot`` dims. Angles are formed and reduced in float64 (``pos * theta^(-2j/rot)``
reaches 1e6 rad at 1M tokens, where a float32 angle would be off by ~0.06 rad); everything else is
float32.

bfloat16 (any architecture: integer conversions) arrives as uint16 bit views
(:func:`numqsa.kernels.common.bits16`): read exactly, written rounded to nearest even once, at the
store -- TensorRT-LLM's chain (fp32 norm, one rounding on storage), spec §3. ``emulate`` rounds the
pooled mean to float16 or bfloat16 before the norm, as the references do (the oracle's
``emulate_dtype``).

Both run on every architecture (sm_70 included), once per layer upstream of the wrapper; no route
to choose, and no timing recorded (the benchmark starts from finished index queries and keys:
``docs/kernels/index_keys.md``).
"""
import functools
import math

from numba import cuda, float32, float64, int32, uint32
from numba.cuda.types import float16

from ..jit import SIMULATOR, device_jit, jit
from .common import bf16_to_f32, bits16, f32_to_bf16, is_bf16, loader, row_state, storer


def pre_threads(di):
    """Threads per vector: one per dim up to 128 on a GPU; 16 in the simulator."""
    t = 16 if SIMULATOR else 128
    while t > 1 and t // 2 >= di:
        t //= 2
    return t


@functools.lru_cache(maxsize=None)
def _make_norm_rope(threads, di, rot, w_bf16=False):
    """Device fn ``norm_rope(x_s, red_s, tid, w, eps, pos, theta)``: in place on shared ``x_s [Di]``
    (``w_bf16``: the weight is bfloat16 bits)."""
    NT, DI, HALF = threads, di, rot // 2
    ldw = loader(w_bf16)

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
            x_s[d] = x_s[d] * inv * (float32(1.0) + ldw(w[d]))
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
def make_index_keys_kernel(threads, r, di, rot, emulate, k_bf16=False, w_bf16=False,
                           cache_bf16=False):
    """Compressed keys: one block of ``threads`` threads per complete group (grid ``G``).

    Thread ``t`` pools dims ``t, t + threads, ...`` over the group's ``r`` raw keys in float32
    (optionally rounding the mean to ``emulate``: ``"float16"`` / ``"bfloat16"`` / ``None``,
    the API's ``emulate_dtype``; ``True`` means float16), then the block normalises and
    rotates at ``r * group_id`` (or ``rope_pos[g]`` when ``has_rope_pos``). Writes the float32 key to
    ``kc [G, Di]`` and, when the destination page is valid, the cache-dtype key to
    ``index_cache[index_block_table[q, e // R], e % R]``. Shared memory: ``4*Di + 4*threads`` bytes.
    """
    NT, R, DI = threads, r, di
    norm_rope = _make_norm_rope(threads, di, rot, w_bf16)
    if emulate is True:
        emulate = "float16"
    EM16, EMBF = emulate == "float16", emulate == "bfloat16"
    ldk, stc = loader(k_bf16), storer(cache_bf16)

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
                s += ldk(k_raw[g, j, d])
            m = s / float32(R)
            if EM16:
                m = float32(float16(m))
            if EMBF:
                m = bf16_to_f32(f32_to_bf16(m))
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
                index_cache[page, row, d] = stc(y)

    index_keys.threads = NT
    return index_keys


@functools.lru_cache(maxsize=None)
def make_index_queries_kernel(threads, di, rot, q_bf16=False, w_bf16=False, out_bf16=False):
    """Index queries: one block per (row, head), grid ``(rows, Hi)``; norm then RoPE at the row's
    clamped position (or ``rope_pos[i]``); inert rows write zeros. Shared memory ``4*Di + 4*threads``.
    ``q_bf16`` / ``w_bf16`` / ``out_bf16``: that array is bfloat16 bits (the output rounded once)."""
    NT, DI = threads, di
    norm_rope = _make_norm_rope(threads, di, rot, w_bf16)
    ldq, stq = loader(q_bf16), storer(out_bf16)

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
                qi[i, h, d] = stq(float32(0.0))
            return
        for d in range(tid, uint32(DI), uint32(NT)):
            x_s[d] = ldq(q_raw[i, h, d])
        cuda.syncthreads()
        pos = p
        if has_rope_pos:
            pos = int32(rope_pos[i])
        norm_rope(x_s, red_s, tid, w_q, eps, pos, theta)
        for d in range(tid, uint32(DI), uint32(NT)):
            qi[i, h, d] = stq(x_s[d])

    index_queries.threads = NT
    return index_queries


def _emulate(kind):
    """The mean's rounding: None, "float16" or "bfloat16" (``True``/``False`` as float16/None)."""
    if kind is True:
        return "float16"
    return kind or None


def launch_index_keys(k_raw, w_k, group_req_ids, group_ids, rope_pos, has_rope_pos, index_cache,
                      index_block_table, kc, stream, *, eps, rot, theta, emulate_f16=False):
    """``emulate_f16``: False/None, True (float16) or a dtype name ("float16", "bfloat16")."""
    G, r, di = k_raw.shape
    if G == 0:
        return kc
    k = make_index_keys_kernel(pre_threads(di), int(r), int(di), int(rot), _emulate(emulate_f16),
                               is_bf16(k_raw), is_bf16(w_k), is_bf16(index_cache))
    k[G, k.threads, stream](bits16(k_raw), bits16(w_k), group_req_ids, group_ids, rope_pos,
                            bool(has_rope_pos), float(eps), float(theta), bits16(index_cache),
                            index_block_table, kc)
    return kc


def launch_index_queries(q_raw, w_q, req_ids, positions, seq_lens, rope_pos, has_rope_pos, qi,
                         stream, *, eps, rot, theta):
    rows, hi, di = q_raw.shape
    if rows == 0 or hi == 0:
        return qi
    k = make_index_queries_kernel(pre_threads(di), int(di), int(rot), is_bf16(q_raw), is_bf16(w_q),
                                  is_bf16(qi))
    k[(rows, hi), k.threads, stream](bits16(q_raw), bits16(w_q), req_ids, positions, seq_lens,
                                     rope_pos, bool(has_rope_pos), float(eps), float(theta),
                                     bits16(qi))
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
# bfloat16 in and out (uint16 bit arrays), the mean rounded to bfloat16 as the references do
for _cc in ((7, 0), (9, 0)):
    RESOURCE_CASES.append((
        "index_keys.bf16", make_index_keys_kernel(128, 4, 128, 64, "bfloat16", True, True, True),
        "void(uint16[:, :, :], uint16[:], int32[:], int32[:], int32[:], boolean, float64, float64, "
        "uint16[:, :, :], int32[:, :], float32[:, :])", 128, 0, _cc))
    RESOURCE_CASES.append((
        "index_queries.bf16", make_index_queries_kernel(128, 128, 64, True, True, True),
        "void(uint16[:, :, :], uint16[:], int32[:], int32[:], int32[:], int32[:], boolean, "
        "float64, float64, uint16[:, :, :])", 128, 0, _cc))
