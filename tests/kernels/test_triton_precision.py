"""The Triton backend's numerics: the tl.dot input precision (stated on every product, chosen
by an argument or MIRAS_TRITON_PRECISION, checked in the compiled PTX), decay factors under
strong decay, and float32 buffers behind half-precision inputs (docs/kernels.md, "Precision").

The kernels run under the interpreter on a CPU, which multiplies in float32 whatever the
precision says; what a GPU does with it is read from the PTX of a kernel compiled for sm_80
ahead of time (the Triton wheel ships ptxas; no GPU needed).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import miras
from miras.compiler.pipeline import kernel_source
from miras.compiler.triton_kernels import load_kernels
from miras.runtime import triton_backend, triton_launch
from miras.runtime.inputs import (
    DEFAULT_TRITON_PRECISION,
    TRITON_PRECISION_ENV,
    check_triton_precision,
)
from tests.helpers import random_inputs
from tests.kernels.test_triton import _initial_state, _mismatches, _run

TOL = 1e-5  # relative RMS, float32, as tests/kernels/test_triton.py
ROOT = Path(__file__).resolve().parents[2]
GOLDEN = sorted((ROOT / "tests" / "golden").glob("*.py.golden"))
EXACT = ROOT / "kernels" / "templates" / "exact.py"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    monkeypatch.delenv(TRITON_PRECISION_ENV, raising=False)
    monkeypatch.setenv(triton_backend.CHECK_ENV, "1")


# The emitted sources --------------------------------------------------------------------------


def _kernels(path: Path) -> list[ast.FunctionDef]:
    return [
        node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)
    ]


def _dots(node: ast.AST) -> list[ast.Call]:
    return [
        call
        for call in ast.walk(node)
        if isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == "dot"
        and isinstance(call.func.value, ast.Name)
        and call.func.value.id == "tl"
    ]


SOURCES = [*GOLDEN, EXACT]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name.split(".")[0])
def test_every_dot_states_the_launchers_precision(path):
    """Every tl.dot passes input_precision=DOT_PRECISION, a constexpr argument of the kernel
    that calls it (the launcher's choice, never Triton's TF32 default nor a module constant)."""
    module = ast.parse(path.read_text())
    assigned = [
        target.id
        for node in module.body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    ]
    assert "DOT_PRECISION" not in assigned
    dots = 0
    for fn in _kernels(path):
        calls = _dots(fn)
        dots += len(calls)
        if not calls:
            continue
        params = {a.arg: a.annotation for a in fn.args.args}
        assert "DOT_PRECISION" in params, fn.name
        assert ast.unparse(params["DOT_PRECISION"]) == "tl.constexpr", fn.name
        for call in calls:
            given = {kw.arg: ast.unparse(kw.value) for kw in call.keywords}
            assert given.get("input_precision") == "DOT_PRECISION", (fn.name, ast.unparse(call))
    assert dots > 0


# Not the exact scan: its products take the inputs' half-precision operands (the operand
# type is the keys' element type), with float32 state and accumulators.
@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.name.split(".")[0])
def test_no_half_precision_in_the_kernels(path):
    """No cast or buffer of the forward or backward kernels is float16 or bfloat16: values go
    through ACC (float32 or float64) and are stored in the buffer's own dtype."""
    text = path.read_text()
    for word in ("float16", "bfloat16", "fp16", "bf16"):
        assert word not in text, word


# The choice, from the argument or the environment ---------------------------------------------


def test_the_choice_is_checked(monkeypatch):
    # The default is fla's: TF32 tensor-core products on float32 tiles (it was "ieee").
    assert check_triton_precision(None) == DEFAULT_TRITON_PRECISION == "tf32"
    assert check_triton_precision("tf32x3") == "tf32x3"
    with pytest.raises(ValueError, match=r"triton_precision: expected one of 'ieee', 'tf32', "):
        check_triton_precision("fp32")
    monkeypatch.setenv(TRITON_PRECISION_ENV, "TF32")
    with pytest.raises(ValueError) as err:
        check_triton_precision(None)
    assert TRITON_PRECISION_ENV in str(err.value) and "did you mean 'tf32'" in str(err.value)
    monkeypatch.setenv(TRITON_PRECISION_ENV, "")  # empty: unset
    assert check_triton_precision(None) == "tf32"
    monkeypatch.setenv(TRITON_PRECISION_ENV, "ieee")  # the accuracy option
    assert check_triton_precision(None) == "ieee"


class _Recorder:
    """Stands in for a kernel: records each launch's constexpr DOT_PRECISION and the dtypes of
    its tensor arguments, then launches the kernel."""

    def __init__(self, kernel, log: list):
        self.kernel, self.log = kernel, log

    def __getitem__(self, grid):
        def launch(*args, **meta):
            dtypes = {a.dtype for a in args if isinstance(a, torch.Tensor)}
            self.log.append((meta["DOT_PRECISION"], dtypes))
            return self.kernel[grid](*args, **meta)

        return launch


def _record_launches(monkeypatch, rule) -> list:
    log: list = []
    module = load_kernels(rule.ir)
    for name in (
        "linear_state",
        "linear_output",
        "linear_state_backward",
        "linear_scores",
        "linear_backward",
        "linear_backward_keys",
        "general_forward",
        "general_backward",
    ):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, _Recorder(getattr(module, name), log))
    from miras.kernels.templates import exact

    for name in ("exact_scan_forward", "exact_scan_backward"):
        monkeypatch.setattr(exact, name, _Recorder(getattr(exact, name), log))
    return log


def _forward_backward(rule, dtype=torch.float32, chunk_mode="start", **options):
    q, k, v, gates = random_inputs(rule, b=1, t=12, h=1, dk=16, dv=16, dtype=dtype)
    leaves = [x.to(DEVICE).requires_grad_(True) for x in (q, k, v, *gates.values())]
    q, k, v, *g = leaves
    o, _ = rule(
        q, k, v, dict(zip(gates, g, strict=True)), backend="triton", chunk_size=8,
        chunk_mode=chunk_mode, **options,
    )  # fmt: skip
    torch.autograd.grad(o.float().square().sum(), leaves)


GDN = {"name": "precision-gdn", "bias": "l2", "retention": {"kind": "l2", "grad_at": "retained"}}


@pytest.mark.parametrize(
    ("argument", "environment", "dtype", "launched"),
    [
        (None, None, torch.float32, "tf32"),
        (None, "ieee", torch.float32, "ieee"),
        ("tf32x3", "tf32", torch.float32, "tf32x3"),  # the argument wins
        ("tf32", None, torch.float64, "ieee"),  # float64 tiles multiply in float64
    ],
    ids=["default", "environment", "argument", "float64"],
)
@pytest.mark.parametrize("chunk_mode", ["start", "auto"], ids=["emitted", "exact_scan"])
def test_the_choice_reaches_every_launch(
    argument, environment, dtype, launched, chunk_mode, monkeypatch
):
    """Forward and backward launches get the chosen precision: the emitted kernels (the
    chunk-start form) and the exact form's scan (chunk_mode auto on an affine spec)."""
    if environment is not None:
        monkeypatch.setenv(TRITON_PRECISION_ENV, environment)
    rule = miras.compile(GDN)
    log = _record_launches(monkeypatch, rule)
    options = {} if argument is None else {"triton_precision": argument}
    _forward_backward(rule, dtype, chunk_mode, **options)
    # The linear forward is two kernels (the state, then every chunk at once), its backward
    # four (the state, then every chunk's scores, value side and key side); the scan's one each.
    launches = 6 if chunk_mode == "start" else 2
    assert [precision for precision, _ in log] == [launched] * launches


def test_a_bad_choice_is_refused_before_any_launch(monkeypatch):
    rule = miras.compile(GDN)
    log = _record_launches(monkeypatch, rule)
    with pytest.raises(ValueError, match="triton_precision: expected one of"):
        _forward_backward(rule, triton_precision="tf32x")
    monkeypatch.setenv(TRITON_PRECISION_ENV, "fp32")
    with pytest.raises(ValueError, match=f"{TRITON_PRECISION_ENV}: expected one of"):
        _forward_backward(rule)
    assert log == []
    # Only the triton backend reads the environment variable.
    q, k, v, gates = random_inputs(rule, b=1, t=4, h=1, dk=4, dv=4)
    rule(q, k, v, gates, backend="chunk", chunk_size=2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    "spec",
    [GDN, {"name": "precision-kl", "bias": "l2", "retention": "kl", "optimizer": "momentum"}],
    ids=["linear", "general"],
)
def test_half_inputs_launch_float32_buffers(dtype, spec, monkeypatch):
    """With fp16 or bf16 inputs every tensor of every launch, forward and backward (inputs,
    outputs, scratch, gradient buffers) is float32: fp16 intermediates would overflow at 65504."""
    rule = miras.compile(spec)
    log = _record_launches(monkeypatch, rule)
    _forward_backward(rule, dtype)
    assert len(log) == (6 if spec is GDN else 2)  # linear: forward 2 kernels, backward 4
    assert all(dtypes == {torch.float32} for _, dtypes in log), log


# fla's conventions for half-precision inputs: relative RMS against the float32 reference.
HALF_TOL = {"o": 5e-3, "grad": 8e-3}


@pytest.mark.parametrize("packed", [False, True], ids=["batch", "cu_seqlens"])
@pytest.mark.parametrize(
    "spec",
    [GDN, {"name": "precision-kl", "bias": "l2", "retention": "kl", "optimizer": "momentum"}],
    ids=["linear", "general"],
)
def test_bf16_inputs_match_the_float32_reference(spec, packed, monkeypatch):
    """bf16 q, k, v and gates through the triton backend against the chunk backend on the
    same values in float32: outputs, final state and every gradient (q, k, v, gates, initial
    state) within fla's half-precision tolerances, at an odd length, odd value width and
    Dphi = 80 (two of the linear state kernel's key tiles), per batch and packed. In the
    interpreter q and k reach the kernels as float32 (`triton_backend.forward`): what is held
    here is the rounding of the inputs, the float32 state and the gradients' cast back."""
    monkeypatch.setattr(triton_backend, "LINEAR_BLOCK_V", 16)
    rule = miras.compile(spec)
    b, h, t, dk, dv = (1, 2, 37, 80, 19) if spec is GDN else (1, 2, 21, 16, 13)
    q, k, v, gates = random_inputs(rule, b=b, t=t, h=h, dk=dk, dv=dv, dtype=torch.float32)
    values = [x.bfloat16().float() for x in (q, k, v, *gates.values())]  # bf16's own values
    init = _initial_state(rule, b, h, dk) if spec is GDN else None
    if spec is GDN:
        gen = torch.Generator().manual_seed(4)
        init = 0.1 * torch.randn(
            rule.initial_state(b, h, dk, dv, torch.float32).shape, generator=gen
        )
    options = dict(chunk_size=16, chunk_mode="start", output_final_state=True)
    if packed:
        options["cu_seqlens"] = torch.tensor([0, 11, t])
        if init is not None:
            init = torch.cat([init, 0.5 * init])  # one per sequence

    def run(dtype, backend):
        leaves = [x.to(dtype).to(DEVICE).requires_grad_(True) for x in values]
        state = None if init is None else init.to(DEVICE).requires_grad_(True)
        q_, k_, v_, *g = leaves
        o, final = rule(
            q_, k_, v_, dict(zip(gates, g, strict=True)), backend=backend,
            initial_state=state, **options,
        )  # fmt: skip
        final = final if isinstance(final, dict) else {"W": final}
        outputs = [o.float(), *(x.float() for x in final.values())]
        gen = torch.Generator().manual_seed(9)
        weights = [torch.randn(x.shape, generator=gen).to(DEVICE) for x in outputs]
        loss = sum((x * w).sum() for x, w in zip(outputs, weights, strict=True))
        wrt = leaves + ([state] if state is not None else [])
        grads = torch.autograd.grad(loss, wrt)
        names = ["o", *(f"final {n}" for n in final), "dq", "dk", "dv", *(f"d {n}" for n in gates)]
        names += ["d init"] if state is not None else []
        return dict(zip(names, [*outputs, *grads], strict=True))

    want = run(torch.float32, "chunk")
    got = run(torch.bfloat16, "triton")
    assert got["dq"].dtype == torch.bfloat16  # gradients in the inputs' own dtype
    for name in want:
        tol = HALF_TOL["grad"] if name.startswith("d") else HALF_TOL["o"]
        bad = _mismatches({name: got[name]}, {name: want[name]}, tol)
        assert not bad, f"above {tol}: {bad}"


def test_the_launcher_refuses_half_tensors():
    with pytest.raises(TypeError, match=r"expected float32 or float64 tensors, got torch\.float16"):
        triton_launch.accumulator(torch.zeros(1, dtype=torch.float16))


# Strong decay ---------------------------------------------------------------------------------


def _strong(pattern: str, decay: torch.Tensor) -> torch.Tensor:
    if pattern == "uniform":  # log a = -9 per token: -144 over a chunk of 16
        return torch.full_like(decay, float(torch.exp(torch.tensor(-9.0))))
    # A near-reset at each chunk's start (log a = -87.5, -85.2, -82.9: -256 over the chunk),
    # then slow decay: the later tokens' factors are O(1), their cumulative sums near -255.
    a = torch.full_like(decay, 0.995)
    for offset, value in enumerate((1e-38, 1e-37, 1e-36)):
        a[:, offset::16] = value
    return a


# (per-channel decay: the general kernels, else the linear ones; decay pattern; grad_at). The
# general kernels run token by token, slowly under the interpreter: one case.
STRONG = [
    *(
        (False, pattern, grad_at)
        for pattern in ("uniform", "reset")
        for grad_at in ("state", "retained")
    ),
    (True, "reset", "retained"),
]


@pytest.mark.parametrize(
    ("per_channel", "pattern", "grad_at"),
    STRONG,
    ids=[f"{'general' if c else 'linear'}-{p}-{g}" for c, p, g in STRONG],
)
def test_strong_decay_matches_chunk(per_channel, pattern, grad_at):
    """Decay factors far below exp(-100) over a chunk: the kernels stay finite and equal the
    chunk backend, outputs and every gradient. In the linear kernels the decay matrix and the
    decay to the chunk's end are exponentials of segment sums of log a (never of cs_t - cs_s,
    which rounds cs's magnitude into every later factor), and d log a_j sums only the factors
    holding a_j (row minus column sums left O(1) rounding, divided by a_j: 1e31 here). A
    per-channel decay runs the general kernels, which decay token by token."""
    rule = miras.compile(
        {"name": "strong-decay", "bias": "l2", "retention": {"kind": "l2", "grad_at": grad_at}}
    )
    b, h, d, chunk = 1, 2, 16, 16
    q, k, v, gates = random_inputs(
        rule,
        b=b,
        t=24 if per_channel else 40,
        h=h,
        dk=d,
        dv=d,
        per_channel=per_channel,
        dtype=torch.float32,
    )
    gates["decay"] = _strong(pattern, gates["decay"])
    log_sum = float(gates["decay"][0, :chunk, 0].double().log().sum(0).max())
    assert log_sum < -100
    inputs = (q, k, v, gates, _initial_state(rule, b, h, d), rule.default_params(torch.float32))
    inputs = tuple(
        {n: x.to(DEVICE) for n, x in part.items()} if isinstance(part, dict) else part.to(DEVICE)
        for part in inputs
    )
    want = _run(rule, "chunk", inputs, chunk)
    got = _run(rule, "triton", inputs, chunk)
    assert all(bool(torch.isfinite(x).all()) for x in got.values())
    bad = _mismatches(got, want, TOL)
    assert not bad, f"above {TOL}: {bad}"


# The compiled PTX -----------------------------------------------------------------------------

# Compiles one emitted kernel for sm_80 in a process without the interpreter (@triton.jit then
# builds compilable functions) and counts its mma instructions, with and without TF32.
COMPILE = """
import importlib.util, json, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

spec = importlib.util.spec_from_file_location("emitted", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
kernel = module.linear_backward.fn  # the jit function under @triton.autotune
constants = {"BT": 16, "BK": 16, "BV": 16, "KT": 16, "ACC": tl.float32}
sizes = {"T", "CS", "NC", "DK", "DV"}
signature = {
    name: "constexpr" if name in constants or name == "DOT_PRECISION"
    else "i32" if name in sizes or name.endswith(("_rs", "_sc")) else "*fp32"
    for name in kernel.arg_names
}
counts = {}
for precision in sys.argv[2:]:
    source = ASTSource(kernel, signature, constexprs={**constants, "DOT_PRECISION": precision})
    ptx = triton.compile(source, target=GPUTarget("cuda", 80, 32)).asm["ptx"]
    mma = [line for line in ptx.splitlines() if line.strip().startswith("mma.")]
    counts[precision] = [len(mma), sum(".tf32" in line for line in mma)]
print(json.dumps(counts))
"""


def test_compiled_ptx_follows_the_precision(tmp_path):
    """gated_deltanet's linear_backward (every product of the template, the decay's VJP) for
    sm_80: under the default (tf32) its products are TF32 tensor-core mma; under the accuracy
    option ieee there is no TF32 mma (float32 products on the FMA units)."""
    path = tmp_path / "gated_deltanet.py"
    path.write_text(kernel_source(ROOT / "specs" / "gated_deltanet.yaml"))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    done = subprocess.run(
        [sys.executable, "-c", COMPILE, str(path), "ieee", DEFAULT_TRITON_PRECISION],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts["ieee"][1] == 0, counts
    default = counts[DEFAULT_TRITON_PRECISION]
    assert default[0] > 0 and default[1] == default[0], counts
