"""Typed specs: load a YAML spec, validate it, and report every problem at once.

A spec picks one component per MIRAS axis (memory, feature map, attentional bias, retention,
optimizer) plus ATLAS's Omega window. Each component field accepts the classes of
`miras.components.CATALOGUE[field]`, chosen by `kind`; a bare string is the kind alone
(`bias: l2` is `bias: {kind: l2}`). Validation runs in two stages, each collecting every problem:
pydantic checks the structure (kinds, fields, types, ranges, formulas), then `COMPATIBILITY_RULES`
check combinations. Problems carry the dotted path of the bad field; docs/spec.md is the reference.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Union

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    WithJsonSchema,
    model_validator,
)

from miras.components import CATALOGUE
from miras.components.base import POSITIVE, Component, GateDefaults, Range, gate_or, number
from miras.components.bias.l2 import L2Bias
from miras.components.feature_map.identity import IdentityMap
from miras.components.memory.matrix import MatrixMemory
from miras.components.optimizer.gd import GD
from miras.components.retention.none import NoRetention
from miras.errors import Problem, SpecError
from miras.spec.validation import (
    SOURCE_DICT,
    CarriesProblems,
    Slug,
    read_mapping,
    translate,
)

# Why an unknown field is not where the user put it, beyond "it belongs to another kind".
FIELD_REASONS: dict[tuple[str, str], str] = {
    ("retention", "grad_at"): "the Gated DeltaNet order needs the l2 decay",
}


def _component_short_form(field: str) -> Callable[[Any], Any]:
    kinds = ", ".join(CATALOGUE[field])

    def expand(value: Any) -> Any:
        if isinstance(value, str):
            return {"kind": value}
        if isinstance(value, (Mapping, Component)):
            return value
        raise ValueError(
            f"expected a {field} kind ({kinds}) or a mapping with 'kind', got {value!r}"
        )

    return expand


def one_of(field: str) -> Any:
    """The type of a component field: a class of `CATALOGUE[field]` picked by its `kind`."""
    members = tuple(CATALOGUE[field].values())
    # Union[...] of a tuple made at run time; `|` would need the members written out.
    union = Annotated[Union[members], Field(discriminator="kind")]  # noqa: UP007
    return Annotated[union, BeforeValidator(_component_short_form(field))]


# The longest window and sequence a spec names: 1M tokens (`window: global` has no bound).
MAX_WINDOW = 1 << 20


def _window_size(value: Any) -> int | str:
    """c: an integer in [1, MAX_WINDOW], or "global" (the whole prefix)."""
    if value == "global":
        return "global"
    number_ = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number_ or not math.isfinite(value) or value != int(value) or value < 1:
        raise ValueError(
            f"expected an integer in [1, {MAX_WINDOW}] or 'global' (the whole prefix), "
            f"got {value!r}"
        )
    if value > MAX_WINDOW:
        raise ValueError(
            f"expected an integer in [1, {MAX_WINDOW}] or 'global' (the whole prefix), got "
            f"{value!r}: a window of c tokens keeps c keys and values per sequence"
        )
    return int(value)


WindowSize = Annotated[
    Union[int, Literal["global"]],  # noqa: UP007 (as `one_of`)
    PlainValidator(_window_size),
    WithJsonSchema(
        {"anyOf": [{"type": "integer", "minimum": 1, "maximum": MAX_WINDOW}, {"const": "global"}]}
    ),
]


class Window(BaseModel):
    """ATLAS's Omega rule: the objective at step t is sum_{i=t-c+1..t} gamma_i l(W; k_i, v_i).

    `c = 1` is the online case, where `gamma` only rescales the single term (the learning rate
    does the same), so it is allowed but changes nothing worth a gate. `c: global` (`window:
    global`) sums over the whole prefix i = 1..t (ATLAS section 3.2, the DeepTransformers of
    section 4): quadratic in the sequence length, like attention (docs/chunking.md).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    c: WindowSize = 1
    gamma: gate_or(POSITIVE) = 1.0
    # As a component declares its gates' (`Component.gate_defaults`): gamma starts at 1 in a
    # layer, and the probes hold it at 1.
    gate_defaults: ClassVar[dict[str, GateDefaults]] = {"gamma": GateDefaults(probe_values=(1.0,))}
    # The name of the window's one gate, gamma_i (each term's weight): what the forms, the
    # checks and the kernels read it by.
    weight_gate: ClassVar[str] = "gamma"

    @model_validator(mode="before")
    @classmethod
    def _short_form(cls, value: Any) -> Any:
        number_ = isinstance(value, (int, float)) and not isinstance(value, bool)
        if number_ or value == "global":
            return {"c": value}  # `window: 4` means {c: 4}; `window: global` {c: global}
        if isinstance(value, (Mapping, Window)):
            return value
        raise ValueError(
            f"expected an integer c >= 1, 'global' or a mapping {{c, gamma}}, got {value!r}"
        )

    @property
    def is_global(self) -> bool:
        return self.c == "global"

    def gates(self) -> list[str]:
        return [self.weight_gate] if self.gamma == "gate" else []


class ModelConfig(BaseModel):
    """The model a spec's memory goes into (docs/models.md): sizes, the hybrid variant, and the
    backend options of its memory layers. Not part of the rule, so not part of `digest()`.

    Variants (Titans section 4, MIRAS section 5): `lmm` every block's mixer is the memory layer;
    `mal` memory layer then sliding-window attention; `mag` memory and SWA branches mixed by a
    gate; `mac` memory as context (segments); `attention` / `swa` softmax baselines that ignore
    the memory fields of the spec.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    d_model: number(Range(1, 65536, lo_closed=True, hi_closed=True), integer=True) = 64
    n_layers: number(Range(1, 64, lo_closed=True, hi_closed=True), integer=True) = 2
    n_heads: number(Range(1, 4096, lo_closed=True, hi_closed=True), integer=True) = 2
    variant: Literal["lmm", "mal", "mag", "mac", "attention", "swa"] = "lmm"
    swa_window: number(Range(1, MAX_WINDOW, lo_closed=True, hi_closed=True), integer=True) = 64
    mac_segment: number(Range(1, MAX_WINDOW, lo_closed=True, hi_closed=True), integer=True) = 32
    persistent_tokens: number(Range(0, 4096, lo_closed=True, hi_closed=True), integer=True) = 0
    # None: 64 // window.c where the rule gets the exact chunk form, 16 for the chunk-start form
    # (`exact_chunk.default_chunk_size`).
    chunk_size: number(Range(1, 65536, lo_closed=True, hi_closed=True), integer=True) | None = None
    backend: Literal["chunk", "recurrent", "triton"] = "chunk"
    # "auto": exact chunks where the rule is affine in its memory, else chunk-start; "start",
    # "exact": force one (docs/chunking.md).
    chunk_mode: Literal["auto", "start", "exact"] = "auto"
    conv_size: number(Range(0, 16, lo_closed=True, hi_closed=True), integer=True) = 4
    gate_rank: number(Range(1, 65536, lo_closed=True, hi_closed=True), integer=True) = 16
    mlp_expansion: number(Range(0, 64, hi_closed=True)) = 4.0
    positions: Literal["rotary", "conv", "none"] = "rotary"

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelConfig:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must divide d_model ({self.d_model}): each head "
                f"gets d_model / n_heads channels"
            )
        return self

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class Spec(BaseModel):
    """One memory model: a choice per MIRAS axis plus the Omega window. Immutable.

    Build it with `load_spec` (a path, YAML text or a dict) to get every problem as one
    `SpecError`; `Spec(...)` validates too but raises pydantic's `ValidationError`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Slug
    description: str = ""
    memory: one_of("memory") = MatrixMemory()
    feature_map: one_of("feature_map") = IdentityMap()
    bias: one_of("bias") = L2Bias()
    retention: one_of("retention") = NoRetention()
    optimizer: one_of("optimizer") = GD()
    window: Window = Window()
    model: ModelConfig = ModelConfig()

    @model_validator(mode="after")
    def _compatible(self) -> Spec:
        problems = [problem for rule in COMPATIBILITY_RULES for problem in rule(self)]
        if problems:
            raise CarriesProblems(problems)  # every one, as it is
        return self

    def components(self) -> dict[str, Component]:
        """Spec field -> its component, in catalogue order."""
        return {field: getattr(self, field) for field in CATALOGUE}

    def gates(self) -> list[str]:
        """Names of the data-dependent gates the rule takes, in field order. Softmax attention
        (nonparametric memory) takes none: it has no inner step for a gate to scale."""
        if not self.memory.parametric:
            return []
        names = [gate for comp in self.components().values() for gate in comp.gates()]
        return list(dict.fromkeys([*names, *self.window.gates()]))

    def normalized(self) -> dict[str, Any]:
        """The long form of every field, defaults filled, in field order; JSON-able."""
        return self.model_dump(mode="json")

    def digest(self) -> str:
        """sha256 of the canonical JSON of `normalized()` without `description` and `model`
        (the model around the memory does not change its rule): the compile-cache key."""
        data = {k: v for k, v in self.normalized().items() if k not in ("description", "model")}
        canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)
        return hashlib.sha256(canonical.encode()).hexdigest()

    def to_yaml(self) -> str:
        """The long form as YAML; `load_spec` reads it back to an equal spec."""
        return yaml.safe_dump(self.normalized(), sort_keys=False)


# ---------------------------------------------------------------------------------------------
# Compatibility rules: each takes a structurally valid spec and returns its problems.


def nonparametric_is_attention(spec: Spec) -> list[Problem]:
    """Nonparametric memory is softmax attention, the closed-form minimizer of the l2 objective:
    no gradient step, nothing to retain, no feature map and no Omega window to apply."""
    if spec.memory.parametric:
        return []
    why = "nonparametric memory is softmax attention, the closed-form solution"
    only = {"bias": "l2", "retention": "none", "optimizer": "gd", "feature_map": "identity"}
    problems = [
        Problem(f"{field}.kind", f"{why}; it takes only {field} {kind}, got {comp.kind!r}")
        for field, kind in only.items()
        if (comp := getattr(spec, field)).kind != kind
    ]
    if spec.window.c != 1:
        problems.append(
            Problem(
                "window.c",
                f"{why}; it takes only c = 1, got {spec.window.c}; "
                "use memory.window for sliding-window attention",
            )
        )
    return problems


def positive_state_needs_positive_init(spec: Spec) -> list[Problem]:
    """KL takes log W_{t-1}, and a Bregman potential with log terms lives on w > 0 or
    0 < w < 1: the initial state must lie in the retention's domain, which zeros do not."""
    domain = spec.retention.domain()
    if domain != "real" and spec.memory.chosen_initial_state() == "zeros":
        return [
            Problem(
                "memory.init",
                f"{spec.retention.kind} retention needs an initial state in its domain "
                f"({domain}): zeros are outside it (log 0 is -inf); use init: uniform or leave "
                "init unset",
            )
        ]
    return []


def parameter_names_are_unique(spec: Spec) -> list[Problem]:
    """Gates are passed to the rule by name and become one sympy symbol per name, so a custom
    parameter cannot share its name with another component's gate (set or fixed)."""
    owners: dict[str, list[str]] = {}
    for field, comp in spec.components().items():
        params = comp.user_parameters()  # custom components: user-named parameters
        for name in dict.fromkeys([*comp.gateable, *params]):
            path = f"{field}.params.{name}" if name in params else f"{field}.{name}"
            owners.setdefault(name, []).append(path)
    weight = spec.window.weight_gate
    owners.setdefault(weight, []).append(f"window.{weight}")
    problems = []
    for name, paths in owners.items():
        custom = [p for p in paths if ".params." in p]
        for path in custom if len(paths) > 1 else []:
            others = ", ".join(p for p in paths if p != path)
            problems.append(
                Problem(
                    path,
                    f"parameter name '{name}' is also the gate {others}; gates are passed by "
                    "name, so rename the parameter",
                )
            )
    return problems


def feature_map_within_budget(spec: Spec) -> list[Problem]:
    """A feature map with a width budget (exp_kernel's max_features) at the model's head width."""
    why = spec.feature_map.width_problem(spec.model.head_dim)
    return [Problem("feature_map.max_features", why)] if why else []


def residual_needs_equal_widths(spec: Spec) -> list[Problem]:
    """MIRAS's residual memory M(x) = x + LN(MLP(x)) adds its input phi(k), Dphi wide, to an
    output Dv = head width wide: a feature map that widens the features cannot feed it."""
    field = spec.memory.residual_field()
    if field is None:
        return []
    d = spec.model.head_dim
    d_phi = spec.feature_map.output_dim(d)
    if d_phi == d:
        return []
    return [
        Problem(
            f"memory.{field}",
            f"x + LN(MLP(x)) adds the memory's input phi(k) to its output, so it needs "
            f"Dphi = Dv; the {spec.feature_map.kind} feature map gives Dphi = {d_phi} at the "
            f"head width {d} (Dv = {d}); use a map that keeps the width or {field}: false",
        )
    ]


def components_accept_the_spec(spec: Spec) -> list[Problem]:
    """Each component's own refusals of the rest of the spec (`Component.spec_problems`): a
    combination only that component knows it cannot run."""
    return [p for comp in spec.components().values() for p in comp.spec_problems(spec)]


COMPATIBILITY_RULES: list[Callable[[Spec], list[Problem]]] = [
    nonparametric_is_attention,
    positive_state_needs_positive_init,
    parameter_names_are_unique,
    feature_map_within_budget,
    residual_needs_equal_widths,
    components_accept_the_spec,
]


# ---------------------------------------------------------------------------------------------
# Loading


def load_spec(source: str | Path | Mapping[str, Any] | Spec) -> Spec:
    """A spec from a file path, YAML text, a dict, or a Spec (returned as is).

    A str is a path when it ends in .yaml/.yml or names an existing file, and YAML text when it
    holds a newline or ':'. Raises `SpecError` naming the source and listing every problem.
    """
    if isinstance(source, Spec):
        return source
    if isinstance(source, Mapping):
        return _validate(dict(source), SOURCE_DICT)
    if isinstance(source, (str, Path)):
        data, name = read_mapping(source, "spec", SpecError, Spec.model_fields)
        return _validate(data, name)
    raise TypeError(
        f"load_spec takes a path, YAML text, a dict or a Spec, got {type(source).__name__}"
    )


def _validate(data: dict[str, Any], source: str) -> Spec:
    try:
        return Spec.model_validate(data)
    except ValidationError as err:
        problems = translate(
            err, Spec, unknown_hint=_elsewhere, model_error_field=_custom_component_field
        )
        raise SpecError(source, problems) from None


def _custom_component_field(cls: type[BaseModel], message: str) -> str:
    """A custom component's own validator failed: point at its parameters or its formula (the
    one text field besides `kind`)."""
    if not issubclass(cls, Component):
        return ""
    if message.startswith("parameter name"):
        return "params"
    texts = [n for n, f in cls.model_fields.items() if f.annotation is str and n != "kind"]
    return texts[0] if len(texts) == 1 else ""


def _elsewhere(owner: Any, path: list[Any], name: str) -> str:
    """'; grad_at is a field of l2 retention only (...)' when other kinds have the field."""
    field = path[0] if len(path) == 2 else None
    if field not in CATALOGUE:
        return ""
    kinds = [kind for kind, cls in CATALOGUE[field].items() if name in cls.model_fields]
    if not kinds:
        return ""
    reason = FIELD_REASONS.get((field, name))
    why = f" ({reason})" if reason else ""
    only = " only" if len(kinds) == 1 else ""
    return f"; {name} is a field of {', '.join(kinds)} {field}{only}{why}"
