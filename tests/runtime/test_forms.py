"""The registry of execution forms (miras/runtime/forms.py): which form takes a call, in the
order of precedence `run` relies on, and what it prints. The forms' numerics are held to the
recurrence in tests/runtime/test_form_contract.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from miras.ir import ChunkForm
from miras.runtime import forms
from miras.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
MATRIX = load_spec({"name": "matrix"})
ATTENTION = load_spec({"name": "attention", "memory": "nonparametric", "bias": "l2"})
L2 = ChunkForm("exact", "affine", slope=1.0)  # the delta rule's
DOT = ChunkForm("exact", "affine", slope=0.0)  # the dot bias: the signals do not read W
START = ChunkForm("start", "a huber bias")
DUAL = ChunkForm("dual", "an mlp memory", dual="mlp")
MINIMIZER = ChunkForm("minimizer", "optimizer exact")


@pytest.mark.parametrize(
    ("backend", "mode", "chunk_form", "chunk_size", "spec", "expected"),
    [
        # Closed forms first, on every backend and mode.
        ("chunk", "exact", L2, 16, ATTENTION, "attention"),
        ("recurrent", "start", L2, 16, ATTENTION, "attention"),
        ("recurrent", "minimizer", MINIMIZER, 16, MATRIX, "minimizer"),
        ("chunk", "start", MINIMIZER, 16, MATRIX, "minimizer"),  # which refuses "start" itself
        ("triton", "minimizer", MINIMIZER, 16, MATRIX, "minimizer"),  # and triton
        # The reference, whatever the mode.
        ("recurrent", "exact", L2, 16, MATRIX, "recurrent"),
        ("recurrent", "dual", DUAL, 16, MATRIX, "recurrent"),
        # The chunk backend, by mode.
        ("chunk", "exact", L2, 16, MATRIX, "exact"),
        ("chunk", "exact", L2, 1, MATRIX, "exact"),
        ("chunk", "dual", DUAL, 16, MATRIX, "dual"),
        ("chunk", "start", START, 16, MATRIX, "start"),
        ("chunk", "start", L2, 16, MATRIX, "start"),  # chunk_mode="start" on an exact spec
        ("chunk", "start", DUAL, 16, MATRIX, "start"),  # the per-token path of a dual spec
        # Triton: the exact scan where the exact form needs one, else the emitted kernels.
        ("triton", "exact", L2, 16, MATRIX, "exact_triton"),
        ("triton", "exact", L2, 1, MATRIX, "triton"),  # b = 1: one model
        ("triton", "exact", DOT, 16, MATRIX, "triton"),  # slope 0: one model
        ("triton", "start", START, 16, MATRIX, "triton"),
        ("triton", "dual", DUAL, 16, MATRIX, "triton"),
    ],
)
def test_the_first_form_that_takes_the_call_runs_it(
    backend, mode, chunk_form, chunk_size, spec, expected
):
    assert forms.select(backend, mode, chunk_form, chunk_size, spec).name == expected


def test_a_call_no_form_takes_is_refused_naming_the_forms():
    with pytest.raises(ValueError, match="no execution form of spec 'matrix' runs") as err:
        forms.select("chunk", "minimizer", L2, 16, MATRIX)
    assert "backend='chunk' with chunk mode 'minimizer'" in str(err.value)
    assert ", ".join(forms.FORMS) in str(err.value)


def test_the_registry_prints_every_form_in_order():
    lines = forms.table().splitlines()
    assert [line.split()[0] for line in lines] == list(forms.FORMS)
    assert list(forms.FORMS) == [
        "attention", "minimizer", "recurrent", "exact", "dual", "start", "exact_triton", "triton",
    ]  # fmt: skip
    assert "triton/" not in lines[2] and "exact " in lines[3] and "start" in lines[5]


@pytest.mark.parametrize(
    ("chunk_mode", "chunk_form", "expected"),
    [
        ("auto", L2, "exact"),
        ("auto", START, "start"),
        ("auto", DUAL, "dual"),
        ("auto", MINIMIZER, "minimizer"),
        ("start", L2, "start"),
        ("start", DUAL, "start"),
        ("exact", L2, "exact"),
    ],
)
def test_resolve_mode(chunk_mode, chunk_form, expected):
    mode = forms.resolve_mode(chunk_mode, chunk_form, "s")
    assert mode == expected
    assert forms.is_exact(mode) == (expected in ("exact", "minimizer"))


def test_resolve_mode_refuses_with_the_reason():
    with pytest.raises(ValueError, match="chunk_mode: expected one of auto, start, exact, got 'x'"):
        forms.resolve_mode("x", L2, "s")
    with pytest.raises(
        ValueError, match="chunk_mode: 'exact' is not available for spec 's': a huber bias; use"
    ):
        forms.resolve_mode("exact", START, "s")


def test_only_a_triton_form_imports_triton():
    """Every form is registered at import, but triton loads only when a triton form runs: a
    chunk and a recurrent run in a fresh interpreter leave it unloaded."""
    code = (
        "import sys, torch, miras\n"
        "rule = miras.compile({'name': 'g', 'bias': 'l2', 'retention': 'l2'})\n"
        "q = torch.nn.functional.normalize(torch.randn(1, 5, 1, 4), dim=-1)\n"
        "gates = {'lr': torch.full((1, 5, 1), 0.3), 'decay': torch.full((1, 5, 1), 0.9)}\n"
        "for backend in ('chunk', 'recurrent'):\n"
        "    rule(q, q, q, gates, backend=backend, chunk_size=2)\n"
        "print('triton' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert done.stdout.split()[-1] == "False"
