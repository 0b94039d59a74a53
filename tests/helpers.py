"""Shared test inputs (random q, k, v and in-range gates for a compiled rule) and a chunk run
with the gradients of every input."""

from __future__ import annotations

import torch

from miras.components.base import HALF_OPEN_UNIT, UNIT
from miras.runtime import per_channel_gates

# A deep rule that exercises every chunk piece at once: a gated MLP memory, a gated Huber bias,
# l2 retention, momentum and an Omega window of 2 with a gamma gate.
GATED_MOMENTUM = {
    "name": "gated_momentum",
    "memory": {"kind": "gated_mlp", "expansion": 2},
    "bias": {"kind": "huber", "delta": "gate"},
    "retention": "l2",
    "optimizer": "momentum",
    "window": {"c": 2, "gamma": "gate"},
}


def random_inputs(
    rule, *, b=2, t=13, h=2, dk=4, dv=4, per_channel=False, seed=0, dtype=torch.float64
):
    """q, k (l2-normalized rows, as the layer feeds them), v and gates in their ranges; with
    `per_channel`, [B, T, H, Dv] for every gate the rule takes per channel."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=gen, dtype=dtype), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(b, t, h, dv, generator=gen, dtype=dtype)
    gates = {}
    channels = per_channel_gates(rule) if per_channel else set()
    for info in rule.plan.gates:
        shape = (b, t, h, dv) if info.name in channels else (b, t, h)
        r = torch.rand(*shape, generator=gen, dtype=dtype)
        if info.allowed == UNIT:
            gates[info.name] = 0.8 + 0.2 * r  # a decay
        elif info.allowed == HALF_OPEN_UNIT:
            gates[info.name] = 0.9 * r  # a momentum
        else:
            gates[info.name] = 0.1 + 0.4 * r  # a learning rate, threshold, scale
    return q, k, v, gates


def chunk_grads(rule, q, k, v, gates, init, params, *, chunk_size, chunk_mode, backend="chunk"):
    """o, the final state and the gradients of a random projection of both, w.r.t. q, k, v,
    every gate, every initial state and every param (None where unused), named; on `backend`
    (the chunk backend by default)."""
    leaves = [q, k, v, *gates.values(), *init.values(), *params.values()]
    for x in leaves:
        x.requires_grad_(True)
    o, final = rule(
        q,
        k,
        v,
        gates,
        backend=backend,
        chunk_mode=chunk_mode,
        chunk_size=chunk_size,
        initial_state=init,
        output_final_state=True,
        params=params,
    )
    names = ["q", "k", "v", *gates, *(f"state {n}" for n in init), *params]
    return o, final, projection_grads(o, final, leaves, names)


def projection_grads(o, final, leaves, names) -> dict:
    """name -> the gradient w.r.t. each of `leaves` (None where unused) of a fixed random
    projection of the output o and of every final state."""
    gen = torch.Generator().manual_seed(9)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum()
    for s in final.values():
        loss = loss + (s * torch.randn(s.shape, generator=gen, dtype=s.dtype)).sum()
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return dict(zip(names, grads, strict=True))


def assert_runs_close(got, want, tol: float) -> None:
    """Two (o, final state, named gradients) runs agree to `tol`: the same state keys and
    gradient names, None in the same places."""
    (o, final, grads), (o_ref, final_ref, grads_ref) = got, want
    torch.testing.assert_close(o, o_ref, rtol=tol, atol=tol)
    assert list(final) == list(final_ref)
    for key in final:
        torch.testing.assert_close(final[key], final_ref[key], rtol=tol, atol=tol, msg=key)
    assert list(grads) == list(grads_ref)
    for key, g in grads.items():
        assert (g is None) == (grads_ref[key] is None), key
        if g is not None:
            torch.testing.assert_close(g, grads_ref[key], rtol=tol, atol=tol, msg=key)


def tiny_mqar_losses(spec_path) -> tuple[float, float, float]:
    """A one-layer model of the spec at `spec_path` (d_model 32) trained 40 steps on MQAR at
    T = 32 (4 pairs): (mean loss of the first 5 steps, of the last 5, the final eval loss)."""
    import miras
    from miras.tasks import make_task

    spec = {**miras.load_spec(spec_path).normalized(), "model": {"d_model": 32, "n_layers": 1}}
    task = make_task("mqar", seq_len=32, num_pairs=4, vocab_size=32)
    result = miras.train(
        spec, task, steps=40, batch_size=16, lr=3.0e-3, warmup=2, eval_every=40,
        eval_batches=1, progress=False,
    )  # fmt: skip
    return sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5, result.metrics["loss"]


# An empty batch (B = 0), held to the same call at B = 1 -----------------------------------------


def flat_tensors(out, path: str = "") -> list[tuple[str, torch.Tensor | None]]:
    """(path, tensor or None) of every leaf of nested tuples, lists and dicts."""
    if isinstance(out, dict):
        return [leaf for name, x in out.items() for leaf in flat_tensors(x, f"{path}[{name!r}]")]
    if isinstance(out, (tuple, list)):
        return [leaf for i, x in enumerate(out) for leaf in flat_tensors(x, f"{path}[{i}]")]
    return [(path, out if isinstance(out, torch.Tensor) else None)]


def attempt_batch(call, batch: int):
    """`call(batch)` -> (outputs, leaves: name -> tensor), then the gradient of the sum of every
    floating output w.r.t. each leaf (None where unused). Returns (outputs, leaves, grads), or
    the ValueError the call raised."""
    try:
        out, leaves = call(batch)
    except ValueError as error:
        return error
    floats = [x for _, x in flat_tensors(out) if x is not None and x.requires_grad]
    loss = sum(x.sum() for x in floats)
    names = [n for n, x in leaves.items() if x.requires_grad]
    grads = [None] * len(names)
    if floats:
        grads = torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)
    return out, leaves, dict(zip(names, grads, strict=True))


def assert_empty_batch(call):
    """The empty-batch contract (docs/ops.md, docs/models.md): `call(0)` against `call(1)`.

    Where B = 1 raises a ValueError, B = 0 raises the same one. Otherwise every output (each
    batch-first) has B = 1's shape with batch 0, and every leaf with a gradient at B = 1 has
    one at B = 0 (not None): of the leaf's shape, all zeros (empty for the batch's own
    inputs; zeros of the parameter's shape for what the rows share). Returns both runs."""
    one, zero = attempt_batch(call, 1), attempt_batch(call, 0)
    if isinstance(one, ValueError):
        assert isinstance(zero, ValueError), f"B = 1 raised {one!r}, B = 0 did not"
        assert str(zero) == str(one)
        return one, zero
    if isinstance(zero, ValueError):
        raise AssertionError(f"B = 0 raised where B = 1 runs: {zero}") from zero
    (out1, _, grads1), (out0, leaves0, grads0) = one, zero
    leaves1, leaves0_ = flat_tensors(out1), flat_tensors(out0)
    assert [p for p, _ in leaves0_] == [p for p, _ in leaves1]
    for (path, x0), (_, x1) in zip(leaves0_, leaves1, strict=True):
        assert (x0 is None) == (x1 is None), path
        if x0 is not None:
            assert tuple(x0.shape) == (0, *x1.shape[1:]), path
    assert list(grads0) == list(grads1)
    for name, g0 in grads0.items():
        if grads1[name] is None:
            continue
        assert g0 is not None, f"{name}: a gradient at B = 1, None at B = 0"
        assert g0.shape == leaves0[name].shape, name
        assert torch.count_nonzero(g0) == 0, name
    return one, zero
