"""The planning layer is pure: routes and profiles are decided without a GPU."""
import pytest

import numqsa.plan as plan


def test_profiles_cover_v100_and_h200():
    assert plan.arch_profile((7, 0)).scores.mma == "m8n8k4"
    assert plan.arch_profile((9, 0)).attention.mma == "m16n8k16"
    assert plan.arch_profile((8, 6)).name == "sm_80"          # newest row not above
    assert plan.arch_profile((12, 0)).name == "sm_90"
    assert not plan.arch_profile((7, 0)).has_bf16
    with pytest.raises(ValueError, match="below sm_70"):
        plan.arch_profile((6, 1))


def test_profiles_are_frozen():
    with pytest.raises(AttributeError):
        plan.PROFILES["sm_90"].attention.group_rows = 3


def test_forced_arch(monkeypatch):
    monkeypatch.setenv("NUMQSA_ARCH", "sm_70")
    assert plan.arch_profile((9, 0)).name == "sm_70"
    monkeypatch.setenv("NUMQSA_ARCH", "sm_42")
    with pytest.raises(ValueError, match="NUMQSA_ARCH"):
        plan.arch_profile((9, 0))


def test_select_routes(monkeypatch):
    """One score route per architecture at every batch size (a row-count threshold between two
    routes of different arithmetic would give a row other bits when rows join its batch)."""
    for prof in plan.PROFILES.values():
        routes = {plan.plan_select(rows, groups, prof.cc).scores_route
                  for rows in (1, 7, 511, 512, 1 << 16) for groups in (1, 2048, 1 << 18)}
        assert routes == {"tiled"}, prof.name
    monkeypatch.setenv("NUMQSA_INDEXER_TILED", "0")
    assert plan.plan_select(1 << 16, 1 << 16, (9, 0)).scores_route == "light"


def test_attention_routes(monkeypatch):
    for prof in plan.PROFILES.values():
        routes = {plan.plan_attention(rows, prof.cc, 64).route for rows in (1, 4095, 4096, 1 << 20)}
        assert routes == {"page4"}, prof.name
    assert plan.plan_attention(1, (9, 0), page_size=6).route == "generic"   # pages not whole groups
    monkeypatch.setenv("NUMQSA_PAGE4", "0")
    assert plan.plan_attention(1 << 20, (7, 0)).route == "generic"
