"""The exact chunk form in segments (`exact_chunk.forward` on the CPU): a long sequence runs as
segments of whole chunks, each from the state the previous one ended in. Cutting only between
chunks, it computes the same chunks: outputs, final states and gradients equal the
unsegmented run, with momentum, a carried window and per-channel gates."""

from __future__ import annotations

import pytest
import torch

import miras
from miras.runtime import exact_chunk
from tests.helpers import projection_grads, random_inputs

pytestmark = pytest.mark.usefixtures("one_thread")

f64 = torch.float64
CASES = {
    "gated_deltanet": (dict(bias="l2", retention={"kind": "l2", "grad_at": "retained"}), False),
    "momentum_window3": (
        dict(bias="l2", retention="l2", optimizer="momentum", window={"c": 3, "gamma": "gate"}),
        False,
    ),
    "per_channel_momentum_window2": (
        dict(bias="l2", retention="l2", optimizer="momentum", window={"c": 2, "gamma": 0.7}),
        True,
    ),
    "retnet_dot": (dict(bias="dot", retention="l2"), False),
}


def _run(name: str, monkeypatch, segment: int | None):
    """o, the final state and gradients at chunk 4 over T = 23 (6 chunks, the last of 3
    tokens), in segments of `segment` chunks (None: one segment); and the segments run."""
    fields, per_channel = CASES[name]
    rule = miras.compile({"name": name, **fields})
    q, k, v, gates = random_inputs(rule, b=2, t=23, h=2, dk=5, dv=3, per_channel=per_channel)
    default = rule.initial_state(2, 2, 5, 3, f64)
    default = default if isinstance(default, dict) else {"W": default}
    gen = torch.Generator().manual_seed(3)
    init = {n: 0.3 * torch.randn(s.shape, generator=gen, dtype=f64) for n, s in default.items()}
    with monkeypatch.context() as patch:
        patch.setattr(exact_chunk, "SEGMENT_NUMBERS", 0 if segment else 1 << 40)
        patch.setattr(exact_chunk, "MIN_SEGMENT_CHUNKS", segment or 1)
        calls = []
        inner = exact_chunk._forward
        patch.setattr(
            exact_chunk,
            "_forward",
            lambda rt, seq, *a: calls.append(seq.length) or inner(rt, seq, *a),
        )
        leaves = [q, k, v, *gates.values(), *init.values()]
        for x in leaves:
            x.requires_grad_(True)
        o, final = rule(
            q, k, v, gates, backend="chunk", chunk_size=4, chunk_mode="exact",
            initial_state=init if len(init) > 1 else init["W"], output_final_state=True,
        )  # fmt: skip
    final = final if isinstance(final, dict) else {"W": final}
    names = ["q", "k", "v", *gates, *(f"state {n}" for n in init)]
    return (o, final, projection_grads(o, final, leaves, names)), calls


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("segment", [1, 2, 4])
def test_segments_compute_the_unsegmented_run(name, segment, monkeypatch):
    (o, final, grads), calls = _run(name, monkeypatch, segment)
    (o_ref, final_ref, grads_ref), whole = _run(name, monkeypatch, None)
    assert whole == [23]
    rows = 4 * segment
    assert calls == [rows] * (23 // rows) + ([23 % rows] if 23 % rows else [])
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    assert list(final) == list(final_ref)
    for key in final:
        torch.testing.assert_close(final[key], final_ref[key], rtol=1e-12, atol=1e-12, msg=key)
    for key, g in grads.items():
        assert (g is None) == (grads_ref[key] is None), key
        if g is not None:
            torch.testing.assert_close(g, grads_ref[key], rtol=1e-12, atol=1e-12, msg=key)


def _tokens(b: int, h: int, x: int, device: str = "cpu"):
    z = torch.zeros(b, h, 8, 4, device=device)
    gate = torch.zeros(b, h, 8, x, device=device)
    return exact_chunk.Tokens(z, z, z, z[..., :1], {"lr": gate}, {}, 0)


def test_segment_size_follows_the_chunk_matrices():
    # B 2, H 4, chunk 64, per head: 2^18 / (8 * 64^2) = 8 chunks (measured the fastest).
    assert exact_chunk.segment_chunks(_tokens(2, 4, 1), 64, 1) == 8
    # Rows, not tokens: chunks of 32 tokens with a window of 2 are as large.
    assert exact_chunk.segment_chunks(_tokens(2, 4, 1), 32, 2) == 8
    assert exact_chunk.segment_chunks(_tokens(1, 2, 1), 64, 1) == 32
    # Per-channel systems are Dv times larger: the minimum, not one chunk at a time.
    assert exact_chunk.segment_chunks(_tokens(2, 4, 64), 64, 1) == exact_chunk.MIN_SEGMENT_CHUNKS
    # Off the CPU the whole sequence is one segment.
    assert exact_chunk.segment_chunks(_tokens(2, 4, 1, "meta"), 2, 1) == 4
