"""A CUDA 13 install refuses sm_70 by name, before compiling (toolchain detection mocked).

The real detection is checked in CI's CUDA 13 install (``.ci/installs.sh``).
"""
import types

import pytest

from numqsa import device as dev
from numqsa import resources, toolchain
from numqsa.plan import arch_profile

CU12 = toolchain.Toolchain((12, 9), ((5, 0), (7, 0), (7, 5), (9, 0), (12, 0)), "/x/libnvvm.so")
CU13 = toolchain.Toolchain((13, 0), ((7, 5), (8, 0), (9, 0), (12, 0)), "/x/libnvvm.so.4")
NONE = toolchain.Toolchain(None, (), None)


@pytest.fixture
def use(monkeypatch):
    def _use(tc):
        monkeypatch.setattr(toolchain, "toolchain", lambda: tc)
        monkeypatch.setattr(dev, "_BUILDABLE", set())
    return _use


@pytest.fixture
def gpu(monkeypatch):
    """numqsa.device as on a real GPU of compute capability ``cc``."""
    def _gpu(cc):
        monkeypatch.setattr(dev, "SIMULATOR", False)
        monkeypatch.setattr(dev, "cuda", types.SimpleNamespace(
            get_current_device=lambda: types.SimpleNamespace(compute_capability=cc)))
    return _gpu


def test_cuda13_refuses_sm70_and_names_the_cuda12_install(use):
    use(CU13)
    with pytest.raises(toolchain.ToolchainError) as err:
        toolchain.check_target((7, 0))
    msg = str(err.value)
    assert "CUDA 13.0" in msg and "sm_70" in msg and "sm_75" in msg
    assert "pip install 'numqsa[cu12]'" in msg
    for cc in ((7, 5), (8, 0), (9, 0), (10, 0)):
        toolchain.check_target(cc)


def test_cuda12_builds_sm70(use):
    use(CU12)
    for cc in ((7, 0), (9, 0)):
        toolchain.check_target(cc)


def test_no_toolchain_names_both_installs(use):
    use(NONE)
    with pytest.raises(toolchain.ToolchainError, match=r"numqsa\[cu13\].*numqsa\[cu12\]"):
        toolchain.check_target((9, 0))


def test_call_on_a_v100_with_cuda13_is_refused(use, gpu):
    use(CU13)
    gpu((7, 0))
    with pytest.raises(toolchain.ToolchainError, match=r"numqsa\[cu12\]"):
        dev.resolve_stream()            # the first step of every launch path
    with pytest.raises(toolchain.ToolchainError, match=r"numqsa\[cu12\]"):
        dev.device_cc()


def test_numqsa_arch_sm70_on_an_sm90_device_still_builds_with_cuda13(use, gpu, monkeypatch):
    """NUMQSA_ARCH picks the launch profile; kernels compile for the device (the H200's sm_70 tier)."""
    use(CU13)
    gpu((9, 0))
    monkeypatch.setenv("NUMQSA_ARCH", "sm_70")
    assert dev.device_cc() == (9, 0)
    assert arch_profile(dev.device_cc()).name == "sm_70"


def test_resource_report_refuses_sm70_before_compiling(use, monkeypatch):
    use(CU13)
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "0")     # read by main() only: numba is loaded
    monkeypatch.setattr(resources, "collect_cases", lambda *a: pytest.fail("compiled"))
    with pytest.raises(SystemExit) as exit_:
        resources.main(["--arch", "sm_70"])
    assert "pip install 'numqsa[cu12]'" in str(exit_.value.code)
    with pytest.raises(SystemExit):
        resources.main([])                               # the default includes sm_70
