"""The compiler asks components, not kind names: a component that answers a hook the way lq
or a custom feature map does is emitted the same way, whatever its kind."""

from __future__ import annotations

import torch

import miras
from miras.compiler.pipeline import _extra_functions
from miras.compiler.plan import make_plan
from miras.components.feature_map.identity import IdentityMap
from miras.components.feature_map.polynomial import PolynomialMap
from miras.components.memory.gated_mlp import GatedMLPMemory
from miras.components.memory.matrix import MatrixMemory
from miras.components.retention.l2 import L2Retention
from miras.derive.emit import load_module, module_source
from miras.derive.retention_derive import derive_retention
from miras.derive.retention_emit import retention_source
from miras.derive.symbols import x
from miras.derive.terms import sym
from miras.spec import load_spec, residual_needs_equal_widths


class NormalizedL2(L2Retention):
    """l2 retention read through a q-norm, as Moneta reads its accumulator."""

    def read_norm(self) -> float | None:
        return 3.0


def emitted_read(retention):
    rule = derive_retention(retention)
    source = retention_source(retention, rule.step, rule.gates)
    return load_module(module_source("test", [source])).retention_read


def test_the_read_is_emitted_from_the_retention_hook():
    state = torch.randn(2, 3, 4, dtype=torch.float64)
    read = emitted_read(NormalizedL2())(state)
    norm = torch.linalg.vector_norm(state, ord=3.0, dim=(-2, -1), keepdim=True)
    torch.testing.assert_close(read, state / norm)  # W = A / ||A||_3^(3-2)
    assert torch.equal(emitted_read(L2Retention())(state), state)  # no hook: the identity


def test_the_plan_names_the_accumulator_from_the_hook():
    spec = load_spec({"name": "n", "retention": "l2"}).model_copy(
        update={"retention": NormalizedL2()}
    )
    assert make_plan(spec).state[0].startswith("A (accumulator")
    assert make_plan(load_spec({"name": "n", "retention": "l2"})).state[0].startswith("W:")


def test_the_retention_check_compares_the_read_where_the_hook_asks():
    pieces = [r.piece for r in miras.compile({"name": "m", "retention": "lq"}).checks]
    assert any(p.startswith("read:") for p in pieces)
    pieces = [r.piece for r in miras.compile({"name": "m", "retention": "l2"}).checks]
    assert not any(p.startswith("read:") for p in pieces)


class CubedMap(IdentityMap):
    """The identity's fields, with phi(x) = x^3 emitted for the runtime."""

    def emitted_functions(self):
        return [("feature_map", x**3, "x cubed")]


def test_the_functions_a_component_asks_for_are_emitted():
    spec = load_spec({"name": "n", "memory": {"kind": "mlp", "activation": "tanh"}})
    spec = spec.model_copy(update={"feature_map": CubedMap()})
    sources = _extra_functions(spec)
    module = load_module(module_source("test", sources))
    t = torch.linspace(-2, 2, 9, dtype=torch.float64)
    torch.testing.assert_close(module.feature_map(t), t**3)
    torch.testing.assert_close(module.activation(t), torch.tanh(t))
    torch.testing.assert_close(module.activation_grad(t), 1 - torch.tanh(t) ** 2)


def test_softmax_attention_takes_no_gates_by_the_parametric_flag():
    spec = load_spec({"name": "a", "memory": "nonparametric"})
    assert not spec.memory.parametric and spec.gates() == []


class SkipGatedMLP(GatedMLPMemory):
    """A gated MLP that adds its input to its output when `skip` is set: no `residual_norm`
    field, only the hook."""

    skip: bool = True

    def residual_field(self) -> str | None:
        return "skip" if self.skip else None


def test_the_residual_width_check_asks_the_memory():
    spec = load_spec({"name": "r", "memory": "gated_mlp", "feature_map": "taylor"})
    assert residual_needs_equal_widths(spec) == []
    spec = spec.model_copy(update={"memory": SkipGatedMLP()})
    (problem,) = residual_needs_equal_widths(spec)
    assert problem.path == "memory.skip" and "or skip: false" in problem.message
    assert (
        residual_needs_equal_widths(spec.model_copy(update={"memory": SkipGatedMLP(skip=False)}))
        == []
    )


class FrozenPolynomial(PolynomialMap):
    """A polynomial map whose coefficients the model keeps fixed, whatever `learnable` says."""

    def trains_parameters(self) -> bool:
        return False


def test_a_layer_trains_the_maps_parameters_as_the_map_says():
    from miras.models import MirasLayer

    spec = load_spec({"name": "p", "feature_map": "polynomial"})
    trained = MirasLayer(spec, 8, 2)
    assert trained.rule_params and all(p.requires_grad for p in trained.rule_params.values())
    frozen = MirasLayer(spec.model_copy(update={"feature_map": FrozenPolynomial()}), 8, 2)
    assert frozen.rule_params and not any(p.requires_grad for p in frozen.rule_params.values())


class TaggedMatrix(MatrixMemory):
    """A matrix memory that describes its own state and its whole step."""

    def state_lines(self) -> list[str]:
        return ["W: [B, H, Dv, Dphi], tagged"]

    def whole_step_lines(self, spec) -> list:
        from miras.derive.terms import Line

        return [Line(sym("o_t"), sym("tagged"))]


def test_the_plan_and_the_derivation_take_a_memorys_own_lines():
    from miras.derive.describe import update_lines

    spec = load_spec({"name": "t"})
    rule = miras.compile(spec, checked=False)
    assert make_plan(spec).state[0].startswith("W: [B, H, Dv, Dphi] float32")
    assert len(update_lines(spec, rule.retention)) > 1  # the memory, optimizer, retention
    tagged = spec.model_copy(update={"memory": TaggedMatrix()})
    assert make_plan(tagged).state == ("W: [B, H, Dv, Dphi], tagged",)
    (line,) = update_lines(tagged, rule.retention)
    assert str(line.rhs) == str(sym("tagged"))
