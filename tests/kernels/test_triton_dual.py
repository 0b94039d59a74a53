"""The dual form's Triton kernel (deep MLP memories) against the torch dual form.

`backend="triton"` runs `dual_forward` and `dual_backward` (kernels/templates/dual.py) for a
two-layer MLP memory, torch carrying the gate gradients back through the mixing matrices;
`backend="chunk"` runs `miras.runtime.dual` itself. Without CUDA the kernel runs under TRITON_INTERPRET=1 (set by
tests/conftest.py), in float32, with its outputs NaN-poisoned before the launch and checked
written after it. Shapes are small (the interpreter is slow): Dk = Dv = 16 and expansion 2.5,
so the hidden width is Dh = 40: a 32-wide hidden block and a partial one (8 of 32); odd T; a
chunk shorter than the kernel's 16-row block.
"""

import pytest
import torch

import miras
from miras.compiler.pipeline import kernel_source
from miras.runtime import dual_triton, triton_backend
from tests.helpers import random_inputs

TOL = 1e-5  # relative RMS, float32 (as tests/kernels/test_triton.py)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
D = 16  # Dk = Dv
MLP = {"kind": "mlp", "depth": 2, "expansion": 2.5, "activation": "silu"}  # Dh = 40


@pytest.fixture(autouse=True)
def _check_every_output_written(monkeypatch):
    monkeypatch.setenv(triton_backend.CHECK_ENV, "1")


def _rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt().clamp_min(1e-30))


def _inputs(rule, t: int, seed: int = 0):
    """q, k, v, gates and a random (not zero) initial state, float32."""
    b, h = 1, 2
    q, k, v, gates = random_inputs(rule, b=b, t=t, h=h, dk=D, dv=D, seed=seed, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    init = rule.initial_state(b, h, D, D, torch.float32)
    init = {n: 0.3 * torch.randn(s.shape, generator=gen) for n, s in init.items()}
    move = lambda x: x.to(DEVICE)  # noqa: E731
    return (
        move(q),
        move(k),
        move(v),
        {n: move(g) for n, g in gates.items()},
        {n: move(s) for n, s in init.items()},
    )


def _run(rule, backend, inputs, chunk, grads=True):
    """o, the final state and (with `grads`) the gradients of a random projection of both with
    respect to q, k, v, every gate and every initial state, named."""
    q, k, v, gates, init = inputs
    leaves = [x.clone().requires_grad_(grads) for x in (q, k, v, *gates.values(), *init.values())]
    q_, k_, v_, *rest = leaves
    g_ = dict(zip(gates, rest[: len(gates)], strict=True))
    s_ = dict(zip(init, rest[len(gates) :], strict=True))
    o, final = rule(
        q_, k_, v_, g_, backend=backend, chunk_size=chunk, initial_state=s_,
        output_final_state=True,
    )  # fmt: skip
    out = {"o": o} | {f"final {n}": final[n] for n in init}
    if not grads:
        return out
    gen = torch.Generator().manual_seed(7)
    weights = [torch.randn(x.shape, generator=gen).to(x) for x in out.values()]
    loss = sum((x * w).sum() for x, w in zip(out.values(), weights, strict=True))
    found = torch.autograd.grad(loss, leaves)
    names = ["dq", "dk", "dv", *(f"d {n}" for n in gates), *(f"d init {n}" for n in init)]
    return out | dict(zip(names, found, strict=True))


def _compare(got: dict, want: dict):
    assert list(got) == list(want)
    bad = {
        n: f"{_rel_rms(got[n], w):.2e}" for n, w in want.items() if not _rel_rms(got[n], w) <= TOL
    }
    assert not bad, f"relative RMS above {TOL}: {bad}"


def _counting(monkeypatch) -> list:
    """Records every launch of the dual kernels, "forward" or "backward" (so a test cannot
    pass on the torch path)."""
    seen = []
    real_forward, real_backward = dual_triton._launch, dual_triton.run_backward

    def forward(module, *args, **kwargs):
        seen.append("forward")
        return real_forward(module, *args, **kwargs)

    def backward(module, *args, **kwargs):
        seen.append("backward")
        return real_backward(module, *args, **kwargs)

    monkeypatch.setattr(dual_triton, "_launch", forward)
    monkeypatch.setattr(dual_triton, "run_backward", backward)
    return seen


CASES = {
    # Titans: momentum, l2 retention, per-head gates lr, momentum, decay.
    "titans": (dict(memory=MLP, bias="l2", retention="l2", optimizer="momentum"), 21, 8),
    # gd without momentum, the retained gradient point, gelu; one chunk longer than T.
    "gd_retained_gelu": (
        dict(
            memory={**MLP, "activation": "gelu"},
            bias="l2",
            retention={"kind": "l2", "grad_at": "retained"},
            optimizer="gd",
        ),
        13,
        16,
    ),
    # DLA: the dot bias (its gradient does not read y), gd, l2 retention.
    "dla_dot": (
        dict(memory={**MLP, "activation": "gelu"}, bias="dot", retention="l2", optimizer="gd"),
        17,
        8,
    ),
    # Huber's two branches (a fixed delta), Nesterov, the window's weight as a gate, relu;
    # chunks of 4 in the kernel's 16-row block.
    "huber_nesterov_gamma_relu": (
        dict(
            memory={**MLP, "activation": "relu"},
            bias={"kind": "huber", "delta": 1.0},
            retention="l2",
            optimizer="nesterov",
            window={"c": 1, "gamma": "gate"},
        ),
        15,
        4,
    ),
    # momentum with the retained gradient point, a tanh network.
    "momentum_retained_tanh": (
        dict(
            memory={**MLP, "activation": "tanh"},
            bias="l2",
            retention={"kind": "l2", "grad_at": "retained"},
            optimizer="momentum",
        ),
        19,
        16,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_dual_kernel_equals_the_torch_dual_form(name, monkeypatch):
    fields, t, chunk = CASES[name]
    rule = miras.compile({"name": name.replace("_", "-"), **fields})
    inputs = _inputs(rule, t)
    seen = _counting(monkeypatch)
    want = _run(rule, "chunk", inputs, chunk)
    got = _run(rule, "triton", inputs, chunk)
    assert seen == ["forward", "backward"]
    _compare(got, want)


@pytest.mark.parametrize("case", ["titans", "momentum_retained_tanh"])
def test_several_hidden_blocks_the_last_partial(case, monkeypatch):
    """Hidden blocks of 16: Dh = 40 is 16 + 16 + 8, forward and backward."""
    monkeypatch.setattr(dual_triton, "HIDDEN_BLOCK", 16)
    fields, t, chunk = CASES[case]
    rule = miras.compile({"name": case.replace("_", "-"), **fields})
    inputs = _inputs(rule, t, seed=3)
    seen = _counting(monkeypatch)
    want = _run(rule, "chunk", inputs, chunk)
    got = _run(rule, "triton", inputs, chunk)
    assert seen == ["forward", "backward"]
    _compare(got, want)


@pytest.mark.parametrize(
    ("case", "fit", "every"),
    [("titans", 2, 2), ("huber_nesterov_gamma_relu", 1, 4), ("momentum_retained_tanh", 1, 2)],
    ids=["titans_every_2", "one_start_of_4_chunks", "retained_every_2"],
)
def test_starts_past_the_budget_every_g_th_chunk(case, fit, every, monkeypatch):
    """Past `STARTS_BUDGET` the forward keeps every G-th chunk's start and the backward runs each
    stretch of G chunks forward again before differentiating it (the last stretch partial:
    3 chunks in stretches of 2, 4 chunks in one, 2 in one): gradients as the torch dual form's."""
    fields, t, chunk = CASES[case]
    rule = miras.compile({"name": case.replace("_", "-"), **fields})
    inputs = _inputs(rule, t, seed=13)
    start = 4 * sum(s.numel() for s in inputs[4].values())  # one start, every head, float32
    monkeypatch.setattr(dual_triton, "STARTS_BUDGET", fit * start)
    chunks = -(-t // chunk)
    assert dual_triton.starts_every(chunks, start) == every
    seen = _counting(monkeypatch)
    want = _run(rule, "chunk", inputs, chunk)
    got = _run(rule, "triton", inputs, chunk)
    stretches = -(-chunks // every)
    assert seen == ["forward"] + ["backward"] * stretches
    _compare(got, want)


def test_no_gradient_no_stored_starts(monkeypatch):
    """Without a gradient wanted the forward stores no chunk starts and no backward runs."""
    fields, t, chunk = CASES["titans"]
    rule = miras.compile({"name": "titans-plain", **fields})
    stored = []
    real = dual_triton._launch

    def launch(module, rt, seq, weights, chunk_size, precision, operands, store_every):
        stored.append(store_every)
        return real(module, rt, seq, weights, chunk_size, precision, operands, store_every)

    monkeypatch.setattr(dual_triton, "_launch", launch)
    _run(rule, "triton", _inputs(rule, t), chunk, grads=False)
    assert stored == [0]


def test_chunk_starts_are_stored(monkeypatch):
    """With STORE_STARTS the kernel writes every chunk's start state (what the backward reads):
    the first is the initial state, the last the torch dual form's state after all but the
    last chunk."""
    fields, t, chunk = CASES["titans"]
    rule = miras.compile({"name": "titans-starts", **fields})
    q, k, v, gates, init = _inputs(rule, t, seed=5)
    captured = {}
    real = dual_triton._launch

    def launch(module, rt, seq, weights, chunk_size, precision, operands, store_every):
        out = real(module, rt, seq, weights, chunk_size, precision, operands, 1)
        captured["starts"] = out[2]
        return out

    monkeypatch.setattr(dual_triton, "_launch", launch)
    rule(q, k, v, gates, backend="triton", chunk_size=chunk, initial_state=init)
    starts = captured["starts"]
    keys = list(init)  # W2, W1, S.W2, S.W1: the kernel's A, B, SA, SB
    assert len(keys) == 4
    b, h = q.shape[0], q.shape[2]
    for key, stored in zip(keys, starts, strict=True):
        _compare({key: stored[:, 0]}, {key: init[key].reshape(b * h, *init[key].shape[2:])})
    cut = (t - 1) // chunk * chunk  # the last chunk's first token
    _, mid = rule(
        q[:, :cut], k[:, :cut], v[:, :cut], {n: g[:, :cut] for n, g in gates.items()},
        backend="chunk", chunk_size=chunk, initial_state=init, output_final_state=True,
    )  # fmt: skip
    for key, stored in zip(keys, starts, strict=True):
        _compare({key: stored[:, -1]}, {key: mid[key].reshape(b * h, *mid[key].shape[2:])})


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        (dict(memory={"kind": "gated_mlp", "expansion": 1}), "gated_mlp memory"),
        (dict(memory={"kind": "mlp", "depth": 3, "expansion": 1}), "memory.depth"),
        (
            dict(memory={"kind": "mlp", "depth": 2, "expansion": 1, "residual_norm": True}),
            "memory.residual_norm",
        ),
        (dict(memory={"kind": "mlp", "depth": 2, "expansion": 1}, window=2), "window c = 2"),
    ],
    ids=["gated_mlp", "depth3", "residual_norm", "window2"],
)
def test_uncovered_deep_memory_is_refused_naming_the_field(fields, reason):
    rule = miras.compile({"name": "outside", **fields}, checked=False)
    q, k, v, gates = random_inputs(rule, t=5, dk=8, dv=8, dtype=torch.float32)
    with pytest.raises(ValueError, match=reason) as err:
        rule(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), gates, backend="triton")
    message = str(err.value)
    assert "backend='chunk'" in message and "mlp of depth 2" in message


def test_titans_source_holds_the_dual_kernel():
    source = kernel_source("specs/titans.yaml")
    assert "def dual_forward(" in source and "def activation(" in source
    assert "MOMENTUM = tl.constexpr(True)" in source


def test_the_compile_checks_record_the_dual_launch(monkeypatch):
    """`gpu_compile.jobs` records the launch a GPU call makes, on meta tensors: one program per
    (batch, head), q and k in the inputs' half dtype, the chunk starts stored (the variant a
    backward kernel would read)."""
    from miras.checks import gpu_compile

    # MIRAS_TRITON_CHECK=1 stays set (the fixture's): the check passes over meta tensors
    forward, backward = gpu_compile.jobs("specs/titans.yaml", d=64, shape=(2, 100, 3), dtype="bf16")
    assert (forward.kernel, backward.kernel) == ("dual_forward", "dual_backward")
    assert dict(forward.constexprs)["STORE_STARTS"] is True
    assert (forward.num_warps, forward.num_stages) == (
        dual_triton.NUM_WARPS,
        dual_triton.NUM_STAGES,
    )
    assert (backward.num_warps, backward.num_stages) == (
        dual_triton.BACKWARD_WARPS, dual_triton.BACKWARD_STAGES
    )  # fmt: skip
    for job in (forward, backward):
        meta = dict(job.constexprs)
        assert (job.form, job.grid) == ("dual", (6,))
        assert meta["HB"] == dual_triton.HIDDEN_BLOCK
        assert meta["BT"] == 16 and meta["DOT_PRECISION"] == "tf32"
        assert job.args[:3] == (
            ("tensor", "bfloat16"), ("tensor", "bfloat16"), ("tensor", "float32")
        )  # fmt: skip


def test_a_gradient_of_the_final_state_alone_is_the_torch_dual_forms(monkeypatch):
    """The loss reads the final state only (o's gradient is None): the backward kernel runs
    with a zero dO, and every gate and the keys still get their gradients."""
    fields, t, chunk = CASES["titans"]
    rule = miras.compile({"name": "final-only", **fields})
    q, k, v, gates, init = _inputs(rule, t, seed=11)
    seen = _counting(monkeypatch)
    grads = {}
    for backend in ("chunk", "triton"):
        leaves = [x.clone().requires_grad_(True) for x in (k, v, *gates.values())]
        k_, v_, *g_ = leaves
        _, final = rule(
            q, k_, v_, dict(zip(gates, g_, strict=True)), backend=backend, chunk_size=chunk,
            initial_state=init, output_final_state=True,
        )  # fmt: skip
        loss = sum(x.square().sum() for x in final.values())
        names = ["dk", "dv", *(f"d {n}" for n in gates)]
        grads[backend] = dict(zip(names, torch.autograd.grad(loss, leaves), strict=True))
    assert seen == ["forward", "backward"]
    _compare(grads["triton"], grads["chunk"])


def test_a_gradient_of_q_alone_is_the_torch_dual_forms():
    """Only q asks for a gradient: the final state does not reach it, so its gradient is None
    and the backward kernel starts from a zero gradient of it."""
    fields, t, chunk = CASES["gd_retained_gelu"]
    rule = miras.compile({"name": "q-only", **fields})
    q, k, v, gates, init = _inputs(rule, t, seed=9)
    grads = {}
    for backend in ("chunk", "triton"):
        q_ = q.clone().requires_grad_(True)
        o, _ = rule(
            q_, k, v, gates, backend=backend, chunk_size=chunk, initial_state=init,
            output_final_state=True,
        )  # fmt: skip
        (grads[backend],) = torch.autograd.grad(o.square().sum(), q_)
    _compare({"dq": grads["triton"]}, {"dq": grads["chunk"]})


# fla's conventions for half-precision inputs: relative RMS against the float32 reference.
HALF_TOL = {"o": 5e-3, "grad": 8e-3}


@pytest.mark.parametrize("case", ["titans", "gd_retained_gelu"])
def test_bf16_inputs_match_the_float32_reference(case, monkeypatch):
    """bf16 q, k, v, gates and initial state through the dual kernels against the torch dual
    form on the same values in float32: output, final state and every gradient within fla's
    half-precision tolerances, the gradients in bf16. (In the interpreter q and k reach the
    kernels as float32, `triton_launch.operands_dtype`: what is held here is the rounding of
    the inputs, the float32 state and buffers, and the gradients' cast back.)"""
    fields, t, chunk = CASES[case]
    rule = miras.compile({"name": case.replace("_", "-"), **fields})
    q, k, v, gates, init = _inputs(rule, t, seed=17)
    rounded = lambda x: x.bfloat16().float()  # noqa: E731
    values = (rounded(q), rounded(k), rounded(v), {n: rounded(g) for n, g in gates.items()})
    init = {n: rounded(s) for n, s in init.items()}
    seen = _counting(monkeypatch)
    want = _run(rule, "chunk", (*values, init), chunk)
    half = [x.bfloat16() for x in values[:3]], {n: g.bfloat16() for n, g in values[3].items()}
    got = _run(rule, "triton", (*half[0], half[1], init), chunk)
    assert seen == ["forward", "backward"]
    assert got["o"].dtype == got["dq"].dtype == got["dk"].dtype == torch.bfloat16
    for name, w in want.items():
        tol = HALF_TOL["grad"] if name.startswith("d") else HALF_TOL["o"]
        assert _rel_rms(got[name].float(), w) <= tol, (name, _rel_rms(got[name].float(), w))
