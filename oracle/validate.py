"""Input checks shared by the oracle and the kernels' public API (spec §1, §2).

Every check runs on the host before any launch and raises :class:`QSAInputError` with a message that
names the argument, and for page tables the request and column. Arrays are read duck-typed (``shape``
and ``dtype``), so NumPy arrays, numba device arrays and CUDA tensors all pass through; only the small
integer arrays whose *values* matter (sequence lengths, page tables) are copied to the host.
This module never imports numba.
"""
import numpy as np

__all__ = [
    "QSAInputError", "dtype_name", "host_ints", "check_batch", "check_table", "check_kv",
    "check_q", "check_index_cache", "check_index_q", "check_selection", "check_tokens", "check_r",
    "check_kb", "check_page_size", "check_int", "check_array",
]

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
INT_DTYPES = ("int32", "int64")


class QSAInputError(ValueError):
    """A QSA input violates the contract of ``docs/contract.md``."""


_DTYPE_NAMES = {}


def dtype_name(x):
    """``'float16'`` etc. for NumPy/numba arrays and torch/CuPy tensors alike."""
    dt = getattr(x, "dtype", None)
    if dt is None:
        raise QSAInputError(f"expected an array, got {type(x).__name__}")
    try:
        return _DTYPE_NAMES[dt]          # NumPy's dtype.name is slow: every API call asks often
    except (KeyError, TypeError):
        pass
    name = (getattr(dt, "name", None) or str(dt)).replace("torch.", "")
    try:
        _DTYPE_NAMES[dt] = name
    except TypeError:                    # an unhashable dtype object
        pass
    return name


def host_ints(x):
    """Small integer array to a host int64 NumPy array (copies device arrays)."""
    if hasattr(x, "copy_to_host"):
        x = x.copy_to_host()
    elif hasattr(x, "get") and not isinstance(x, np.ndarray):
        x = x.get()
    elif hasattr(x, "cpu") and hasattr(x, "numpy"):
        x = x.cpu().numpy()
    return np.asarray(x).astype(np.int64, copy=False)


def _rank(x, name, ndim, dims):
    check_array(x, name)
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) != ndim:
        raise QSAInputError(f"{name} must have rank {ndim} {dims}, got shape {shape}")
    return shape


def _dtype(x, name, allowed):
    dt = dtype_name(x)
    if dt not in allowed:
        raise QSAInputError(f"{name} has dtype {dt}; expected one of {', '.join(allowed)}")
    return dt


def check_int(value, name, lo=1, hi=None):
    """A plain integer argument in ``[lo, hi]`` (bools and floats refused), else a clear error."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        hint = f" (use {int(value)})" if isinstance(value, float) and float(value).is_integer() else ""
        raise QSAInputError(f"{name} must be an integer, got {value!r} ({type(value).__name__}){hint}")
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise QSAInputError(f"{name} = {value} is out of range: it must be {rng}")
    return value


#: Largest accepted ``r`` and ``Kb``: above them the selection buffers alone
#: (rows x (Kb*r + r - 1) x 4 bytes) would be a runaway allocation, not a QSA problem.
MAX_R = 1 << 10
MAX_KB = 1 << 20


def check_r(r):
    """The compress ratio: an integer in 1..1024."""
    return check_int(r, "compress ratio r", 1, MAX_R)


def check_page_size(page_size, r, why=""):
    """A page size: an integer >= 1 and a multiple of ``r`` (``why`` appended to that message)."""
    page_size = check_int(page_size, "page_size", 1)
    if page_size % r:
        raise QSAInputError(f"page_size {page_size} is not a multiple of r = {r}{why}")
    return page_size


def check_kb(Kb):
    """Selected groups per row: an integer in 1..2^20 (a selection of 4M tokens)."""
    return check_int(Kb, "Kb", 1, MAX_KB)


def check_array(x, name):
    """``x`` has ``shape`` and ``dtype`` (Python lists and scalars get a message saying so)."""
    if isinstance(x, (list, tuple)):
        raise QSAInputError(f"{name} is a Python {type(x).__name__}; pass an array "
                            f"(np.asarray({name}, dtype=...))")
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise QSAInputError(f"{name} is a {type(x).__name__}; expected an array")
    return x


def check_batch(req_ids, positions, seq_lens):
    """Spec §1. Returns ``(rows, num_reqs)``."""
    (rows,) = _rank(req_ids, "req_ids", 1, "[rows]")
    (prow,) = _rank(positions, "positions", 1, "[rows]")
    (num_reqs,) = _rank(seq_lens, "seq_lens", 1, "[num_reqs]")
    for x, name in ((req_ids, "req_ids"), (positions, "positions"), (seq_lens, "seq_lens")):
        _dtype(x, name, INT_DTYPES)
    if prow != rows:
        raise QSAInputError(f"positions has {prow} rows but req_ids has {rows}")
    return rows, num_reqs


def check_table(table, seq_lens, *, units_per_page, num_pages, r=1, name="block_table"):
    """Every page a live request needs must be a valid page id (spec §2).

    ``seq_lens`` are token counts; the needed entries are ``seq_len // r`` units (tokens for
    ``r=1``, groups for the index table), ``units_per_page`` of them per page. Returns the host table.
    """
    _rank(table, name, 2, "[num_reqs, cols]")
    _dtype(table, name, INT_DTYPES)
    tab = host_ints(table)
    lens = host_ints(seq_lens)
    if tab.shape[0] < lens.shape[0]:
        raise QSAInputError(f"{name} has {tab.shape[0]} rows but there are {lens.shape[0]} requests")
    unit = "tokens" if r == 1 else "groups"
    for q, slen in enumerate(lens):
        units = int(slen) // r
        if units <= 0:
            continue
        need = -(-units // units_per_page)
        if need > tab.shape[1]:
            raise QSAInputError(
                f"{name} has {tab.shape[1]} columns but request {q} (seq_len {slen}) needs {need} "
                f"for its {units} {unit} at {units_per_page} per page")
        ids = tab[q, :need]
        bad = np.flatnonzero((ids < 0) | (ids >= num_pages))
        if bad.size:
            c = int(bad[0])
            raise QSAInputError(
                f"{name}[{q}, {c}] = {int(ids[c])} is not a valid page id (num_pages = {num_pages}) "
                f"for request {q}, column {c}, which holds {unit} {c * units_per_page}.."
                f"{min(units, (c + 1) * units_per_page) - 1} of its {units}")
    return tab


def check_kv(k_cache, v_cache, r):
    """K/V caches ``[num_pages, page_size, Hkv, D]`` of equal geometry and dtype (any strides).

    Returns ``(num_pages, page_size, Hkv, D)``.
    """
    ks = _rank(k_cache, "k_cache", 4, "[num_pages, page_size, Hkv, D]")
    vs = _rank(v_cache, "v_cache", 4, "[num_pages, page_size, Hkv, D]")
    kd = _dtype(k_cache, "k_cache", FLOAT_DTYPES)
    vd = _dtype(v_cache, "v_cache", FLOAT_DTYPES)
    if ks != vs:
        raise QSAInputError(f"k_cache shape {ks} differs from v_cache shape {vs}")
    if kd != vd:
        raise QSAInputError(f"k_cache dtype {kd} differs from v_cache dtype {vd}")
    num_pages, page_size, hkv, d = ks
    check_page_size(page_size, r, ": a group of r tokens would straddle two pages")
    if hkv < 1 or d < 1:
        raise QSAInputError(f"k_cache has Hkv = {hkv}, D = {d}; both must be >= 1")
    return ks


def _check_heads(x, name, rows, dim, dims, cache_dim):
    """``x [rows, heads, dim]`` of a float dtype; returns its shape."""
    s = _rank(x, name, 3, dims)
    _dtype(x, name, FLOAT_DTYPES)
    if s[0] != rows:
        raise QSAInputError(f"{name} has {s[0]} rows but req_ids has {rows}")
    if s[2] != dim:
        raise QSAInputError(f"{name} head dim {s[2]} differs from the {cache_dim} = {dim}")
    return s


def check_q(q, rows, hkv, d, name="q"):
    """Queries ``[rows, Hq, D]`` with ``Hq % Hkv == 0``. Returns ``Hq``."""
    hq = _check_heads(q, name, rows, d, "[rows, Hq, D]", "cache's D")[1]
    if hq < 1 or hq % hkv:
        raise QSAInputError(f"Hq = {hq} is not a positive multiple of Hkv = {hkv}")
    return hq


def check_index_cache(index_cache):
    """Index cache ``[num_idx_pages, idx_page_rows, Di]`` (any strides). Returns its shape."""
    s = _rank(index_cache, "index_cache", 3, "[num_idx_pages, idx_page_rows, Di]")
    _dtype(index_cache, "index_cache", FLOAT_DTYPES)
    if s[1] < 1 or s[2] < 1:
        raise QSAInputError(f"index_cache shape {s} has an empty page or head dim")
    return s


def check_index_q(qi, rows, di, name="qi"):
    """Index queries ``[rows, Hi, Di]``. Returns ``Hi``."""
    return _check_heads(qi, name, rows, di, "[rows, Hi, Di]", "index cache's Di")[1]


def check_selection(tokens, counts, rows, r):
    """Selection ``tokens [rows, Kb*r + r - 1]`` and ``counts [rows]``. Returns ``Kb``."""
    ts = _rank(tokens, "tokens", 2, "[rows, W]")
    (cs,) = _rank(counts, "counts", 1, "[rows]")
    _dtype(tokens, "tokens", INT_DTYPES)
    _dtype(counts, "counts", INT_DTYPES)
    if ts[0] != rows or cs != rows:
        raise QSAInputError(f"tokens {ts} / counts ({cs},) disagree with {rows} rows")
    if ts[1] < r - 1 or (ts[1] - (r - 1)) % r:
        raise QSAInputError(f"tokens width {ts[1]} is not Kb*r + r - 1 for r = {r}")
    return (ts[1] - (r - 1)) // r


def check_tokens(tokens, counts, req_ids, seq_lens):
    """Every selected token of a live row lies in ``0 .. seq_len - 1`` of its request.

    Reads values, so the kernels' API applies it to host selections only; on the device the kernels
    guard instead (a row with an out-of-range id becomes inert, nothing is read out of bounds).
    """
    toks, cnt = host_ints(tokens), host_ints(counts)
    req, lens = host_ints(req_ids), host_ints(seq_lens)
    for i in range(toks.shape[0]):
        q = int(req[i])
        if not 0 <= q < lens.size or lens[q] <= 0 or cnt[i] <= 0:
            continue
        if cnt[i] > toks.shape[1]:
            raise QSAInputError(f"row {i}: count {cnt[i]} exceeds the selection width {toks.shape[1]}")
        t = toks[i, :cnt[i]]
        if t.min() < 0 or t.max() >= lens[q]:
            raise QSAInputError(f"row {i}: selected tokens must lie in 0..{lens[q] - 1}")
