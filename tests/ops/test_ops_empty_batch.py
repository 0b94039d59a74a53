"""An empty batch (B = 0) through every fla-style op of `miras.ops`, on every backend.

The ops are read from `miras.ops.__all__` (every `chunk_*` name) and their inputs built from
their signatures by argument name (fla's names: q, k, v, g, beta, lamb, num_householder), so
a new op is covered as it is exported; one with a required argument not named here fails,
asking for it. The contract is `helpers.assert_empty_batch` (docs/ops.md): B = 0 against the
same call at B = 1, the final state fed back once as the initial state.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from miras import ops
from tests.helpers import assert_empty_batch

OPS = [name for name in ops.__all__ if name.startswith("chunk_")]
BACKENDS = ("recurrent", "chunk", "triton")
T, H, K, V, STEPS = 5, 2, 8, 8, 2  # STEPS: num_householder, DeltaProduct's steps per token

pytestmark = pytest.mark.usefixtures("one_thread")


def required(op) -> list[str]:
    """The op's arguments without a default."""
    return [
        name
        for name, p in inspect.signature(op).parameters.items()
        if p.default is inspect.Parameter.empty and p.kind is not p.VAR_KEYWORD
    ]


PER_KEY_DECAY = ("chunk_kda", "chunk_gdn2")  # g [B, T, H, K]


def arguments(op, batch: int, gen: torch.Generator) -> dict:
    """Every required argument of `op` at `batch` rows, in fla's layout and ranges."""
    names = required(op)
    n = STEPS if "num_householder" in names else 1  # k, v, beta packed [B, T*n, ...]
    makers = {
        "q": lambda: torch.randn(batch, T, H, K, generator=gen),
        "k": lambda: torch.randn(batch, T * n, H, K, generator=gen),
        "v": lambda: torch.randn(batch, T * n, H, V, generator=gen),
        "g": lambda: -torch.rand(batch, T, H, generator=gen),  # log-decays <= 0
        "beta": lambda: torch.rand(batch, T * n, H, generator=gen),
        "lamb": lambda: 0.5 + torch.rand(H, K, generator=gen),  # MesaNet's ridge, > 0
        "num_householder": lambda: n,
        "b": lambda: 0.5 + torch.rand(batch, T, H, generator=gen),  # GDN-2's erase, > 0
        "w": lambda: torch.rand(batch, T, H, V, generator=gen),  # GDN-2's write gate
        "g_atk": lambda: -torch.rand(batch, T, H, generator=gen),  # the preconditioner's decay
        "beta_atk": lambda: torch.rand(batch, T, H, generator=gen),  # its weight, >= 0
        # TTT-linear's LayerNorm weight and bias [H, V] (shared by the rows) and learning rate
        # [B, T, H, 1], one per mini-batch (here one for all T < 16 tokens)
        "w_ln": lambda: 1 + 0.1 * torch.randn(H, V, generator=gen),
        "b_ln": lambda: 0.1 * torch.randn(H, V, generator=gen),
        "eta": lambda: torch.full((batch, T, H, 1), 0.1),
        # Titans-linear's learning rate and forget gate [B, T, H, 1] (eta: its momentum)
        "theta": lambda: torch.full((batch, T, H, 1), 0.02),
        "alpha": lambda: torch.full((batch, T, H, 1), 0.05),
    }
    if op.__name__ in PER_KEY_DECAY:  # its own layout: a log-decay per key channel
        makers["g"] = lambda: -torch.rand(batch, T, H, K, generator=gen)
    if op.__name__ in ("chunk_ttt_linear", "chunk_titans_linear"):  # w, b: the LayerNorm's
        makers["w"], makers["b"] = makers["w_ln"], makers["b_ln"]
    unknown = [name for name in names if name not in makers]
    assert not unknown, f"{op.__name__}: add an input for {unknown} to `arguments`"
    return {name: makers[name]() for name in names}


def op_call(op, backend: str):
    """call(batch) for `assert_empty_batch`: the op with output_final_state, then again from
    the final state it returned; the leaves are its tensor arguments."""
    parameters = inspect.signature(op).parameters

    def call(batch: int):
        args = arguments(op, batch, torch.Generator().manual_seed(0))
        leaves = {n: x.requires_grad_(True) for n, x in args.items() if isinstance(x, torch.Tensor)}
        out = op(**args, output_final_state=True, backend=backend)
        if "initial_A_state" in parameters:  # chunk_precond_gated_delta_rule: (o, S, A)
            carried = op(**args, initial_state=out[1], initial_A_state=out[2],
                         output_final_state=True, backend=backend)  # fmt: skip
        elif "initial_state_bias" in parameters:  # chunk_ttt_linear: (o, h, hb)
            carried = op(**args, initial_state=out[1], initial_state_bias=out[2],
                         output_final_state=True, backend=backend)  # fmt: skip
        elif "initial_state" in parameters:
            carried = op(**args, initial_state=out[1], output_final_state=True, backend=backend)
        else:  # chunk_mesa_net: (o, h_kk, h_kv)
            carried = op(**args, h_kk_init=out[1], h_kv_init=out[2], output_final_state=True,
                         backend=backend)  # fmt: skip
        return {"out": out, "carried": carried}, leaves

    return call


def test_ops_are_found():
    assert {"chunk_delta_rule", "chunk_gated_delta_rule", "chunk_mesa_net"} <= set(OPS)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", OPS)
def test_op_at_empty_batch(name, backend):
    """Every op on every backend: B = 0 against B = 1 (mesanet's refusal of triton too)."""
    op = getattr(ops, name)
    one, zero = assert_empty_batch(op_call(op, backend))
    if not isinstance(one, ValueError):
        _, leaves, grads = zero
        for arg, leaf in leaves.items():
            if leaf.shape[:1] != (0,):  # shared by the rows (MesaNet's lamb): zeros, not None
                assert grads[arg] is not None and grads[arg].shape == leaf.shape, arg


def test_packed_op_at_empty_batch_names_cu_seqlens():
    """cu_seqlens needs one row (B = 1): B = 0 is refused by name."""
    args = arguments(ops.chunk_gated_delta_rule, 0, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"cu_seqlens: packed sequences need B = 1.*got B = 0"):
        ops.chunk_gated_delta_rule(**args, cu_seqlens=torch.tensor([0, 2, T]))
