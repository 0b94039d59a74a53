"""benchmarks/roofline.py's counts from one profiled run: the FLOPs of its matmuls and
triangular solves, the bytes of its elementwise passes, and time shares that add up to 1."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "roofline.py"
spec = importlib.util.spec_from_file_location("roofline", PATH)
roofline = importlib.util.module_from_spec(spec)
sys.modules["roofline"] = roofline  # its dataclasses look their module up
spec.loader.exec_module(roofline)


def test_counts_matmul_solve_and_elementwise_bytes():
    a = torch.randn(6, 8, 8).tril(-1)
    b, c = torch.randn(6, 8, 5), torch.randn(6, 5, 3)

    def fn(q, k, v, gates):
        x = torch.linalg.solve_triangular(a, b, upper=False, unitriangular=True)  # 6 * 8^2 * 5
        y = torch.bmm(x, c)  # 2 * 6 * 8 * 5 * 3
        return y * 2.0  # an elementwise pass over 6 * 8 * 3 floats

    call = roofline.Call("toy", "toy", fn, {})
    qkv = tuple(torch.zeros(1, 1, 1, 1) for _ in range(3))
    got = roofline.counts(call, qkv, False, torch.ones(1))
    assert got["flops"] == 6 * 8**2 * 5 + 2 * 6 * 8 * 5 * 3
    # The product reads its input and writes as much: 2 * 144 floats of 4 bytes at least.
    assert got["bytes"] >= 4 * 2 * 6 * 8 * 3
    shares = sum(got[k] for k in ("matmul", "solve", "elementwise", "overhead"))
    assert abs(shares - 1.0) < 1e-9  # the overhead is the rest of the profiled wall time
    assert got["matmul"] > 0 and got["solve"] > 0


def test_counts_in_place_matmuls():
    """The exact form accumulates into preallocated results (baddbmm_, addmm_): their FLOPs
    are counted as matmuls, not as elementwise bytes."""
    out, b, c = torch.zeros(6, 8, 3), torch.randn(6, 8, 5), torch.randn(6, 5, 3)
    flat, x, y = torch.zeros(8, 3), torch.randn(8, 5), torch.randn(5, 3)

    def fn(q, k, v, gates):
        out.baddbmm_(b, c)  # 2 * 6 * 8 * 5 * 3
        flat.addmm_(x, y)  # 2 * 8 * 5 * 3
        return out

    call = roofline.Call("toy", "toy", fn, {})
    qkv = tuple(torch.zeros(1, 1, 1, 1) for _ in range(3))
    got = roofline.counts(call, qkv, False, torch.ones(1))
    assert got["flops"] == 2 * 6 * 8 * 5 * 3 + 2 * 8 * 5 * 3
    assert got["matmul"] > 0
