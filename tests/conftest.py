"""Test set-up: the simulator unless a GPU is present, ``gpu`` marks, fresh seeds per case.

``NUMBA_ENABLE_CUDASIM`` must be decided before numba is first imported, so it is set here. On a GPU
machine, ``pytest -m gpu`` runs the real-shape tier (torch required); without one those tests are
skipped. ``multi_gpu`` tests (also marked ``gpu``; ``pytest -m multi_gpu``) are skipped on a host
with fewer than two GPUs. ``pytest`` alone runs the default tier (``-m "not slow and not gpu"`` in
pyproject.toml), ``pytest -m slow`` the longer simulator cases.
Seeds: each test gets a generator seeded from the session seed (``NUMQSA_SEED``, random by default,
printed in the header) and the test's id, so a failure can be replayed exactly.
"""
import fcntl
import glob
import os
import tempfile
import zlib

import numpy as np
import pytest


def _has_gpu():
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")


def _gpu_count():
    """GPUs this process may use, without initialising CUDA here (the test processes do): the
    entries of ``CUDA_VISIBLE_DEVICES`` if set, else the host's ``/dev/nvidiaN`` device files."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [v.strip() for v in visible.split(",")]
        return len(entries[:entries.index("-1")] if "-1" in entries else [v for v in entries if v])
    return len(glob.glob("/dev/nvidia[0-9]*"))


os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0" if _has_gpu() else "1")
SIMULATOR = os.environ["NUMBA_ENABLE_CUDASIM"] == "1"
SESSION_SEED = int(os.environ.get("NUMQSA_SEED", np.random.SeedSequence().entropy % (1 << 32)))


#: Processes of the GPU tier: its tests spend most of their time compiling and in the float64
#: oracle on the host, so a few processes share the one device (each holds a CUDA context).
GPU_WORKERS = 4


def pytest_configure(config):
    # pytest-xdist workers are new processes: they take the session's seed and the device lock's
    # path from the environment
    os.environ["NUMQSA_SEED"] = str(SESSION_SEED)
    if not hasattr(config, "workerinput"):
        fd, path = tempfile.mkstemp(prefix="numqsa-device-", suffix=".lock")
        os.close(fd)
        os.environ["NUMQSA_DEVICE_LOCK"] = path
        config.add_cleanup(lambda: [os.unlink(p) for p in (path, path + ".gate")
                                    if os.path.exists(p)])
    _spread(config)


def _spread(config):
    """With pytest-xdist installed (the ``[test]`` extra) and no ``-n`` given, the tests are spread
    over processes (``-n 0``: one process): in the simulator, which runs kernels in pure Python on
    one core per process, one per CPU; on a GPU, :data:`GPU_WORKERS`, sharing the device (tests that
    read device-wide state take it alone: :func:`_device_lock`)."""
    opt = config.option
    if (hasattr(config, "workerinput") or not config.pluginmanager.hasplugin("xdist")
            or getattr(opt, "numprocesses", None) is not None or opt.dist != "no"
            or opt.collectonly or opt.usepdb):
        return
    cpus = os.cpu_count() or 1
    n = cpus if SIMULATOR else min(cpus, GPU_WORKERS)
    if n > 1:
        opt.numprocesses, opt.dist, opt.tx = n, "worksteal", ["popen"] * n
        # the float64 oracle's matmuls: a share of the CPUs per process, not every CPU in each
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, str(max(1, cpus // n)))


def pytest_report_header(config):
    mode = "numba CUDA simulator" if SIMULATOR else "real GPU"
    return f"numqsa: {mode}; NUMQSA_SEED={SESSION_SEED}"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    _mark_slow(config, items)
    if SIMULATOR:
        skip = pytest.mark.skip(reason="needs a real GPU (NUMBA_ENABLE_CUDASIM=1)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    elif _gpu_count() < 2:
        skip = pytest.mark.skip(reason=f"needs two GPUs ({_gpu_count()} here)")
        for item in items:
            if "multi_gpu" in item.keywords:
                item.add_marker(skip)


def _mark_slow(config, items):
    """Mark the tests of :data:`tiers.SLOW` slow. When whole files are collected, an entry naming
    no test of a collected file is an error, so the list cannot outlive a rename."""
    from tiers import SLOW
    ids = {item.nodeid.split("tests/", 1)[-1]: item for item in items}
    for key, item in ids.items():
        if key in SLOW:
            item.add_marker(pytest.mark.slow)
    if any("::" in str(a) for a in config.args):
        return
    files = {key.split("::")[0] for key in ids}
    stale = [key for key in SLOW if key.split("::")[0] in files and key not in ids]
    if stale:
        raise pytest.UsageError("tests/tiers.py names tests that do not exist: " + ", ".join(stale))


def pytest_collection_finish(session):
    """On a GPU, the selected ``gpu`` tests need torch (its interop is part of the tier): a machine
    without it fails at once instead of skipping those tests."""
    if SIMULATOR or not any("gpu" in item.keywords for item in session.items):
        return
    try:
        import torch  # noqa: F401
    except ImportError as err:
        raise pytest.UsageError(f"the GPU tier needs torch (a build for the installed CUDA toolchain; see README): {err}")


@pytest.fixture(autouse=True)
def _device_lock(request):
    """GPU tests spread over processes share the device: each holds a shared lock on it for its
    run, a test marked ``device_alone`` (one that reads device-wide state, such as free memory) an
    exclusive one, so that no other process launches or allocates meanwhile. A gate lock keeps the
    exclusive request from starving: while it waits, no test starts."""
    path = os.environ.get("NUMQSA_DEVICE_LOCK")
    if SIMULATOR or "gpu" not in request.keywords or not path or not os.path.exists(path):
        yield
        return
    alone = "device_alone" in request.keywords
    with open(path + ".gate", "a") as gate, open(path) as device:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(device, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(device, fcntl.LOCK_UN)
            fcntl.flock(gate, fcntl.LOCK_UN)


@pytest.fixture
def rng(request):
    """A generator fresh per test case, replayable with NUMQSA_SEED."""
    seed = (SESSION_SEED, zlib.crc32(request.node.nodeid.encode()))
    return np.random.default_rng(seed)


@pytest.fixture
def seed(rng):
    """An integer seed for helpers that build their own generator."""
    return int(rng.integers(1 << 31))


@pytest.fixture(params=[pytest.param("generic", id="generic"),
                        pytest.param("planned", id="planned", marks=pytest.mark.slow)])
def api_attention(request, monkeypatch):
    """For API tests (wrapper, functional calls, bad input) whose subject is not the attention
    route: the default tier runs them with attention on the generic kernel (``NUMQSA_PAGE4=0``;
    one simulated grouped-kernel launch costs 8-10 s), the slow tier on the planned route."""
    if request.param == "generic":
        monkeypatch.setenv("NUMQSA_PAGE4", "0")
    return request.param
