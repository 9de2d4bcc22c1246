"""Adapters: one module per implementation, each exposing the same small interface.

``NAME``; ``load(args) -> str | None`` (``None`` when usable, else the one-line reason it is
skipped); ``versions() -> dict``; ``prepare(stage, problem) -> Call`` (raise :class:`Skip` with a
reason when the implementation does not do that stage or that problem). ``problem`` is a
:class:`bench.workloads.Problem`; every adapter reads the same device tensors and converts them to
its native layout (views where it can) outside the timed call.
"""
from dataclasses import dataclass, field
from typing import Callable, Optional


def torch_gpu_missing(needs="needs torch", probe=lambda: None):
    """Why a torch peer cannot run here, or ``None``: ``probe()`` imports what else it needs (an
    ImportError gives ``needs (error)``), and torch must see a CUDA GPU."""
    try:
        import torch
        probe()
    except ImportError as err:
        return f"{needs} ({err})"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    return None


def triton_missing():
    """Why a Triton peer cannot run here (torch, triton or a CUDA GPU missing), or ``None``."""
    return torch_gpu_missing("needs torch and triton", lambda: __import__("triton"))


class Skip(Exception):
    """This implementation does not run this (stage, problem); the message says why."""


@dataclass
class Call:
    """``gpu()`` is the call timed GPU-only (it must not synchronise), ``e2e()`` the call as a user
    makes it (default arguments; may synchronise). ``result()`` returns the canonical outputs of the
    last call: a dict with some of ``scores`` [rows, G] float32, ``groups`` [rows, Kb] (any order,
    -1 padded), ``tokens`` [rows, W] (any order, -1 padded), ``out`` [rows, Hq, D].
    ``host`` names the public function(s) for the host-overhead lines: ``{name: callable}``."""
    gpu: Callable
    result: Callable
    e2e: Optional[Callable] = None
    host: dict = field(default_factory=dict)
    route: Optional[str] = None      # impl suffix, e.g. "page4" -> impl "numqsa.page4"
    note: str = ""


ORDER = ("numqsa", "trtllm", "sglang", "torch", "sdpa")


def modules():
    from . import numqsa_api, sdpa, sglang, torch_eager, trtllm
    return [numqsa_api, trtllm, sglang, torch_eager, sdpa]
