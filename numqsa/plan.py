"""Planning and routing: a pure function from a problem and a compute capability to a launch plan.

Nothing here touches a GPU, so routes can be tested and explained on any machine. Launch profiles are
frozen dataclasses, one row per architecture; each field's comment says what chose it.

Environment overrides (read at every plan, so tests can flip them):

- ``NUMQSA_ARCH=sm_70`` (or ``sm_80``, ``sm_90``): plan as if on that architecture. On an H200 this
  runs the sm_70 kernels (m8n8k4 tensor-core code, which Hopper emulates) for correctness checks.
- ``NUMQSA_INDEXER_TILED=0``: never take the tiled tensor-core index-score route.
- ``NUMQSA_PAGE4=0``: never take the page-4 grouped attention route.
"""
import os
from dataclasses import dataclass, replace

__all__ = [
    "ScoresProfile", "TopkProfile", "AttentionProfile", "ArchProfile", "PROFILES",
    "arch_profile", "SelectPlan", "AttentionPlan", "plan_select", "plan_attention",
]


@dataclass(frozen=True)
class ScoresProfile:
    """Index-score stage."""
    mma: str                   # "m8n8k4" (sm_70) or "m16n8k16" (sm_80+)
    tile_rows: int = 64        # query rows per block of the tiled route
    tile_keys: int = 64        # compressed keys staged in shared memory per step
    warps: int = 4


@dataclass(frozen=True)
class TopkProfile:
    """Top-k and expansion stages."""
    threads: int = 256
    chunk_groups: int = 65536  # fused select: groups scored per pass at long context
    register_threads: int = 512  # register top-k block: 512 x 16 keys, 64 registers, no spills on
                                 # sm_90 (resource report); sm_70 spills at 512, so 1024 x 8


@dataclass(frozen=True)
class AttentionProfile:
    """Sparse attention stage."""
    mma: str
    group_rows: int = 8        # query rows sharing K/V pages in the page-4 route: one warp per row;
                               # 16 warps x ~160 registers do not fit an SM (resource report)
    threads: int = 128


@dataclass(frozen=True)
class ArchProfile:
    name: str
    cc: tuple
    has_bf16: bool
    max_static_smem: int       # bytes per block without the opt-in attribute
    smem_per_sm: int
    regs_per_sm: int
    max_threads_per_sm: int
    sm_count: int              # of the reference card of this row
    scores: ScoresProfile
    topk: TopkProfile
    attention: AttentionProfile


PROFILES = {
    "sm_70": ArchProfile(  # V100: 80 SMs, 96 KB smem/SM, no bfloat16
        name="sm_70", cc=(7, 0), has_bf16=False, max_static_smem=48 * 1024,
        smem_per_sm=96 * 1024, regs_per_sm=65536, max_threads_per_sm=2048, sm_count=80,
        scores=ScoresProfile(mma="m8n8k4"),
        topk=TopkProfile(register_threads=1024),
        # 4 rows per group: 4 warps x 198 registers and 47.9 KB static shared memory give 2 resident
        # blocks per V100 SM; 8 rows fit only one (resource report, page4_m8n8k4_g4 / _g8).
        attention=AttentionProfile(mma="m8n8k4", group_rows=4),
    ),
    "sm_80": ArchProfile(
        name="sm_80", cc=(8, 0), has_bf16=True, max_static_smem=48 * 1024,
        smem_per_sm=164 * 1024, regs_per_sm=65536, max_threads_per_sm=2048, sm_count=108,
        scores=ScoresProfile(mma="m16n8k16"),
        topk=TopkProfile(),
        # the grouped kernel takes 4 ring stages here (164 KB). Not measured on an A100.
        attention=AttentionProfile(mma="m16n8k16", group_rows=8),
    ),
    "sm_90": ArchProfile(  # H200: 132 SMs, 228 KB smem/SM
        name="sm_90", cc=(9, 0), has_bf16=True, max_static_smem=48 * 1024,
        smem_per_sm=228 * 1024, regs_per_sm=65536, max_threads_per_sm=2048, sm_count=132,
        # tiled at every row count also wins on speed here: H200, keys-as-M kernel (8 warps, before
        # its cp.async pipeline) vs light, GPU-only ms behind a spin (.gpu/scores_probe.py, session
        # 3): 1 x 32K ctx 0.015 / 0.023, 4 x 32K 0.015 / 0.027, 16 x 32K 0.016 / 0.037, 1 x 131K
        # 0.030 / 0.049, 16 x 131K 0.032 / 0.111, 256 x 131K 0.115 / 1.42; earlier 512 x 32K 0.079 /
        # 0.796 (the pipelined 4-warp kernel: 1 x 131K 0.017)
        scores=ScoresProfile(mma="m16n8k16"),
        topk=TopkProfile(),
        # page-4 at every row count also wins on speed here: H200, 32K context, 2051 selected,
        # GPU-only ms (bench/attention_probe.py, docs/kernels/grouped.md "grouped v3"), grouped /
        # generic: 1 row 0.095 / 3.03, 16 rows 0.20 / 2.28, 256 rows 0.29 / 2.29
        attention=AttentionProfile(mma="m16n8k16", group_rows=8),
    ),
}


def _env_flag(name):
    """True unless the variable is set to 0/false/off."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "off", "no")


def arch_profile(cc):
    """The launch profile for compute capability ``cc`` (a tuple), or ``NUMQSA_ARCH``'s if set.

    Unknown newer architectures take the newest row not above them; anything below sm_70 is refused.
    """
    forced = os.environ.get("NUMQSA_ARCH")
    if forced:
        if forced not in PROFILES:
            raise ValueError(f"NUMQSA_ARCH={forced!r}: expected one of {sorted(PROFILES)}")
        return PROFILES[forced]
    cc = tuple(cc)
    rows = [p for p in PROFILES.values() if p.cc <= cc]
    if not rows:
        raise ValueError(f"compute capability {cc[0]}.{cc[1]} is below sm_70, which numqsa needs")
    return max(rows, key=lambda p: p.cc)


@dataclass(frozen=True)
class SelectPlan:
    profile: ArchProfile
    scores_route: str          # "tiled" or "light"
    reason: str


@dataclass(frozen=True)
class AttentionPlan:
    profile: ArchProfile
    route: str                 # "page4" or "generic"
    reason: str


# One route per stage at every batch size: routes of different arithmetic on either side of a row
# count would give a row other bits when other rows join its batch (contract §6). ``rows`` and
# ``num_groups`` size the launches, never the route; what a route cannot take (dtypes,
# alignment, bfloat16 on sm_70) falls back by the problem's layout at launch, not by its size.

def plan_select(rows, num_groups, cc):
    """Route the index-score stage: the tiled tensor-core kernels, unless ``NUMQSA_INDEXER_TILED=0``
    (the light fp32 kernel, also the launch-time fallback: ``index_scores.tiled_supported``)."""
    prof = arch_profile(cc)
    if not _env_flag("NUMQSA_INDEXER_TILED"):
        return SelectPlan(prof, "light", "NUMQSA_INDEXER_TILED=0")
    return SelectPlan(prof, "tiled", "one route at every batch size")


def plan_attention(rows, cc, page_size=None, r=4):
    """Route sparse attention: the page-4 plan and its tensor-core kernel, unless ``NUMQSA_PAGE4=0``
    or pages are not whole groups (the generic kernel; also the launch-time fallback for dtypes and
    rows the page-4 plan cannot express)."""
    prof = arch_profile(cc)
    if not _env_flag("NUMQSA_PAGE4"):
        return AttentionPlan(prof, "generic", "NUMQSA_PAGE4=0")
    if page_size is not None and page_size % r:
        return AttentionPlan(prof, "generic", f"page_size {page_size} not a multiple of r={r}")
    return AttentionPlan(prof, "page4", "one route at every batch size")


def with_overrides(profile, **stage_fields):
    """A copy of ``profile`` with stage profiles replaced, e.g. ``attention=replace(...)`` (benchmarks)."""
    return replace(profile, **stage_fields)
