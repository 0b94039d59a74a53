"""A component's gate declarations (`Component.gate_defaults`, `Optimizer.step_size_gate`,
`Retention.decay_gate`): the code outside `components/` reads them, never a gate's name.

A test-only optimizer whose step size is called `eta` declares what gd declares for `lr`
(STEP_SIZE_GATE, step_size_gate = "eta"), and gets gd's treatment everywhere: the same start and
ceiling in a model layer, the same probe grid and feature-norm normalization, the same Kaczmarz
step in the capacity probe, and fla's `beta` in the ops."""

from __future__ import annotations

from typing import ClassVar, Literal

import pytest
import torch

import miras
from miras import ops
from miras.components import CATALOGUE
from miras.components.base import (
    NONNEGATIVE,
    STEP_SIZE_GATE,
    GateDefaults,
    Optimizer,
    Range,
    gate_or,
    retnet_decay,
)
from miras.derive.linear_step import optimizer_update
from miras.models.layer import MirasLayer
from miras.probes import Episode, gate_grid, recall_errors
from miras.registry import registered
from miras.tasks.capacity import store

pytestmark = pytest.mark.usefixtures("one_thread")

SHIPPED_OPTIMIZERS = dict(CATALOGUE["optimizer"])


class EtaGD(Optimizer):
    """Gradient descent whose step size is named eta.

    Equation: u_t = eta_t g_t
    """

    kind: Literal["eta_gd"] = "eta_gd"
    eta: gate_or(NONNEGATIVE) = "gate"
    gateable: ClassVar[dict[str, Range]] = {"eta": NONNEGATIVE}
    gate_defaults: ClassVar[dict[str, GateDefaults]] = {"eta": STEP_SIZE_GATE}
    step_size_gate: ClassVar[str | None] = "eta"

    def update(self, grad, state, eta):
        return eta * grad, None

    def update_expressions(self):
        from miras.derive.symbols import g, gate_symbol

        return gate_symbol("eta") * g, None

    def update_lines(self) -> list:
        from miras.derive.terms import Line, scalar, sym, times

        return [Line(sym("u_t"), times(scalar(self.eta, "eta"), sym("g_t")))]


@pytest.fixture(scope="module", autouse=True)
def _registered():
    with registered(EtaGD):
        yield


GD_SPEC = {"name": "gd", "bias": "l2", "retention": "l2", "optimizer": "gd"}
ETA_SPEC = {**GD_SPEC, "name": "eta", "optimizer": "eta_gd"}


def _renamed(gates: dict) -> dict:
    """gd's gates under the eta optimizer's names."""
    return {("eta" if name == "lr" else name): value for name, value in gates.items()}


def _layers(**options) -> tuple[MirasLayer, MirasLayer]:
    torch.manual_seed(0)
    gd = MirasLayer(GD_SPEC, 32, 2, **options)
    torch.manual_seed(0)
    eta = MirasLayer(ETA_SPEC, 32, 2, **options)
    return gd, eta


def test_the_plan_records_each_gates_declaration_and_role():
    roles = {i.name: (i.role, i.defaults) for i in miras.compile(ETA_SPEC).plan.gates}
    assert roles["eta"] == ("step_size", STEP_SIZE_GATE)
    assert roles["decay"][0] == "decay" and roles["decay"][1].start is retnet_decay


@pytest.mark.parametrize(("chunk_mode", "summed"), [("auto", 1), ("start", 8)])
def test_a_layer_starts_eta_where_it_starts_lr(chunk_mode, summed):
    gd, eta = _layers(chunk_size=8, chunk_mode=chunk_mode)
    x = torch.zeros(1, 1, 32)
    gd_gates, eta_gates = gd.gates(x), eta.gates(x)
    assert set(eta_gates) == {"decay", "eta"}
    # The step size's start, divided by the gradients a chunk sums at one state.
    expected = torch.full((1, 1, 2), STEP_SIZE_GATE.start / summed)
    torch.testing.assert_close(eta_gates["eta"], expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(eta_gates["eta"], gd_gates["lr"], rtol=0, atol=0)
    decay = torch.tensor([retnet_decay(0), retnet_decay(1)]).reshape(1, 1, 2)
    torch.testing.assert_close(eta_gates["decay"], decay, rtol=1e-5, atol=0)
    # The whole layer is gd's, gate for gate.
    inputs = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(eta(inputs)[0], gd(inputs)[0])


def test_a_layer_keeps_eta_below_the_step_sizes_ceiling():
    gd, eta = _layers()
    for layer in (gd, eta):
        with torch.no_grad():
            layer.gates.up.bias.fill_(30.0)  # far past the start: softplus would give 30
    x = torch.zeros(1, 1, 32)
    value = eta.gates(x)["eta"]
    assert value.max().item() <= STEP_SIZE_GATE.ceiling
    torch.testing.assert_close(value, gd.gates(x)["lr"], rtol=0, atol=0)


def test_the_probes_grid_and_normalize_eta_as_lr():
    gd, eta = miras.compile(GD_SPEC), miras.compile(ETA_SPEC)
    configs = gate_grid(gd)
    assert gate_grid(eta) == [_renamed(c) for c in configs]
    gen = torch.Generator().manual_seed(2)
    k = 3.0 * torch.randn(2, 6, 4, generator=gen, dtype=torch.float64)  # ||k|| != 1
    v = torch.randn(2, 6, 4, generator=gen, dtype=torch.float64)
    episode = Episode(k, v, k[:, :3], v[:, :3])
    expected = recall_errors(gd, episode, configs)
    got = recall_errors(eta, episode, [_renamed(c) for c in configs])
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_the_capacity_probe_steps_eta_and_holds_the_decay():
    gd, eta = miras.compile(GD_SPEC), miras.compile(ETA_SPEC)
    gen = torch.Generator().manual_seed(3)
    k = torch.nn.functional.normalize(
        torch.randn(2, 5, 4, generator=gen, dtype=torch.float64), dim=-1
    )
    v = torch.randn(2, 5, 4, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(
        store(eta, k, v, epochs=2), store(gd, k, v, epochs=2), rtol=0, atol=0
    )


def test_the_ops_pass_beta_as_eta():
    gd, eta = miras.compile(GD_SPEC), miras.compile(ETA_SPEC)
    gen = torch.Generator().manual_seed(4)
    q, k = (
        torch.nn.functional.normalize(torch.randn(1, 6, 2, 4, generator=gen), dim=-1) for _ in "qk"
    )
    v = torch.randn(1, 6, 2, 4, generator=gen)
    g = -torch.rand(1, 6, 2, generator=gen)
    beta = torch.rand(1, 6, 2, generator=gen)
    o_gd, _ = ops.call(gd, q, k, v, g, beta, backend="recurrent")
    o_eta, _ = ops.call(eta, q, k, v, g, beta, backend="recurrent")
    torch.testing.assert_close(o_eta, o_gd, rtol=0, atol=0)
    with pytest.raises(ValueError, match="beta: spec 'eta' has a eta gate"):
        ops.call(eta, q, k, v, g, None, backend="recurrent")


@pytest.mark.parametrize("kind", sorted(SHIPPED_OPTIMIZERS))
def test_a_shipped_optimizers_step_size_gate_is_the_gate_its_update_scales_the_gradient_by(kind):
    """Where the compiler proves the update linear, the declared step size is the gate b_t of
    u_t = b_t g_t (gd, proximal) or of the state's input S_t = theta_t S_{t-1} + b_t g_t."""
    opt = SHIPPED_OPTIMIZERS[kind]()
    declared = opt.step_size_gate
    assert declared is None or declared in opt.gate_defaults
    step, _ = optimizer_update(opt)
    if step is None:  # Muon's Newton-Schulz, the exact solve: nothing to prove it against
        return
    scaling = step.state_input if step.stateful else step.from_gradient
    assert scaling.gates == (("optimizer", declared),)
