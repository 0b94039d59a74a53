"""The plan pass (miras/compiler/plan.py): the state layout it prints is what the runtime holds."""

import torch

import miras
from miras.compiler.plan import make_plan
from miras.spec import load_spec


def test_mlp_state_dtype_line_follows_the_inputs():
    """Each deep-memory parameter is float32, float64 for float64 inputs (the plan printed
    "float32" alone, while a float64 run holds float64 weights)."""
    spec = load_spec({"name": "deep", "memory": {"kind": "mlp", "depth": 2}, "retention": "l2"})
    lines = [line for line in make_plan(spec).state if line.startswith("W")]
    assert len(lines) == 2
    assert all(line.endswith("float32 (float64 for float64 inputs)") for line in lines)
    rule = miras.compile(spec)
    q = torch.randn(1, 3, 1, 4, dtype=torch.float64)
    gates = {g: torch.full((1, 3, 1), 0.5, dtype=torch.float64) for g in rule.gates}
    _, state = rule(q, q, q, gates=gates, backend="recurrent", output_final_state=True)
    assert {t.dtype for t in state.values()} == {torch.float64}
    _, state = rule(
        q.float(),
        q.float(),
        q.float(),
        gates={g: x.float() for g, x in gates.items()},
        backend="recurrent",
        output_final_state=True,
    )
    assert {t.dtype for t in state.values()} == {torch.float32}
