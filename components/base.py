"""The abstract base of each kind of component, and the typed fields they share.

A component is a frozen pydantic model: its fields are the spec's parameters (validated before
anything runs), its methods state the math in sympy. A field that may be a data-dependent gate
takes either the word "gate" (the layer supplies it per token) or a fixed number.

The typed fields need neither sympy nor torch, so loading and validating a spec imports
neither (docs/spec.md): in every component module, sympy and its vocabulary (`miras.derive.symbols`,
`miras.derive.formula`) are imported inside the methods that do math, torch inside those that run.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, PlainValidator, WithJsonSchema

from miras.derive.protocols import GateDefaults
from miras.derive.ranges import Range
from miras.errors import did_you_mean

if TYPE_CHECKING:  # annotations only (see the module docstring)
    import sympy as sp
    import torch


POSITIVE = Range(0, math.inf)
NONNEGATIVE = Range(0, math.inf, lo_closed=True)  # a step size b_t >= 0 (0: no write)
UNIT = Range(0, 1, hi_closed=True)  # a decay factor a_t in (0, 1]
HALF_OPEN_UNIT = Range(0, 1, lo_closed=True)  # a momentum factor theta_t in [0, 1)


def retnet_decay(head: int) -> float:
    """RetNet's multi-scale decay of head h, 1 - 2^(-5 - h): 0.969, 0.984, 0.992, ... Slow
    enough that every head starts out remembering tens of tokens."""
    return 1.0 - 2.0 ** (-5 - head)


# The defaults the shipped components share. A step size b_t (an optimizer's `step_size_gate`)
# starts at 0.5 (DeltaNet's beta; the layer lowers it by the feature norm and the chunk's
# summed steps) and stays below 1: with ||k|| = 1 the delta rule W - b (W k - v) k^T contracts
# only for b < 2 (DeltaNet, Yang et al. 2024), so b = sigmoid(.). The probes normalize it by
# ||phi(k)||^2, so 1 is the Kaczmarz step.
STEP_SIZE_GATE = GateDefaults(start=0.5, ceiling=1.0, probe_values=(0.03, 0.1, 0.3, 1.0))
# A momentum factor theta_t; 0 is no momentum.
MOMENTUM_GATE = GateDefaults(start=0.5, probe_values=(0.0, 0.6))
# A retention's decay a_t (its `decay_gate`): RetNet's decays per head; 1 is no forgetting.
DECAY_GATE = GateDefaults(start=retnet_decay, probe_values=(1.0, 0.97, 0.9))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# A fixed value becomes an exact rational constant of the derived rule (sympy's nsimplify), and
# the emitted torch code multiplies tensors by its numerator and denominator: past these
# magnitudes they outgrow a 64-bit integer (OverflowError in torch) or the float32 range.
MAGNITUDE = (1e-12, 1e12)


def check_magnitude(value: float) -> None:
    """Refuse a fixed non-integer value whose magnitude is outside MAGNITUDE (0 is allowed)."""
    lo, hi = MAGNITUDE
    if value != 0 and not lo <= abs(value) <= hi:
        raise ValueError(
            f"expected a magnitude between {lo:g} and {hi:g} (or 0), got {value!r}: a fixed "
            "value becomes an exact constant of the derived rule"
        )


def gate_or(allowed: Range) -> Any:
    """A field that is "gate" (data-dependent, per token) or a fixed number in `allowed`."""

    def check(value: Any) -> str | float:
        if value == "gate":
            return "gate"
        if not _is_number(value):
            hint = did_you_mean(value, ["gate"]) if isinstance(value, str) else ""
            raise ValueError(f"expected 'gate' or a number in {allowed}, got {value!r}{hint}")
        if value not in allowed or math.isnan(value):
            raise ValueError(f"expected a number in {allowed} or 'gate', got {value!r}")
        check_magnitude(value)
        return float(value)

    schema = {"anyOf": [{"const": "gate"}, {"type": "number"}]}
    return Annotated[Literal["gate"] | float, PlainValidator(check), WithJsonSchema(schema)]


def number(allowed: Range, integer: bool = False) -> Any:
    """A fixed number (an integer if asked) in `allowed`."""
    what = "an integer" if integer else "a number"

    def check(value: Any) -> float | int:
        # isfinite before int(): int(inf) raises OverflowError, int(nan) a message of its own.
        whole = _is_number(value) and math.isfinite(value) and float(value) == int(value)
        if not _is_number(value) or (integer and not whole):
            raise ValueError(f"expected {what} in {allowed}, got {value!r}")
        if value not in allowed or math.isnan(value):
            raise ValueError(f"expected {what} in {allowed}, got {value!r}")
        if integer:
            return int(value)
        check_magnitude(value)
        return float(value)

    schema = {"type": "integer" if integer else "number"}
    return Annotated[int if integer else float, PlainValidator(check), WithJsonSchema(schema)]


class Component(BaseModel):
    """Common ground of every component: typed parameters, gates, a catalogue entry."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str
    family: ClassVar[str] = ""
    # Fields that may be data-dependent gates, with the range a fixed value must lie in.
    gateable: ClassVar[dict[str, Range]] = {}
    # What the code outside needs to know about each gateable field (its start in a model
    # layer, its ceiling there, its probe candidates), by name; one left out gets
    # `GateDefaults()`: start 1, no ceiling, no probe values.
    gate_defaults: ClassVar[dict[str, GateDefaults]] = {}
    # Gates that may vary per key feature, [B, T, H, Dphi], rather than per value channel:
    # on a matrix memory W [Dv, Dphi] such a gate scales W's columns (the exact optimizer's
    # ridge on diag(H_kk); an l2 decay per key channel, KDA). A component whose fields decide
    # it overrides this with a property.
    key_channel_gates: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def summary(cls) -> str:
        """The description: the docstring's first paragraph, on one line (a sentence wrapped
        over two docstring lines is not cut)."""
        paragraph = (cls.__doc__ or "").strip().split("\n\n", 1)[0]
        return " ".join(line.strip() for line in paragraph.splitlines())

    @classmethod
    def equation(cls) -> str:
        """The paper equation, from the docstring's `Equation:` line."""
        for line in (cls.__doc__ or "").splitlines():
            if line.strip().startswith("Equation:"):
                return line.strip()[len("Equation:") :].strip()
        return ""

    def spec_equation(self) -> str:
        """The equation for this spec's values, where they change it (lq: its q); `equation()`
        is the catalogue's, with the paper's values."""
        return self.equation()

    def gates(self) -> list[str]:
        """Names of the fields set to "gate": the rule takes them per token."""
        return [name for name in self.gateable if getattr(self, name) == "gate"]

    def defaults_of(self, name: str) -> GateDefaults:
        """The `GateDefaults` of gate `name` in this spec: the declared ones (`GateDefaults()`
        when none is), which a component may adjust to its fields (a stepped optimizer's
        `lr_max` is its step size's ceiling)."""
        return self.gate_defaults.get(name, GateDefaults())

    def scalars(self) -> dict[str, sp.Symbol]:
        """The sympy symbol of every gateable field (gate or fixed)."""
        from miras.derive.symbols import gate_symbol

        return {name: gate_symbol(name) for name in self.gateable}

    def fixed(self) -> dict[str, float]:
        """Values of the gateable fields fixed in the spec."""
        return {n: getattr(self, n) for n in self.gateable if getattr(self, n) != "gate"}

    def parameters(self) -> dict[str, Any]:
        """The spec's parameters of this component, without `kind`."""
        return {k: v for k, v in self.model_dump().items() if k != "kind"}

    def spec_problems(self, spec: Any) -> list[Any]:
        """What this component refuses in the rest of `spec` (a `miras.spec.Spec`): one
        `miras.errors.Problem` per combination it cannot run, naming the field; none by
        default. Checked with the spec's compatibility rules (`miras.spec`)."""
        return []

    def user_parameters(self) -> dict[str, Any]:
        """Parameters the spec names itself, by name (a custom component's `params`): each
        becomes a symbol of the rule, like a gate. None by default."""
        return {}

    def emitted_functions(self) -> list[tuple[str, sp.Expr, str]]:
        """Elementwise functions of x the compiler emits into the rule's module for this
        component: (name, a formula in `miras.derive.symbols` x, docstring). None by default; an
        MLP memory's activation and its derivative, a custom feature map's phi."""
        return []


class Bias(Component):
    """Attentional bias L(y, v): the inner loss the memory minimizes (MIRAS section 3)."""

    family: ClassVar[str] = "bias"

    def expression(self) -> sp.Expr:
        """L over one vector: `ChannelSum(f(e, y, v))` plus, optionally, terms in channel sums
        (e.g. a norm). Uses `miras.derive.symbols` `e`, `y`, `v` and the component's scalars."""
        raise NotImplementedError

    def label(self) -> str:
        """How messages name this bias: "the huber bias" (a custom one quotes its loss)."""
        return f"the {self.kind} bias"

    def reference_loss(self, y: torch.Tensor, v: torch.Tensor, **scalars: Any) -> torch.Tensor:
        """A hand-written torch L, summed over the last (value) axis: `[..., Dv] -> [...]`.
        An independent oracle for the derived gradient."""
        raise NotImplementedError

    def constant_slope(self) -> tuple[float | None, str]:
        """(s, "") when d2L/dy_j^2 = s is one number for every y, v and channel (a quadratic
        bias: l2 gives 1, dot 0), else (None, why not). None by default: a bias that is
        quadratic says so (a formula's bias derives it)."""
        return None, f"{self.label()} is not quadratic in y (no constant d2L/dy^2)"


class Retention(Component):
    """Retention gate: the regularizers of MIRAS's Learning-Retaining objective."""

    family: ClassVar[str] = "retention"

    def objective(self) -> sp.Expr:
        """One entry of <u, W> + (1/eta) D(W, W_{t-1}) + (1/alpha) G(W), in `miras.derive.symbols`
        w, w0, u, eta, alpha and the component's gates."""
        raise NotImplementedError

    def reparameterization(self) -> dict[sp.Symbol, sp.Expr]:
        """eta and alpha as expressions in the gates."""
        raise NotImplementedError

    def domain(self) -> str:
        """Where the state lives: "real", "positive" (KL) or "unit_interval" (binary entropy)."""
        return "real"

    def derive_step(self) -> tuple[list, sp.Expr]:
        """(the derivation's steps, the step W_t in w0, u and the gates): the closed-form
        argmin of the objective, derived with sympy (`miras.derive.retention_derive` runs
        it). By default the separable strategy: solve dJ/dw = 0 for one entry, then
        reparameterize (any smooth objective); a retention of another shape writes its own."""
        from miras.derive.retention_solve import separable

        return separable(self)

    @classmethod
    def derives_separably(cls) -> bool:
        """True when the step comes from the default, separable strategy (`derive_step`)."""
        return cls.derive_step is Retention.derive_step

    # True when the derived step is exactly W_t = a_t W_{t-1} - u_t, with a_t the gate
    # `decay_gate` (or 1 without one): what spec validation reads without deriving (n steps
    # per token, the exact optimizer). The fast forms read the compiler's proof instead
    # (`miras.derive.linear_step`), which tests hold this declaration to.
    linear_step: ClassVar[bool] = False
    # The gate a_t that multiplies W_{t-1}, where the retention has one.
    decay_gate: ClassVar[str | None] = None

    def retained_factor(self) -> str | None:
        """The gate a_t when the bias gradient is taken at the retained state a_t W_{t-1}
        (Gated DeltaNet's order); None when it is taken at W_{t-1} (MIRAS, Titans)."""
        return None

    def row_sum(self) -> float:
        """The sum of each row of a state in the positive domain (KL's c); 1 otherwise."""
        return 1.0

    # True when the argmin is taken over each row constrained to sum to `row_sum()` (KL).
    simplex_rows: ClassVar[bool] = False

    def read_norm(self) -> float | None:
        """q when reads see the state through Moneta's normalization W = A / ||A||_q^(q-2),
        one q-norm per matrix (the state is then an accumulator A, and `reference_read` is
        that map); None when reads see the state itself. The emitters print the read from it."""
        return None

    def reference_read(self, state: Any) -> Any:
        """The read map W = read(state) [..., out, in], hand-written in torch: an oracle for
        the emitted `retention_read` (identity unless the state is an accumulator)."""
        return state

    def solved_by_newton(self) -> bool:
        """True when the step is solved numerically per entry, not in closed form."""
        return False

    def gradient_point_lines(self) -> list:
        """The display line of W_e, the state the bias gradient is taken at."""
        from miras.derive.terms import Line, scalar, sym, times

        factor = self.retained_factor()
        if factor is None:
            return [Line(sym("W_e"), sym("W_{t-1}"))]
        point = times(scalar(getattr(self, factor), factor), sym("W_{t-1}"))
        return [Line(sym("W_e"), point, f"(grad_at: {getattr(self, 'grad_at', 'retained')})")]

    def update_lines(self, step) -> list:
        """The display lines of W_t. `step(previous)`: the derived step as a sympy expression
        in the previous state (a symbol named `previous`) and u_t."""
        from miras.derive.terms import Line, Math, sym

        return [Line(sym("W_t"), Math(step("W_{t-1}")))]


class Optimizer(Component):
    """Memory optimizer: how the inner gradient becomes the update u_t.

    `update` is the step every backend runs (the recurrence and the chunk-start form call it
    per token); `update_expressions` states it in sympy, from which the compiler proves
    whether the fast forms may unroll it as decay matrices (`miras.derive.linear_step`)."""

    family: ClassVar[str] = "optimizer"
    # True when each parameter carries a state s_t (kept as "S.<name>", zeros at t = 0).
    stateful: ClassVar[bool] = False
    # True for an implicit step (proximal): the runtime replaces the gate lr_t by
    # `step_size(lr_t, curvature_t)` before any form runs, and `update` then takes that step.
    implicit: ClassVar[bool] = False
    # True for a step preconditioned per key channel by a state of its own that reads only the
    # keys and its gates (preconditioned): the runtime computes the preconditioner for the
    # whole sequence before any form runs and replaces lr_t by lr_t M_t, one per key channel,
    # which `update` then takes as gd does (`miras.runtime.precondition`).
    preconditioned: ClassVar[bool] = False
    # True when the optimizer solves the whole objective instead of stepping (exact): the
    # state is the objective's sufficient statistics and `whole_step_lines` shows the step.
    solves_exactly: ClassVar[bool] = False
    # The gate b_t that scales the gradient (the learning rate), where the optimizer has one:
    # a model layer bounds its start by the feature norm, the probes divide it by
    # ||phi(k_t)||^2, and fla's ops take it as `beta`.
    step_size_gate: ClassVar[str | None] = None

    def whole_step_lines(self, spec: Any) -> list | None:
        """The display lines of the whole step t where the optimizer replaces it
        (`solves_exactly`); None: the memory, optimizer and retention lines as usual."""
        return None

    def step_size(self, lr: Any, curvature: Any) -> Any:
        """The step size `update` takes at a token whose loss has second derivative
        `curvature` along the gradient (s ||phi(k_t)||^2 on a matrix memory, s = d2L/dy^2):
        lr itself for an explicit step. `lr`, `curvature`: [B, H, T, X] and [B, H, T, 1]."""
        return lr

    def update(self, grad: Any, state: Any, **gates: Any) -> tuple[Any, Any]:
        """(u_t, s_t) from g_t and s_{t-1} (None when not `stateful`). `grad`, `state`:
        [..., *param]; `gates`: every gateable field by name, each broadcasting against grad."""
        raise NotImplementedError

    def update_lines(self) -> list:
        """The display lines of u_t (and s_t)."""
        raise NotImplementedError

    @property
    def linear_form(self) -> Literal["step", "momentum", "general"] | None:
        """The shape of the update where the compiler proves it linear in the gradient and the
        state (`miras.ir.LinearStep.shape`): "step" (u_t = b_t g_t), "momentum"
        (u_t = s_t = theta_t s_{t-1} + b_t g_t) or "general" (any other, such as Nesterov's);
        None where it is not linear (Muon, the exact minimizer). Every fast form, torch and
        Triton, unrolls the compiled record. Derived from `update_expressions`, never declared."""
        from miras.derive.linear_step import optimizer_update

        step, _ = optimizer_update(self)
        return step.shape if step is not None else None

    def update_expressions(self) -> tuple[sp.Expr, sp.Expr | None] | None:
        """The step `update` takes, in sympy, for one entry of the parameter: (u_t, s_t), u_t
        in `miras.derive.symbols` g (the gradient g_t), s_new (the new state s_t) and the gate
        symbols of the gateable fields; s_t in g, s_prev (s_{t-1}) and the gates, or None
        when not `stateful`. The compiler proves from them whether the whole step is linear
        (`miras.derive.linear_step`). None by default: an update that is no elementwise
        expression (Muon's Newton-Schulz, the exact solve) gets no fast linear form."""
        return None

    def steps_per_token(self) -> int:
        """n, the optimizer steps each token takes: the runtime runs them as n sub-steps of
        the one-step rule (`miras.runtime.substeps`); 1 by default."""
        return 1

    def per_step_inputs(self) -> tuple[str, ...]:
        """The inputs ("k", "v", gate names) that carry one entry per step, packed
        [B, T*n, ...]; the others carry one per token. None by default."""
        return ()


class FeatureMap(Component):
    """Feature map phi applied to keys and queries before the memory (ATLAS section 3)."""

    family: ClassVar[str] = "feature_map"
    # DeltaNet's l2 normalization, after the map: phi(x) / ||phi(x)||_2 over the Dphi features
    # of each head's key and query, so ||phi(k)|| = 1 and the delta rule's step b ||phi(k)||^2
    # is the learning rate itself, whatever the map.
    normalize: bool = False

    def phi(self, x: Any, params: dict[str, Any], functions: Any) -> Any:
        """What the memory sees at run time: `features`, l2-normalized per vector when
        `normalize` is set. `x` [..., D] -> [..., Dphi]."""
        y = self.features(x, params, functions)
        if not self.normalize:
            return y
        import torch.nn.functional as F

        return F.normalize(y, dim=-1)  # a zero vector stays zero (the window's padding)

    def spec_equation(self) -> str:
        base = self.equation()
        return f"{base}, then phi(x) / ||phi(x)||_2" if self.normalize and base else base

    def output_dim(self, d: int) -> int:
        """Dphi for input width d."""
        raise NotImplementedError

    def apply(self, x: Any, coefficients: Any = None) -> Any:
        """phi(x): `x` [..., D] -> [..., Dphi]."""
        raise NotImplementedError

    def width_problem(self, d: int) -> str | None:
        """Why Dphi for input width d is over the map's feature budget, or None (no budget)."""
        return None

    def trains_parameters(self) -> bool:
        """Whether a model trains the map's learnable parameters (`initial_params`) with the
        rest of its weights; True by default (polynomial's `learnable: false` keeps them)."""
        return True

    def initial_params(self) -> dict[str, Any]:
        """Initial values of the map's learnable parameters, by name (none by default)."""
        return {}

    def features(self, x: Any, params: dict[str, Any], functions: Any) -> Any:
        """phi(x) at run time: `x` [..., D]; `params` the learnable parameters
        (`initial_params()` names them); `functions` the compiled rule's emitted module."""
        return self.apply(x)


class Memory(Component):
    """Memory architecture M_W (MIRAS section 3: associative memory).

    Parameters are a dict name -> tensor [*batch, out, in]; inputs [*batch, in]. Batch axes
    broadcast, so one state [B, H, 1, out, in] can read many tokens [B, H, N, in], and
    per-token states [B, H, N, out, in] read one token each. `activation` and
    `activation_grad` are the compiled rule's emitted functions (the derivative is derived)."""

    family: ClassVar[str] = "memory"
    # False: a closed form (softmax attention) with no weights, so no step to run.
    parametric: ClassVar[bool] = True
    # True for M_W(x) = W x: y is linear in W and a per-channel gate scales a row of W.
    linear: ClassVar[bool] = False

    def parameter_shapes(self, d_in: int, d_out: int) -> dict[str, tuple[int, ...]]:
        """Each weight's [out, in], input side first."""
        raise NotImplementedError

    def whole_step_lines(self, spec: Any) -> list | None:
        """The display lines of the whole step t where the memory replaces it (a closed form:
        softmax attention's read); None: the memory, optimizer and retention lines as usual."""
        return None

    def state_lines(self) -> list[str] | None:
        """The plan's description of a state the memory keeps instead of weights (softmax
        attention's KV cache); None: its weights, as `parameter_shapes` gives them."""
        return None

    def size_fields(self) -> dict[str, Any]:
        """The memory's fields that set its weights' sizes beyond the widths (an MLP's depth and
        expansion), by name, for messages about memory use. None by default."""
        return {}

    def residual_field(self) -> str | None:
        """The field that makes M(x) add its input x to its output (an MLP's `residual_norm`:
        MIRAS's x + LN(MLP(x))), when it is set: then the output width Dv must equal the input
        width Dphi. None by default."""
        return None

    def chosen_initial_state(self) -> str | None:
        """The initial state W_0 the spec chose for this memory ("zeros", "uniform": matrix's
        `init`), or None where the memory picks it from the retention (`initial_weights`)."""
        return None

    def forward(self, params: dict, x: Any, activation=None) -> tuple[Any, Any]:
        """(M_W(x) [*batch, out], what `backward` reuses). By default the memory's `network`
        with each weight applied to its input as a batched product."""
        if not self.has_gradient_factors():
            raise ValueError(f"memory {self.kind!r} has no parametric forward")
        from miras.components.memory.linalg import applied

        return self.network(list(params), applied(params), x, activation)

    def backward(self, params: dict, x: Any, grad_y: Any, activation=None, grad=None) -> dict:
        """dL/dW for every parameter, given dL/dy at y = M_W(x); never autograd. Shapes follow
        the broadcast of params and x: per token when either is per token. By default the
        outer products of the memory's `gradient_factors`."""
        if not self.has_gradient_factors():
            raise ValueError(f"memory {self.kind!r} has no gradient step (it is a closed form)")
        from miras.components.memory.linalg import outer, transposed

        names = list(params)
        _, cache = self.forward(params, x, activation)
        factors = self.gradient_factors(names, transposed(params), cache, grad_y, activation, grad)
        return {name: outer(*factors[name]) for name in names}

    # A deep memory written as layers of weight matrices: M_W(x) through `linear`, and dL/dW
    # as one outer product error x input^T per weight. The dual form (`miras.runtime.dual`)
    # runs such a memory without per-token weights; a memory that writes both hooks gets it.
    def network(self, names: list[str], linear, x: Any, activation=None) -> tuple[Any, Any]:
        """(M_W(x) [*batch, out], what `gradient_factors` reuses), with every weight applied
        through `linear(name, h)`: h [*batch, in] -> [*batch, out] (the dual form applies a
        chunk's per-token weights there without building them). `names`: the weights, input
        side first (`parameter_shapes`' order). Not written by default."""
        raise NotImplementedError(f"memory {self.kind!r} is not written as a network of weights")

    def gradient_factors(
        self, names: list[str], transposed, cache: Any, grad_y: Any, activation=None, grad=None
    ) -> dict[str, tuple[Any, Any]]:
        """name -> (e, h): dL/dW = e h^T, with e [*batch, out] the error at that weight's
        output and h [*batch, in] its input, given dL/dy `grad_y` at the `network` whose
        `cache` this is; `transposed(name, g)`: W^T g, [*batch, out] -> [*batch, in].
        `activation`, `grad`: the emitted activation and its derivative. Not written by
        default."""
        raise NotImplementedError(f"memory {self.kind!r} has no per-weight gradient factors")

    @classmethod
    def has_gradient_factors(cls) -> bool:
        """True when the memory writes `network` and `gradient_factors` (then the dual form
        applies to it, where its retention and optimizer are linear)."""
        return (
            cls.network is not Memory.network
            and cls.gradient_factors is not Memory.gradient_factors
        )

    def initial_weights(self, shape: tuple[int, ...], domain: str, row_sum: float, generator):
        """W_0 [B, H, out, in] inside the retention's `domain`, float64: a seeded random
        draw mapped into the domain (the sigmoid for the unit interval, a row softmax
        times `row_sum` for the positive one, else scaled by 1/sqrt(in))."""
        import torch

        draw = torch.randn(shape, generator=generator, dtype=torch.float64)
        if domain == "unit_interval":
            return torch.sigmoid(draw)
        if domain == "positive":
            return row_sum * torch.softmax(draw, -1)
        return draw / shape[-1] ** 0.5

    def update_lines(self, window) -> list:
        """The display lines of g_t (the whole step for a closed form), given the spec's
        Omega `window` (its c and gamma)."""
        from miras.derive.terms import GRAD_L, MLP_BACKWARD, PHI, Call, Line, Name, sym

        window_sum, index = window_terms(window)
        features = Call(PHI, (sym(f"k_{index}"),))
        gradient = Call(GRAD_L, (Call(Name("M_{W_e}"), (features,)), sym(f"v_{index}")))
        return [Line(sym("g_t"), window_sum(gradient)), Line(None, None, MLP_BACKWARD)]

    # What the code outside the components asks a memory: the plan, the chunk form, the
    # forms registry, the end-to-end check, the models and the memory estimates. The defaults
    # are a memory of weights stepped per token; a closed form (softmax attention) overrides
    # them. `parametric` stays the validation's question: does the spec's bias, retention,
    # optimizer, feature map and window apply at all.
    def closed_form(self) -> str | None:
        """What the memory computes in closed form from the keys and values, with no weights
        and no step per token ("softmax attention"); None (the default): weights stepped per
        token. A closed form also writes `run_closed_form` (the forms registry's closed form
        runs it) and `reference_closed_form` (the end-to-end check's oracle)."""
        return None

    def run_closed_form(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The closed form's output o [B, H, T, Dv] from q, k [B, H, T, Dk], v [B, H, T, Dv],
        in the inputs' dtype. Not written by default."""
        raise NotImplementedError(f"memory {self.kind!r} has no closed form: it steps weights")

    def reference_closed_form(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """The closed form written out plainly, an oracle for `run_closed_form`: q, k
        [B, T, H, Dk], v [B, T, H, Dv] -> o [B, T, H, Dv]. Not written by default."""
        raise NotImplementedError(f"memory {self.kind!r} has no closed form: it steps weights")

    def schedule(self) -> str:
        """The plan's schedule line: how the memory's tokens are run."""
        return "chunked: chunks of b tokens (chunk_size); b = 1 is the exact recurrence"

    def feature_width(self, spec: Any, d: int) -> int:
        """Dphi, the width of the keys and queries the memory reads for heads of width d: the
        output of the spec's feature map by default."""
        return spec.feature_map.output_dim(d)

    def lookback(self, spec: Any) -> int | None:
        """How many tokens each token's step or read looks at, itself included (None: the
        whole prefix): by default the spec's Omega window c."""
        return None if spec.window.is_global else spec.window.c

    def lookback_fields(self, spec: Any) -> dict[str, Any]:
        """The spec's fields that set `lookback`, by path, for messages about memory use."""
        return {"window.c": spec.window.c}

    def oracle_cost(self, spec: Any, length: int) -> tuple[int, int]:
        """(terms, scores) of the end-to-end check's oracle over `length` tokens: the window
        terms its per-token autograd oracle sums (each token's lookback), and the floats of
        attention scores it keeps per token (none by default)."""
        reach = min(length, self.lookback(spec) or length)
        return length * reach, 0


def window_terms(window):
    """(wrap, i): `wrap(term)` sums a term over the Omega window with its gamma weight, in the
    token index `i` ("i" inside a window, "t" without one)."""
    from miras.derive.terms import WindowSum, scalar, times

    c = window.c
    index = "i" if c != 1 else "t"
    weight = scalar(window.gamma, "gamma", index)

    def wrap(term):
        term = times(weight, term)
        if c == "global":  # the whole prefix, i = 1..t
            return WindowSum("1", term)
        return WindowSum(f"t-{c - 1}", term) if c > 1 else term

    return wrap, index
