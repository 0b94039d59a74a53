"""The optimizer axis's chunk forms against fla's pure-torch references, as ratios taken in one
run.

    .venv/bin/python benchmarks/optimizer_axis.py [--length 2048] [--repeats 3] [--cases NAME ...]
                                                  [--passes fwd fwd+bwd]

CPU, float32, B = 2, H = 4, d = Dk = Dv = 64, T = 2048, torch.set_num_threads(2). Each row of
CASES is one miras op against one fla-core 0.6.0 reference on equal inputs: "fwd" runs under
torch.no_grad(), "fwd+bwd" is the forward with every floating input requiring grad plus the
backward of sum(o * w). The repeats are interleaved (miras, fla, miras, fla, ...) after one
warmup call of each, so a change in the machine's load falls on both; each time is a median.
The outputs are compared (relative RMS of o) before timing, and the load average is printed
at the start and at the end.

A case is `Case(name, miras, reference, inputs)`: `inputs(t, seed)` builds a tuple of tensors,
and `miras(*inputs)` and `reference(*inputs)` each return o [B, T, H, V]. Add a row by adding
a case to CASES.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

B, H, D = 2, 4, 64
THREADS = 2


class Case(NamedTuple):
    name: str  # the row's label: the miras op and the fla reference it is timed against
    miras: Callable[..., torch.Tensor]
    reference: Callable[..., torch.Tensor]
    inputs: Callable[[int, int], tuple[torch.Tensor, ...]]


def _fla(module: str, name: str):
    """An fla-core function, imported when a case first runs (fla warns at import that Triton
    has no GPU here)."""
    import importlib

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(importlib.import_module(module), name)


# DeltaProduct (Siems et al. 2025, arXiv:2502.10297): n keys and values per token, fla's packing
# k, v [B, T*n, H, D], beta [B, T*n, H], one log-decay g [B, T, H] per token.


def deltaproduct_inputs(n: int):
    def build(t: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        q = F.normalize(torch.randn(B, t, H, D, generator=gen), dim=-1)
        k = F.normalize(torch.randn(B, t * n, H, D, generator=gen), dim=-1)
        v = torch.randn(B, t * n, H, D, generator=gen)
        g = torch.log(0.9 + 0.1 * torch.rand(B, t, H, generator=gen))
        beta = 0.1 + 0.4 * torch.rand(B, t * n, H, generator=gen)
        return q, k, v, g, beta

    return build


def deltaproduct_miras(n: int):
    def f(q, k, v, g, beta):
        from miras import ops

        return ops.chunk_gated_delta_product(q, k, v, g, beta, num_householder=n, scale=1.0)[0]

    return f


def deltaproduct_fla_naive(n: int):
    def f(q, k, v, g, beta):
        naive = _fla("fla.ops.gated_delta_product.naive", "naive_recurrent_gated_delta_product")
        return naive(q, k, v, g, beta, scale=1.0, num_householder=n)[0]

    return f


# Longhorn (Liu et al. 2024, arXiv:2407.14207): the proximal step, miras's exact chunk form of
# specs/longhorn.yaml, against fla's delta rule with beta / (1 + beta ||k||^2). Keys are not
# normalized (||k||^2 about 2.6), so the step size differs from beta.


def proximal_inputs(t: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, t, H, D, generator=gen)
    k = 0.2 * torch.randn(B, t, H, D, generator=gen)
    v = torch.randn(B, t, H, D, generator=gen)
    beta = 0.1 + 0.9 * torch.rand(B, t, H, generator=gen)
    return q, k, v, beta


def proximal_miras(q, k, v, beta):
    import miras

    with torch.enable_grad():  # compiling checks the derivation by autograd (cached after)
        rule = miras.compile("specs/longhorn.yaml")
    return rule(q * D**-0.5, k, v, {"lr": beta}, backend="chunk", chunk_size=64)[0]


def proximal_fla_naive(q, k, v, beta):
    naive = _fla("fla.ops.delta_rule.naive", "delta_rule_recurrence")
    eta = beta / (1 + beta * (k * k).sum(-1))  # [B, T, H]
    o, _ = naive(*(x.transpose(1, 2) for x in (q, k, v, eta)), output_final_state=False)
    return o.transpose(1, 2)


# MesaNet (von Oswald et al. 2025, arXiv:2506.05233): optimizer exact, the statistics per chunk of
# 64 and a Cholesky solve per token, against fla's naive_mesa_net_exact (the statistics token by
# token, then torch.linalg.solve per token). lamb [H, K] is MesaNet's ridge, >= 0.25.


def mesa_inputs(t: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, t, H, D, generator=gen)
    k = F.normalize(torch.randn(B, t, H, D, generator=gen), dim=-1)
    v = torch.randn(B, t, H, D, generator=gen)
    g = torch.log(0.9 + 0.1 * torch.rand(B, t, H, generator=gen))
    beta = torch.rand(B, t, H, generator=gen).sigmoid()
    lamb = 0.25 + F.softplus(torch.rand(H, D, generator=gen))
    return q, k, v, g, beta, lamb


def mesa_miras(q, k, v, g, beta, lamb):
    from miras import ops

    with torch.enable_grad():  # compiling checks the derivation by autograd (cached after)
        ops.known_rule("mesanet")
    return ops.chunk_mesa_net(q, k, v, g, beta, lamb, chunk_size=64)[0]


def mesa_fla_naive(q, k, v, g, beta, lamb):
    naive = _fla("fla.ops.mesa_net.naive", "naive_mesa_net_exact")
    return naive(q, k, v, g, lamb, beta)[0]


# fla's own chunk reference for DeltaProduct (fla.ops.gated_delta_product.chunk_ref) calls its
# Triton kernels and refuses float32, so the recurrent naive function is the pure-torch
# reference here.
CASES: list[Case] = [
    Case(
        "chunk_gated_delta_product n=2 vs fla naive_recurrent_gated_delta_product",
        deltaproduct_miras(2),
        deltaproduct_fla_naive(2),
        deltaproduct_inputs(2),
    ),
    Case(
        "longhorn (proximal, exact chunk 64) vs fla delta_rule_recurrence with beta/(1+beta||k||^2)",
        proximal_miras,
        proximal_fla_naive,
        proximal_inputs,
    ),
    Case(
        "chunk_mesa_net (exact, chunk 64, Cholesky) vs fla naive_mesa_net_exact",
        mesa_miras,
        mesa_fla_naive,
        mesa_inputs,
    ),
]


def relative_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()


def once(f, inputs, weight, backward: bool) -> float:
    """Seconds of one call of f (with its backward when `backward`)."""
    if not backward:
        with torch.no_grad():
            start = time.perf_counter()
            f(*inputs)
            return time.perf_counter() - start
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    start = time.perf_counter()
    (f(*leaves) * weight).sum().backward()
    return time.perf_counter() - start


def time_case(
    case: Case, t: int, repeats: int, passes: tuple[str, ...] = ("fwd", "fwd+bwd")
) -> list[tuple]:
    """[(pass, miras s, fla s)] for fwd and fwd+bwd: interleaved repeats, medians."""
    inputs = case.inputs(t, 0)
    with torch.no_grad():
        o = case.reference(*inputs)
        err = relative_rms(case.miras(*inputs), o)
    print(f"{case.name}: relative RMS of o against fla = {err:.2e}", flush=True)
    weight = torch.randn(o.shape, generator=torch.Generator().manual_seed(1))
    rows = []
    for backward in [what == "fwd+bwd" for what in passes]:
        times = {"miras": [], "fla": []}
        for f in (case.miras, case.reference):  # warmup
            once(f, inputs, weight, backward)
        for _ in range(repeats):
            times["miras"].append(once(case.miras, inputs, weight, backward))
            times["fla"].append(once(case.reference, inputs, weight, backward))
        what = "fwd+bwd" if backward else "fwd"
        rows.append((what, statistics.median(times["miras"]), statistics.median(times["fla"])))
    return [(case.name, err, *row) for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    # fla's naive MesaNet backward grows as T^2 d^2 (one copy of its [B, T, H, K, K] history
    # per token): at T = 2048 it takes over an hour, so its fwd+bwd row runs at a shorter T.
    parser.add_argument("--passes", nargs="+", choices=["fwd", "fwd+bwd"], default=None)
    names = [c.name.split()[0] for c in CASES]
    parser.add_argument(
        "--cases", nargs="+", default=None, help=f"cases by their op's name: {', '.join(names)}"
    )
    args = parser.parse_args()
    cases = [c for c in CASES if args.cases is None or c.name.split()[0] in args.cases]
    if not cases:
        parser.error(f"--cases: none of {args.cases} is a case; the cases: {', '.join(names)}")
    torch.set_num_threads(THREADS)
    print(
        f"load average (1 min) at start: {os.getloadavg()[0]:.2f}; threads {THREADS}; "
        f"T = {args.length}, B = {B}, H = {H}, d = {D}, float32, {args.repeats} repeats"
    )
    passes = tuple(args.passes or ("fwd", "fwd+bwd"))
    rows = [row for c in cases for row in time_case(c, args.length, args.repeats, passes)]
    print()
    print("| case | pass | miras (s) | fla (s) | fla / miras | rel. RMS of o |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, err, what, m, f in rows:
        print(f"| {name} | {what} | {m:.3f} | {f:.3f} | {f / m:.2f}x | {err:.1e} |")
    print(f"load average (1 min) at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
