"""The plan pass: state layout, gates and the chunk schedule a spec implies (`miras.ir.Plan`)."""

from __future__ import annotations

from miras.components.base import POSITIVE
from miras.errors import DerivationError
from miras.ir import GateInfo, ImplicitStep, Plan, Precondition
from miras.spec import Spec


def _memory_state(spec: Spec) -> list[str]:
    memory = spec.memory
    own = memory.state_lines()  # a closed form's state (softmax attention's KV cache)
    if own is not None:
        return own
    if spec.optimizer.solves_exactly:  # the objective's sufficient statistics
        return [
            "H_kk: [B, H, Dphi, Dphi] float32 (float64 for float64 inputs)",
            "H_vk: [B, H, Dv, Dphi] float32 (float64 for float64 inputs)",
        ]
    if memory.linear:
        accumulator = spec.retention.read_norm() is not None
        name = "A (accumulator; W = A/||A||_q^(q-2))" if accumulator else "W"
        return [f"{name}: [B, H, Dv, Dphi] float32 (float64 for float64 inputs)"]
    # Nominal widths Dphi = 100, Dv = 1000, so that hidden widths read as factors of Dphi.
    shapes = memory.parameter_shapes(d_in=100, d_out=1000)
    return [
        f"{name}: [B, H, {', '.join(_width(n) for n in shape)}] float32 (float64 for float64 inputs)"
        for name, shape in shapes.items()
    ]


def _width(n: int) -> str:
    return {100: "Dphi", 1000: "Dv"}.get(n, f"{n / 100:g} Dphi")


def make_plan(spec: Spec) -> Plan:
    state = _memory_state(spec)
    if spec.optimizer.stateful:
        state.append("S (momentum): same shapes as the memory")
    if spec.optimizer.preconditioned:
        state.append(
            "P (the preconditioner's curvature sum A): [B, H, 1, Dphi] float32 (float64 for "
            "float64 inputs)"
        )
    gates = []
    # Spec.gates() is empty where the memory has no inner step for a gate to scale (softmax
    # attention); then neither are the components' gates taken.
    fields = ("bias", "retention", "optimizer") if spec.gates() else ()
    roles = {
        ("optimizer", spec.optimizer.step_size_gate): "step_size",
        ("retention", spec.retention.decay_gate): "decay",
    }
    for field in fields:
        component = getattr(spec, field)
        for name in component.gates():
            allowed = component.gateable.get(name, POSITIVE)
            defaults = component.defaults_of(name)
            channels = "key" if name in component.key_channel_gates else "value"
            role = roles.get((field, name))
            gates.append(GateInfo(name, field, allowed, defaults, role, channels))
    window = spec.window
    for name in window.gates() if fields else ():
        gates.append(GateInfo(name, "window", POSITIVE, window.gate_defaults[name]))
    schedule = spec.memory.schedule()
    return Plan(
        tuple(state),
        tuple(gates),
        schedule,
        implicit_step=_implicit_step(spec),
        precondition=_precondition(spec),
    )


def _precondition(spec: Spec) -> Precondition | None:
    """The preconditioned optimizer's step size map, with the bias's constant d2L/dy^2, the
    curvature per unit phi(k)^2 (validation has refused a spec without one)."""
    opt = spec.optimizer
    if not opt.preconditioned or not spec.memory.parametric:
        return None
    slope, why = spec.bias.constant_slope()
    if slope is None or opt.step_size_gate is None:
        raise DerivationError(
            f"the {opt.kind} optimizer needs a bias with a constant d2L/dy^2 and a step size "
            f"gate ({why or 'no step size gate'})"
        )
    return Precondition(opt.step_size_gate, slope)


def _implicit_step(spec: Spec) -> ImplicitStep | None:
    """The implicit optimizer's step size map, with the bias's constant d2L/dy^2 (validation
    has refused a spec without one)."""
    if not spec.optimizer.implicit:  # (softmax attention takes optimizer gd only)
        return None
    from miras.derive.linear_step import linear_update

    slope, _ = spec.bias.constant_slope()
    step, why = linear_update(spec)  # u_t = b_t g_t: the gate b_t the step size replaces
    if step is None or step.stateful or len(step.from_gradient.gates) != 1:
        raise DerivationError(
            f"the implicit {spec.optimizer.kind} optimizer's update is not u_t = b_t g_t with b_t "
            f"one gate ({why or step.text()})"
        )
    return ImplicitStep(step.from_gradient.gates[0][1], slope)
