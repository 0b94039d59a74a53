"""An empty batch (B = 0) through the runtime: every shipped spec on every backend and chunk
mode, and so every execution form of `miras.runtime.forms.FORMS`.

The contract (`helpers.assert_empty_batch`, docs/ops.md) holds B = 0 to the same call at
B = 1: where B = 1 runs, B = 0 returns outputs and final states of B = 1's shapes with batch
0, and zero gradients wherever B = 1 has one; where B = 1 raises a ValueError (a backend or
chunk mode that does not apply to the spec), B = 0 raises the same one. B = 0 also runs the
same execution forms as B = 1 (recorded at each form's entry), and a test below checks that
the cases reach every form in the registry, so a new form cannot miss the contract.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch

import miras
from miras.runtime import forms
from miras.runtime.triton_launch import launcher
from tests.helpers import assert_empty_batch, random_inputs

ROOT = Path(__file__).resolve().parents[2]
SPECS = sorted([*ROOT.glob("specs/*.yaml"), *ROOT.glob("specs/examples/*.yaml")])
# (backend, chunk_mode): every backend with the compiled form and with the chunk-start one.
RUNS = [
    ("recurrent", "auto"),
    ("chunk", "auto"),
    ("chunk", "start"),
    ("triton", "auto"),
    ("triton", "start"),
]
T, H, D, CHUNK = 5, 2, 8, 4  # T odd and above the chunk: a full chunk and a partial one
# The triton backend's B = 1 references run in Triton's interpreter (1 to 6 s each on 2 cores,
# 70 s in all): the fast suite and `make test` keep the linear and exact-scan kernels
# (gated_deltanet), the general ones (logcosh_deltanet) and two refusals (mesanet, titans);
# the rest are slow and extended (`make test-extended`).
FAST_TRITON = {"gated_deltanet", "logcosh_deltanet", "mesanet", "titans"}
# One case per form of the registry: (spec, backend, chunk_mode) that runs it.
FORM_CASES = {
    "attention": ("attention", "chunk", "auto"),
    "minimizer": ("mesanet", "chunk", "auto"),
    "recurrent": ("gated_deltanet", "recurrent", "auto"),
    "exact": ("gated_deltanet", "chunk", "auto"),
    "dual": ("titans", "chunk", "auto"),
    "start": ("titans", "chunk", "start"),
    "exact_triton": ("gated_deltanet", "triton", "auto"),
    "triton": ("gated_deltanet", "triton", "start"),
}

pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def rule_of(name: str):
    path = next(p for p in SPECS if p.stem == name)
    return miras.compile(path)


def inputs(rule, batch: int):
    """q, k, v and in-range gates at `batch` rows, T tokens; with n keys per token
    (`keys: per_step`, DeltaProduct) k, v and the per-step gates packed [B, T*n, ...]."""
    n = rule.spec.optimizer.steps_per_token()
    per_step = rule.spec.optimizer.per_step_inputs()
    q, k, v, gates = random_inputs(rule, b=batch, t=T * n, h=H, dk=D, dv=D, dtype=torch.float32)
    if "k" not in per_step:
        k, v = k[:, ::n], v[:, ::n]
    gates = {name: g if name in per_step else g[:, ::n] for name, g in gates.items()}
    return q[:, ::n], k, v, gates


def rule_call(rule, backend: str, mode: str):
    """call(batch) for `assert_empty_batch`: the rule on `backend`, then again from its final
    state (the carried state at that batch); the leaves are every input and parameter."""

    def call(batch: int):
        q, k, v, gates = inputs(rule, batch)
        params = rule.default_params(torch.float32)
        leaves = {"q": q, "k": k, "v": v}
        leaves |= {f"gates[{n!r}]": g for n, g in gates.items()}
        leaves |= {f"params[{n!r}]": p for n, p in params.items()}
        for x in leaves.values():
            x.requires_grad_(True)
        options = dict(backend=backend, chunk_mode=mode, chunk_size=CHUNK, params=params)
        o, final = rule(q, k, v, gates, output_final_state=True, **options)
        outputs = {"o": o, "final": final}
        if final is not None:
            o2, final2 = rule(
                q, k, v, gates, initial_state=final, output_final_state=True, **options
            )
            outputs |= {"o carried": o2, "final carried": final2}
        return outputs, leaves

    return call


@pytest.fixture
def ran_forms(monkeypatch):
    """The names of the execution forms run since the fixture started, in order."""
    ran: list[str] = []
    for name, form in list(forms.FORMS.items()):

        def forward(call, form=form):
            ran.append(form.name)
            return form.forward(call)

        monkeypatch.setitem(forms.FORMS, name, dataclasses.replace(form, forward=forward))
    return ran


def cases():
    """pytest params (spec name, backend, chunk mode): every spec with every run."""
    params = []
    for path in SPECS:
        for backend, mode in RUNS:
            slow = backend == "triton" and path.stem not in FAST_TRITON
            marks = [pytest.mark.slow, pytest.mark.extended] if slow else []
            case = (path.stem, backend, mode)
            params.append(pytest.param(*case, marks=marks, id="-".join(case)))
    return params


@pytest.mark.parametrize("name,backend,mode", cases())
def test_rule_at_empty_batch(name, backend, mode, ran_forms):
    """Every spec, backend and chunk mode: B = 0 against B = 1, through the same forms."""
    call = rule_call(rule_of(name), backend, mode)
    calls: list[list[str]] = []

    def recorded(batch: int):
        ran_forms.clear()
        try:
            return call(batch)
        finally:
            calls.append(list(ran_forms))

    assert_empty_batch(recorded)
    one, zero = calls
    assert zero == one


@pytest.mark.parametrize("form", list(forms.FORMS))
def test_every_form_runs_at_empty_batch(form, ran_forms):
    """Each form of the registry has a case above that runs it at B = 0 (a new form without
    one fails here: add it to FORM_CASES)."""
    assert form in FORM_CASES, f"form {form!r}: add a (spec, backend, chunk_mode) that runs it"
    name, backend, mode = FORM_CASES[form]
    assert (backend, mode) in RUNS and name in [p.stem for p in SPECS]
    out, _ = rule_call(rule_of(name), backend, mode)(0)
    assert form in ran_forms
    assert out["o"].shape == (0, T, H, D)


def test_packed_sequences_need_one_row():
    """cu_seqlens packs sequences into one row: B = 0 is refused by name, as any B != 1."""
    rule = rule_of("gated_deltanet")
    q, k, v, gates = inputs(rule, 0)
    with pytest.raises(ValueError, match=r"cu_seqlens: packed sequences need B = 1.*got B = 0"):
        rule(q, k, v, gates, cu_seqlens=torch.tensor([0, 2, T]))


def test_empty_batch_without_tokens_is_refused_as_any_batch():
    """T = 0 is refused at B = 0 as at any batch (no token to run)."""
    rule = rule_of("gated_deltanet")
    q, k, v, gates = inputs(rule, 0)
    empty = {n: g[:, :0] for n, g in gates.items()}
    with pytest.raises(ValueError, match=r"at least one token \(T >= 1\)"):
        rule(q[:, :0], k[:, :0], v[:, :0], empty)


def test_launcher_skips_a_grid_without_programs():
    """An empty grid (B*H = 0) launches nothing, not even the autotuner: the kernel is never
    indexed. Any other grid reaches it."""

    class Kernel:
        configs = ()

        def __getitem__(self, grid):
            raise AssertionError(f"launched with grid {grid}")

    assert launcher(Kernel(), (0, 3))(torch.empty(0), BT=16) is None
    with pytest.raises(AssertionError, match=r"grid \(2, 3\)"):
        launcher(Kernel(), (2, 3))
