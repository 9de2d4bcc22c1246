"""GPU-only, end-to-end and host-overhead times of one call (issue 13, Deliver 3).

GPU-only: each repetition is enqueued behind a spin kernel (``torch.cuda._sleep``) long enough to
cover the host's enqueue time, so host time is hidden; an L2 flush (a 256 MB write, the H200 has
50 MB of L2) precedes the start event; CUDA events bracket the call; warm-up 3, median of 20
(median of 5 for calls over 50 ms, recorded as ``reps``).
End-to-end: flush, synchronise, ``perf_counter`` around the call and a synchronise; median of 20.
Host overhead: a long spin is enqueued, then the host time of one call is taken (median of 50);
a call that synchronises would wait for the spin, which is detected (time > half the spin) and
re-measured with the GPU idle (``syncs: true``). ``host_loop``: the same call among 20 back-to-back
calls behind one spin (a model step's layers), median of 5 rounds (``ms_host_loop``): a call alone
after a wait also pays the host's wake-up (caches, clocks), which a loop of layers does not.
"""
import time

import numpy as np


class Timer:
    def __init__(self, torch):
        self.t = torch
        self.flush_buf = torch.empty(64 * 1024 * 1024, dtype=torch.float32, device="cuda")
        self.cycles_per_ms = self._calibrate()

    def _calibrate(self):
        t = self.t
        s, e = t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)
        t.cuda._sleep(1000)
        s.record()
        t.cuda._sleep(2_000_000)
        e.record()
        e.synchronize()
        return 2_000_000 / max(s.elapsed_time(e), 1e-3)

    def spin(self, ms):
        self.t.cuda._sleep(int(ms * self.cycles_per_ms))

    def flush(self):
        self.flush_buf.zero_()

    def gpu(self, fn, warmup=3, reps=20):
        t = self.t
        for _ in range(warmup):
            fn()
        t.cuda.synchronize()
        h0 = time.perf_counter()
        fn()
        host_ms = (time.perf_counter() - h0) * 1e3
        t.cuda.synchronize()
        s, e = t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        if s.elapsed_time(e) > 50:
            reps = 5
        pairs = []
        for _ in range(reps):
            self.spin(2 * host_ms + 0.2)
            self.flush()
            s, e = t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            pairs.append((s, e))
        t.cuda.synchronize()
        return float(np.median([a.elapsed_time(b) for a, b in pairs])), reps

    def e2e(self, fn, reps=20, slow=False):
        t = self.t
        fn()
        times = []
        for _ in range(5 if slow else reps):
            self.flush()
            t.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            t.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        return float(np.median(times))

    def host(self, fn, reps=50):
        """``(ms, syncs)``: host time of one call with the GPU busy behind a spin four times the
        call's idle host time (at least 5 ms); a median above idle + half the spin means the call
        waited for the GPU (``syncs``), and then the idle time is returned."""
        t = self.t
        fn()
        t.cuda.synchronize()
        idle = []
        for _ in range(10):
            t.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            idle.append((time.perf_counter() - t0) * 1e3)
        t.cuda.synchronize()
        idle_ms = float(np.median(idle))
        spin_ms = max(5.0, 4 * idle_ms)
        times = []
        for _ in range(reps):
            self.spin(spin_ms)
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            t.cuda.synchronize()
        ms = float(np.median(times))
        self.last_busy_ms = ms
        self.last_idle_ms = idle_ms
        if ms < idle_ms + 0.5 * spin_ms:
            return ms, False
        return idle_ms, True

    def host_loop(self, fn, calls=20, rounds=5):
        """Host ms of one call among ``calls`` back-to-back calls (a model step's layers), median
        over ``rounds`` rounds, each behind a spin four times the round's idle host time (at least
        5 ms); None if the GPU went idle before a round ended (the spin was too short, or a call
        waited). Run after :meth:`host` (its idle time sizes the spin)."""
        t = self.t
        spin_ms = max(5.0, 4 * calls * getattr(self, "last_idle_ms", 1.0))
        times = []
        for _ in range(rounds):
            t.cuda.synchronize()
            self.spin(spin_ms)
            for _ in range(calls):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            busy = not t.cuda.current_stream().query()
            t.cuda.synchronize()
            if not busy:
                return None
        return float(np.median(times))
