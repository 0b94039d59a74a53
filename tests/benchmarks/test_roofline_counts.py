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


def test_scaling_alternates_the_two_lengths_and_takes_the_median_ratio(monkeypatch):
    """`--scaling`: each round runs the short call, then the long one; the row is the median
    of the rounds' time(long) / time(short), for the miras calls only (peers skipped)."""
    order = []

    def make(t):
        def call(name, peer=False):
            return roofline.Call(name, "toy", lambda *a: None, {}, peer=peer)

        qkv = (torch.zeros(1, t, 1, 1),) * 3
        return [("toy", [call("mine"), call("peer", peer=True)])], qkv

    times = iter([1.0, 1.0, 1.0, 4.0, 2.0, 6.0, 1.0, 5.0])  # warmups, then 3 rounds

    def run_once(call, qkv, backward, weight):
        order.append((call.name, qkv[0].shape[1]))
        return next(times)

    # The fault counter before and after each timed call of the 3 rounds: the short call takes
    # 8, 0, 16 faults (1, 0, 2 a token at T 8), the long one 32, 320, 64 (1, 10, 2 at T 32).
    counter = iter([0, 8, 40, 40, 40, 360, 360, 376, 440])

    monkeypatch.setattr(roofline, "groups", lambda t, quick: make(t))
    monkeypatch.setattr(roofline, "run_once", run_once)
    monkeypatch.setattr(roofline, "page_faults", lambda: next(counter))
    rows = roofline.scaling_rows([8, 32], None, [False], repeats=3, budget=10.0, quick=False)
    assert [r["name"] for r in rows] == ["mine"]
    assert rows[0]["ratio"] == 4.0 and rows[0]["rounds"] == 3  # median of 4, 3, 5
    assert order == [("mine", 8), ("mine", 32)] * 4
    assert (rows[0]["faults_short"], rows[0]["faults_long"]) == (1.0, 2.0)  # medians a token


def test_page_faults_count_fresh_pages():
    """A fresh buffer of 64 MiB is mapped in by the kernel page by page as it is first written
    (glibc serves an allocation that large with an mmap of its own): 16384 faults of 4 KiB
    pages, or 32 where transparent huge pages back it with 2 MiB ones."""
    before = roofline.page_faults()
    torch.ones(16 << 20)  # 64 MiB of float32
    assert roofline.page_faults() - before >= 32
