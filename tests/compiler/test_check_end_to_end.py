"""The end-to-end stage of `miras check`: every shipped spec passes it, and it catches what the
piece checks missed (NaN through the window's padding, a Newton solve from F'' = 0) and an
injected defect, naming the first token and piece."""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

import miras
from miras.checks.end_to_end import (
    PIECES,
    _first_piece_off,
    argmin_rows,
    argmin_separable,
    check_end_to_end,
    oracle,
    replay,
    step_inputs,
    triton_reason,
)
from miras.checks.inputs import random_inputs, sizes_for
from miras.cli import app
from miras.runtime import recurrent

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "specs").glob("*.yaml")) + sorted((ROOT / "specs/examples").glob("*.yaml"))

# Defect 1 of issue 10: the c - 1 padded slots carried gate a = 0, so tanh(e/a) was 0/0.
LOGCOSH_WINDOW_2 = {**yaml.safe_load((ROOT / "specs/examples/logcosh_deltanet.yaml").read_text())}
LOGCOSH_WINDOW_2["window"] = 2
# Defect 2: Newton steps on F'(w) = z from W_0 = 0, where F''(0) = 0 for F = w^4/4.
QUARTIC_NEWTON = {
    "name": "quartic_newton",
    "memory": "matrix",
    "bias": "l2",
    "retention": {"kind": "bregman", "solver": "newton", "potential": "w**4/4"},
    "optimizer": "gd",
}


def _failures(results):
    return [f"{r.piece}: {r.error:.3g} > {r.tolerance:.0e}" for r in results if not r.passed]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_spec_passes_end_to_end(path):
    rule = miras.compile(path, checked=False)
    results = check_end_to_end(rule, triton=False)
    backends = {"recurrent", "chunk"}
    assert {r.piece.split()[1].rstrip(",") for r in results} == backends
    assert not _failures(results)


@pytest.mark.parametrize("path", ["specs/examples/logcosh_deltanet.yaml", "specs/swla.yaml"])
def test_triton_backend_passes_end_to_end(path):
    """The Triton backend too (in the interpreter on the CPU: two specs, tiny sizes)."""
    results = check_end_to_end(miras.compile(ROOT / path, checked=False))
    assert [r.piece.split()[1].rstrip(",") for r in results] == ["recurrent", "chunk", "triton"]
    assert not _failures(results)


@pytest.mark.parametrize(
    "path",
    [
        "specs/gated_deltanet.yaml",
        "specs/omeganet.yaml",
        "specs/yaad.yaml",
        "specs/ttt_linear.yaml",
    ],
)
def test_per_channel_gates_pass_end_to_end(path):
    """Gates [B, T, H, Dv] where the runtime takes them per channel (a bias's gate, also inside
    a whole-vector loss's sums: the LayerNorm's weight and bias; every gate but gamma for a
    matrix memory)."""
    rule = miras.compile(ROOT / path, checked=False)
    *_, gates = random_inputs(rule, sizes_for(rule), seed=0, per_channel=True)
    assert any(g.dim() == 4 for g in gates.values())
    results = check_end_to_end(rule, triton=False, per_channel=True)
    assert all("per-channel gates" in r.piece for r in results)
    assert not _failures(results)


@pytest.mark.parametrize("spec", [LOGCOSH_WINDOW_2, QUARTIC_NEWTON], ids=["window_pad", "newton"])
def test_regressions_of_issue_10_pass_end_to_end(spec):
    """Both gave NaN from token 0 before their fixes; the stage named the token and piece
    ('bias gradient at token 0' and 'retention step at token 0')."""
    results = check_end_to_end(miras.compile(spec, checked=False))
    assert not _failures(results)


def test_rule_check_includes_the_stage():
    results = miras.compile(ROOT / "specs/deltanet.yaml").check(triton=False)
    assert [r.piece for r in results if r.piece.startswith("end-to-end")]
    assert all(r.passed for r in results)


def test_triton_is_left_out_with_its_reason_where_it_cannot_run(monkeypatch):
    """No CUDA and no interpreter asked for: `miras check` runs the other backends, says why
    Triton was not run, and passes (it used to stop on a raw ValueError from the backend)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rule = miras.compile(ROOT / "specs/deltanet.yaml", checked=False)
    assert "TRITON_INTERPRET=1" in triton_reason(rule)
    assert [r.piece.split()[1] for r in check_end_to_end(rule)] == ["recurrent", "chunk"]
    result = CliRunner().invoke(app, ["check", str(ROOT / "specs/deltanet.yaml")])
    assert result.exit_code == 0, result.output
    assert "end-to-end triton: not run (no CUDA device here" in result.output
    assert "the Triton backend does not cover" in triton_reason(
        miras.compile(ROOT / "specs/moneta.yaml", checked=False)
    )


# The stage catches an injected defect ---------------------------------------------------------


def _inject(monkeypatch, corrupt):
    """Make the recurrent backend's optimizer step wrong at token 3 only."""
    original = recurrent.optimizer_step

    def optimizer_step(rt, grads, state, gates, t):
        updates = original(rt, grads, state, gates, t)
        return {n: corrupt(u) for n, u in updates.items()} if t == 3 else updates

    monkeypatch.setattr(recurrent, "optimizer_step", optimizer_step)


@pytest.mark.parametrize(
    "corrupt, what",
    [(lambda u: u * (1 + 1e-6), "off from token 3"), (lambda u: u * math.nan, "non-finite")],
    ids=["small_error", "nan"],
)
def test_injected_defect_is_reported_at_its_token_and_piece(monkeypatch, corrupt, what):
    _inject(monkeypatch, corrupt)
    rule = miras.compile(ROOT / "specs/gated_deltanet.yaml", checked=False)
    recurrent_result, chunk_result = check_end_to_end(rule, triton=False)
    assert not recurrent_result.passed
    assert what in recurrent_result.piece
    assert "optimizer at token 3" in recurrent_result.piece
    if what == "non-finite":
        assert "non-finite output from token 3" in recurrent_result.piece
    assert chunk_result.passed  # the chunk backend does not call the patched step


# The replay: the runtime's own step, recorded through the recurrent form's hook ---------------


def _replayed(name: str, seed: int = 0):
    rule = miras.compile(ROOT / f"specs/{name}.yaml", checked=False)
    q, k, v, gates = random_inputs(rule, sizes_for(rule), seed)
    return rule, (q, k, v, gates)


@pytest.mark.parametrize("name", ["gated_deltanet", "deltaproduct"])
def test_replay_records_every_piece_of_every_step_as_the_oracle_takes_them(name):
    rule, inputs = _replayed(name)
    trace = replay(rule, *inputs)
    steps = rule.spec.optimizer.steps_per_token() * inputs[0].shape[1]  # n steps per token
    assert len(trace.pieces) == steps and all(set(p) == set(PIECES) for p in trace.pieces)
    assert trace.first_nonfinite is None
    assert _first_piece_off(trace, oracle(rule, *step_inputs(rule, *inputs))) is None
    o, final = rule(*inputs, backend="recurrent", output_final_state=True)
    n = rule.spec.optimizer.steps_per_token()
    torch.testing.assert_close(trace.outputs.transpose(1, 2)[:, n - 1 :: n], o)
    final = final if isinstance(final, dict) else {"W": final}
    assert set(trace.final) == set(final)
    for key, value in final.items():
        torch.testing.assert_close(trace.final[key], value)


def test_replay_leaves_the_recurrent_forward_in_place(monkeypatch):
    """Seen from inside the replay's steps, `miras.runtime.recurrent.forward` is still the
    module's own function: the replay records through a hook, it patches no module global."""
    forward, step = recurrent.forward, recurrent.step
    seen = []

    def observing_step(*args, **kwargs):
        seen.append(recurrent.forward is forward)
        return step(*args, **kwargs)

    monkeypatch.setattr(recurrent, "step", observing_step)
    rule, inputs = _replayed("gated_deltanet")
    replay(rule, *inputs)
    assert seen and all(seen), f"recurrent.forward was replaced in {seen.count(False)} steps"


def test_two_replays_in_threads_interleave_and_each_records_its_own(monkeypatch):
    """Both replays are inside their first step at once (a barrier there); each trace is the
    one a replay alone records, and recurrent.forward is the module's own afterwards."""
    rule, first = _replayed("gated_deltanet", seed=0)
    _, second = _replayed("gated_deltanet", seed=1)
    alone = [replay(rule, *inputs).outputs for inputs in (first, second)]
    forward, step = recurrent.forward, recurrent.step
    barrier = threading.Barrier(2, timeout=30)

    def meeting_step(rt, seq, state, t, record=None):
        if t == 0:
            barrier.wait()
        return step(rt, seq, state, t, record)

    monkeypatch.setattr(recurrent, "step", meeting_step)
    with ThreadPoolExecutor(2) as pool:
        traces = list(pool.map(lambda inputs: replay(rule, *inputs), (first, second)))
    assert recurrent.forward is forward
    for trace, expected in zip(traces, alone, strict=True):
        torch.testing.assert_close(trace.outputs, expected, rtol=0, atol=0)


def test_the_runtime_records_only_on_the_recurrent_backend():
    rule, inputs = _replayed("gated_deltanet")
    with pytest.raises(
        ValueError, match=r"record: only the recurrent backend .* got backend='chunk'"
    ):
        rule(*inputs, backend="chunk", record=lambda t, piece, value: None)


# The oracle's solvers -------------------------------------------------------------------------


def test_argmin_separable_solves_where_newton_stalls():
    """J = u w + w^4/4 (Bregman w^4/4 from w0 = 0): F''(0) = 0; the minimizer is -cbrt(u)."""
    u = torch.tensor([-2.0, -0.3, 0.0, 1e-3, 0.7, 5.0], dtype=torch.float64)
    w0 = torch.zeros_like(u)
    found = argmin_separable(lambda w: u * w + w**4 / 4, w0, u, "real")
    expected = -torch.sign(u) * u.abs() ** (1 / 3)
    assert torch.allclose(found, expected, rtol=1e-13, atol=1e-15)


def test_argmin_rows_is_the_scaled_softmax():
    """KL with the row sum c: argmin_w sum_j u_j w_j + w_j log(w_j / w0_j) = c softmax(log w0 - u)."""
    gen = torch.Generator().manual_seed(1)
    w0 = torch.softmax(torch.randn(3, 5, dtype=torch.float64, generator=gen), -1) * 2.0
    u = 3 * torch.randn(3, 5, dtype=torch.float64, generator=gen)
    found = argmin_rows(lambda w: u * w + w * torch.log(w / w0), w0, u, 2.0)
    expected = 2.0 * torch.softmax(torch.log(w0) - u, -1)
    assert torch.allclose(found, expected, rtol=1e-12, atol=1e-15)


def test_oracle_window_reads_no_token_before_the_first():
    """At token 0 with c = 4, the oracle's gradient is the one term of token 0 alone."""
    rule = miras.compile(ROOT / "specs/omeganet.yaml", checked=False)
    q, k, v, gates = random_inputs(rule, sizes_for(rule), seed=0)
    trace = oracle(rule, q, k, v, gates)
    # W_0 = 0, so y = 0 and dL/dW = (y - v) phi(k)^T = -v phi(k)^T, times gamma_0.
    phi_k = rule.runtime.feature(k.transpose(1, 2), rule.default_params(torch.float64))
    gamma = gates["gamma"].transpose(1, 2)[:, :, 0, None, None]
    expected = -gamma * v.transpose(1, 2)[:, :, 0, :, None] * phi_k[:, :, 0, None, :]
    assert torch.allclose(trace.pieces[0]["bias gradient"]["W"], expected, atol=1e-15)


def test_a_saturated_unit_interval_state_keeps_its_relative_precision():
    """Binary entropy's step is sigmoid(logit(w0) - u). Sought in w, the oracle's root stopped
    at the bisection's absolute floor (a state of 7e-18 came out as 2.8e-14), so the next
    token's step was off by 0.28 and `miras check` failed a correct rule (taylor features, lp
    bias, bregman retention, window 3: found by tests/spec/test_spec_fuzz.py)."""
    from miras.checks.end_to_end import argmin_separable

    w0 = torch.tensor([0.3, 1e-15, 0.5, 1 - 1e-9], dtype=torch.float64)
    u = torch.tensor([0.5, 20.0, -30.0, -3.0], dtype=torch.float64)

    def objective(w, w0=w0, u=u):  # <u, w> + D_F(w, w0), F binary entropy
        def f(x):
            return x * torch.log(x) + (1 - x) * torch.log(1 - x)

        return u * w + f(w) - f(w0) - (torch.log(w0) - torch.log(1 - w0)) * (w - w0)

    found = argmin_separable(objective, w0, u, "unit_interval")
    expected = torch.sigmoid(torch.logit(w0) - u)
    torch.testing.assert_close(found, expected, rtol=1e-12, atol=0)


def test_check_passes_a_binary_entropy_rule_that_saturates():
    rule = miras.compile(
        {
            "name": "saturates",
            "feature_map": "taylor",
            "bias": "lp",
            "retention": "bregman",
            "window": 3,
        }
    )
    results = rule.check(triton=False)
    assert all(r.passed for r in results), [r.piece for r in results if not r.passed]
