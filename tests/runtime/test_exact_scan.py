"""`exact_chunk.scan_chunks`, the sequential pass of the exact chunk form, and its hand-written
backward (a reverse scan over chunks) against autograd through a plain loop of the recurrence
in its docstring, in float64 to 1e-10, on every input: per head and per channel (X = 1 or Dv),
with and without momentum, the dot bias's state-free signals, one chunk, and nc = n*c not a
power of 2. The full form against the recurrence is tests/runtime/test_exact_chunk.py.
"""

from __future__ import annotations

import pytest
import torch

from miras.runtime.exact_chunk import scan_chunks

f64 = torch.float64
EXACT = dict(rtol=1e-10, atol=1e-10)
B, H, DV, DPHI = 2, 3, 4, 5  # Dv != Dphi so a transposed state cannot pass

NAMES = (
    "base", "keys", "from_w", "from_s", "last_w", "last_s",
    "d_end", "carry_end", "theta_end", "w0", "s0",
)  # fmt: skip


def make_inputs(chunks, nc, x, per_channel, momentum, solve, dims=(B, H, DV, DPHI)):
    b, h, dv, dphi = dims
    gen = torch.Generator().manual_seed(chunks * 100 + nc * 10 + x)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, dtype=f64)).requires_grad_(True)

    def gate(*shape):  # in (0.5, 1): a stable state over many chunks
        return (0.5 + 0.5 * torch.rand(*shape, generator=gen, dtype=f64)).requires_grad_(True)

    mixing = (b, h, chunks, dv, nc, nc) if per_channel else (b, h, chunks, nc, dphi)
    inputs = dict(
        base=randn(b, h, chunks, nc, dv),
        keys=randn(b, h, chunks, nc, dphi, scale=0.5),
        from_w=randn(*mixing, scale=0.3) if solve else None,
        from_s=randn(*mixing, scale=0.3) if solve and momentum else None,
        last_w=randn(b, h, chunks, nc, x, scale=0.3),
        last_s=randn(b, h, chunks, nc, x, scale=0.3) if momentum else None,
        d_end=gate(b, h, chunks, x),
        carry_end=randn(b, h, chunks, x, scale=0.3) if momentum else None,
        theta_end=gate(b, h, chunks, x) if momentum else None,
        w0=randn(b, h, dv, dphi),
        s0=randn(b, h, dv, dphi) if momentum else None,
    )
    return [inputs[n] for n in NAMES]


def loop_reference(base, keys, from_w, from_s, last_w, last_s, d_end, carry_end, theta_end, w0, s0):  # fmt: skip
    """The recurrence of `scan_chunks`' docstring, one chunk at a time, by einsum."""
    w, s = w0, s0
    signals, starts_w, starts_s = [], [], []
    for i in range(base.shape[2]):
        k = keys[:, :, i]
        starts_w.append(w)
        starts_s.append(s)
        r = base[:, :, i]
        for sign, f, m in ((1.0, from_w, w), (-1.0, from_s, s)):
            if f is None:
                continue
            if f.dim() == 6:  # mix(F, K M^T)[t, v] = sum_s F[v, t, s] (K M^T)[s, v]
                read = torch.einsum("bhvts,bhsp,bhvp->bhtv", f[:, :, i], k, m)
            else:
                read = torch.einsum("bhtp,bhvp->bhtv", f[:, :, i], m)
            r = r + sign * read
        signals.append(r)
        w_new = d_end[:, :, i].unsqueeze(-1) * w
        w_new = w_new - torch.einsum("bhtv,bhtp->bhvp", r * last_w[:, :, i], k)
        if s is not None:
            w_new = w_new - carry_end[:, :, i].unsqueeze(-1) * s
            s = theta_end[:, :, i].unsqueeze(-1) * s + torch.einsum(
                "bhtv,bhtp->bhvp", r * last_s[:, :, i], k
            )
        w = w_new
    stacked_s = torch.stack(starts_s, dim=2) if s is not None else None
    return torch.stack(signals, dim=2), torch.stack(starts_w, dim=2), stacked_s, w, s


def functional(outputs, seed: int = 7):
    """A random linear functional of every output that exists."""
    gen = torch.Generator().manual_seed(seed)
    return sum((torch.randn(z.shape, generator=gen, dtype=f64) * z).sum() for z in outputs if z is not None)  # fmt: skip


CASES = {
    # name: (chunks N, rows nc, X, per channel, momentum, solve)
    "per_head": (4, 6, 1, False, False, True),
    "per_head_momentum": (3, 6, 1, False, True, True),
    "one_chunk": (1, 6, 1, False, True, True),
    "rows_not_power_of_2": (3, 7, 1, False, True, True),
    "rows_window_c3": (2, 9, 1, False, True, True),  # n = 3, c = 3
    "gates_per_channel": (3, 5, DV, False, True, True),  # X = Dv, F per head
    "per_channel": (3, 5, DV, True, False, True),
    "per_channel_momentum": (3, 7, DV, True, True, True),
    "per_channel_one_chunk": (1, 5, DV, True, True, True),
    "dot_state_free": (3, 6, 1, False, False, False),
    "dot_momentum": (3, 6, DV, False, True, False),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_scan_forward_and_backward_equal_the_loop(name):
    inputs = make_inputs(*CASES[name])
    got, want = scan_chunks(*inputs), loop_reference(*inputs)
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g, w, **EXACT)
    leaves = [z for z in inputs if z is not None]
    grads = torch.autograd.grad(functional(got), leaves)
    want_grads = torch.autograd.grad(functional(want), leaves)
    names = [n for n, z in zip(NAMES, inputs, strict=True) if z is not None]
    for n, g, w in zip(names, grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, **EXACT, msg=lambda m, n=n: f"d/d{n}: {m}")


@pytest.mark.parametrize("per_channel", [False, True])
def test_scan_gradcheck(per_channel):
    """Finite differences on a tiny case, so the loop reference is not the only witness."""
    x = 2 if per_channel else 1
    inputs = make_inputs(2, 3, x, per_channel, True, True, dims=(1, 1, 2, 3))
    present = [i for i, z in enumerate(inputs) if z is not None]

    def f(*leaves):
        args = list(inputs)
        for i, z in zip(present, leaves, strict=True):
            args[i] = z
        r, starts_w, starts_s, w, s = scan_chunks(*args)
        return r, starts_w, starts_s, w, s

    leaves = [inputs[i].detach().requires_grad_(True) for i in present]
    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-8, rtol=1e-6)


def test_scan_gradient_of_unused_outputs():
    """Only the final state used (no gradient reaches r or the chunk starts): still exact."""
    inputs = make_inputs(*CASES["per_head_momentum"])
    leaves = [z for z in inputs if z is not None]
    got = torch.autograd.grad(scan_chunks(*inputs)[3].sum(), leaves)
    want = torch.autograd.grad(loop_reference(*inputs)[3].sum(), leaves)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **EXACT)


def test_scan_refuses_partial_momentum():
    inputs = make_inputs(*CASES["per_head_momentum"])
    inputs[NAMES.index("theta_end")] = None
    with pytest.raises(ValueError, match="s0, last_s, carry_end, theta_end"):
        scan_chunks(*inputs)
