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
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from miras.components import CATALOGUE
from miras.components.base import POSITIVE, Component, Range, gate_or, number
from miras.components.bias.l2 import L2Bias
from miras.components.feature_map.identity import IdentityMap
from miras.components.memory.matrix import MatrixMemory
from miras.components.optimizer.gd import GD
from miras.components.retention.none import NoRetention
from miras.errors import Problem, SpecError
from miras.formula import did_you_mean

SOURCE_DICT = "<dict>"
SOURCE_TEXT = "<yaml text>"

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


def _check_slug(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise ValueError(f"expected a slug of letters, digits, '-' and '_', got {name!r}")
    return name


class Window(BaseModel):
    """ATLAS's Omega rule: the objective at step t is sum_{i=t-c+1..t} gamma_i l(W; k_i, v_i).

    `c = 1` is the online case, where `gamma` only rescales the single term (the learning rate
    does the same), so it is allowed but changes nothing worth a gate.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    c: number(Range(1, math.inf, lo_closed=True), integer=True) = 1
    gamma: gate_or(POSITIVE) = 1.0

    @model_validator(mode="before")
    @classmethod
    def _short_form(cls, value: Any) -> Any:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return {"c": value}  # `window: 4` means {c: 4}
        if isinstance(value, (Mapping, Window)):
            return value
        raise ValueError(f"expected an integer c >= 1 or a mapping {{c, gamma}}, got {value!r}")

    def gates(self) -> list[str]:
        return ["gamma"] if self.gamma == "gate" else []


class ModelConfig(BaseModel):
    """The model a spec's memory goes into (docs/models.md): sizes, the hybrid variant, and the
    backend options of its memory layers. Not part of the rule, so not part of `digest()`.

    Variants (Titans section 4, MIRAS section 5): `lmm` every block's mixer is the memory layer;
    `mal` memory layer then sliding-window attention; `mag` memory and SWA branches mixed by a
    gate; `mac` memory as context (segments); `attention` / `swa` softmax baselines that ignore
    the memory fields of the spec.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    d_model: number(Range(1, math.inf, lo_closed=True), integer=True) = 64
    n_layers: number(Range(1, 64, lo_closed=True, hi_closed=True), integer=True) = 2
    n_heads: number(Range(1, math.inf, lo_closed=True), integer=True) = 2
    variant: Literal["lmm", "mal", "mag", "mac", "attention", "swa"] = "lmm"
    swa_window: number(Range(1, math.inf, lo_closed=True), integer=True) = 64
    mac_segment: number(Range(1, math.inf, lo_closed=True), integer=True) = 32
    persistent_tokens: number(Range(0, math.inf, lo_closed=True), integer=True) = 0
    chunk_size: number(Range(1, math.inf, lo_closed=True), integer=True) = 16
    backend: Literal["chunk", "recurrent", "triton"] = "chunk"
    # "auto": exact chunks where the rule is affine in its memory, else chunk-start; "start",
    # "exact": force one (docs/chunking.md).
    chunk_mode: Literal["auto", "start", "exact"] = "auto"
    conv_size: number(Range(0, 16, lo_closed=True, hi_closed=True), integer=True) = 4
    gate_rank: number(Range(1, math.inf, lo_closed=True), integer=True) = 16
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


class _Incompatible(ValueError):
    """Raised by Spec's last validator to carry every compatibility problem through pydantic."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("; ".join(str(p) for p in problems))


class Spec(BaseModel):
    """One memory model: a choice per MIRAS axis plus the Omega window. Immutable.

    Build it with `load_spec` (a path, YAML text or a dict) to get every problem as one
    `SpecError`; `Spec(...)` validates too but raises pydantic's `ValidationError`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[str, AfterValidator(_check_slug)]
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
            raise _Incompatible(problems)
        return self

    def components(self) -> dict[str, Component]:
        """Spec field -> its component, in catalogue order."""
        return {field: getattr(self, field) for field in CATALOGUE}

    def gates(self) -> list[str]:
        """Names of the data-dependent gates the rule takes, in field order. Softmax attention
        (nonparametric memory) takes none: it has no inner step for a gate to scale."""
        if self.memory.kind == "nonparametric":
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
    if spec.memory.kind != "nonparametric":
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
    if domain != "real" and getattr(spec.memory, "init", None) == "zeros":
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
        params = getattr(comp, "params", {})  # custom components: user-named parameters
        for name in dict.fromkeys([*comp.scalars(), *params]):
            path = f"{field}.params.{name}" if name in params else f"{field}.{name}"
            owners.setdefault(name, []).append(path)
    owners.setdefault("gamma", []).append("window.gamma")
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


COMPATIBILITY_RULES: list[Callable[[Spec], list[Problem]]] = [
    nonparametric_is_attention,
    positive_state_needs_positive_init,
    parameter_names_are_unique,
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
    if isinstance(source, Path) or (isinstance(source, str) and _looks_like_path(source)):
        name = str(source)
        try:
            text = Path(source).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise SpecError(name, [Problem("", "no such file")]) from None
        except (OSError, UnicodeDecodeError) as err:
            raise SpecError(name, [Problem("", f"cannot read the file: {err}")]) from None
        return _validate(_parse_yaml(text, name), name)
    if isinstance(source, str):
        return _validate(_parse_yaml(source, SOURCE_TEXT), SOURCE_TEXT)
    raise TypeError(
        f"load_spec takes a path, YAML text, a dict or a Spec, got {type(source).__name__}"
    )


def _looks_like_path(text: str) -> bool:
    if "\n" in text or not text.strip():
        return False
    if text.endswith((".yaml", ".yml")):
        return True
    try:
        if Path(text).is_file():
            return True
    except OSError:  # e.g. a name too long for the file system: not a path
        return False
    return ":" not in text  # neither a file nor YAML: report it as a missing file


def yaml_syntax_problem(err: yaml.YAMLError) -> Problem:
    """A YAML syntax error as one problem naming the line and column (specs and studies)."""
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    what = getattr(err, "problem", None) or str(err).splitlines()[0]
    return Problem("", f"invalid YAML{where}: {what}")


def _parse_yaml(text: str, source: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(text)  # the safe loader: no tags that build Python objects
    except yaml.YAMLError as err:
        raise SpecError(source, [yaml_syntax_problem(err)]) from None
    if data is None:
        raise SpecError(source, [Problem("", "the spec is empty; expected a mapping of fields")])
    duplicates = _duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader))
    if duplicates:
        raise SpecError(source, duplicates)
    if not isinstance(data, dict):
        fields = ", ".join(Spec.model_fields)
        raise SpecError(
            source,
            [
                Problem(
                    "",
                    f"the top level must be a mapping of fields ({fields}), "
                    f"got {type(data).__name__}",
                )
            ],
        )
    return data


def _duplicate_keys(node: yaml.Node | None, prefix: str = "") -> list[Problem]:
    """safe_load keeps the last of two equal keys silently; a spec that says `bias` twice is a
    mistake worth naming. Walks the composed node tree (nothing is constructed)."""
    if not isinstance(node, yaml.MappingNode):
        return []
    problems: list[Problem] = []
    first_line: dict[str, int] = {}
    for key, value in node.value:
        name = key.value if isinstance(key, yaml.ScalarNode) else "?"
        line = key.start_mark.line + 1
        if name in first_line:
            where = f"first at line {first_line[name]}, again at line {line}"
            problems.append(Problem(prefix + name, f"the key appears twice ({where})"))
        first_line.setdefault(name, line)
        problems.extend(_duplicate_keys(value, f"{prefix}{name}."))
    return problems


def _validate(data: dict[str, Any], source: str) -> Spec:
    try:
        return Spec.model_validate(data)
    except ValidationError as err:
        raise SpecError(source, _problems(err)) from None


# ---------------------------------------------------------------------------------------------
# pydantic errors -> Problems. A component's loc carries the union tag, e.g.
# ('bias', 'lp', 'p'); the path drops it ('bias.p') and the tag picks the class.


def _problems(error: ValidationError) -> list[Problem]:
    problems: list[Problem] = []
    for item in error.errors(include_url=False):
        raised = (item.get("ctx") or {}).get("error")
        if isinstance(raised, _Incompatible):
            problems.extend(raised.problems)
        else:
            problems.append(_problem(item))
    return problems


def _owner(loc: tuple[Any, ...]) -> tuple[type[BaseModel] | None, str]:
    """The model that holds the field at `loc` (with the union tag), and a name for it."""
    head = loc[0] if loc else None
    if head in CATALOGUE and len(loc) >= 2:
        cls = CATALOGUE[head].get(loc[1])
        return cls, f"{loc[1]} {head}"
    if head == "window":
        return Window, "window"
    if head == "model":
        return ModelConfig, "model"
    return Spec, "the spec"


def _problem(item: Mapping[str, Any]) -> Problem:
    loc = tuple(item["loc"])
    in_component = bool(loc) and loc[0] in CATALOGUE
    parts = [loc[0], *loc[2:]] if in_component and len(loc) >= 2 else list(loc)
    path = ".".join(str(part) for part in parts)
    kind, value = item["type"], item.get("input")
    cls, owner = _owner(loc)
    nested = loc[:1] in (("window",), ("model",))
    depth = 2 if in_component else 1 if nested else 0  # the owner's fields
    field = str(loc[depth]) if len(loc) > depth else ""

    if kind in ("union_tag_invalid", "union_tag_not_found"):
        kinds = list(CATALOGUE[loc[0]])
        tag = item["ctx"].get("tag") if kind == "union_tag_invalid" else None
        got = f"unknown {loc[0]} kind {tag!r}" if tag is not None else "missing 'kind'"
        hint = did_you_mean(tag, kinds) if tag is not None else ""
        return Problem(f"{path}.kind", f"{got}; allowed kinds: {', '.join(kinds)}{hint}")
    if kind == "extra_forbidden" and cls is not None:
        allowed = list(cls.model_fields)
        message = f"unknown field {field!r}; allowed fields: {', '.join(allowed)}"
        return Problem(path, message + did_you_mean(field, allowed) + _elsewhere(loc[0], field))
    if kind == "missing":
        return Problem(path, f"missing required field {field!r} of {owner}")
    if kind == "literal_error":
        allowed = _literals(cls, field)
        hint = did_you_mean(value, allowed) if isinstance(value, str) else ""
        shown = ", ".join(str(a) for a in allowed) or item["ctx"].get("expected", "")
        return Problem(path, f"expected one of {shown}, got {value!r}{hint}")
    if kind in ("value_error", "assertion_error"):
        return _value_problem(path, cls, item, value)
    return Problem(path, f"expected {_TYPES.get(kind, _plain(item['msg']))}, got {value!r}")


_TYPES = {
    "string_type": "text",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
}


def _plain(msg: str) -> str:
    """pydantic's 'Input should be a valid list' -> 'a valid list'."""
    return msg.removeprefix("Input should be ").rstrip(".")


def _value_problem(path: str, cls: Any, item: Mapping[str, Any], value: Any) -> Problem:
    raised = (item.get("ctx") or {}).get("error")
    message = str(raised) if raised is not None else _plain(item["msg"])
    formula = _formula_field(cls)
    if formula and "." not in path:
        # A custom component's own validator failed: a parameter name or the formula.
        path += ".params" if message.startswith("parameter name") else f".{formula}"
    if isinstance(value, str) and _is_float_text(value):
        # YAML 1.1 floats need a dot and a signed exponent: 1e-3 and 1.0e3 are strings.
        message += f"; YAML reads {value} as text: write a dot and a signed exponent, e.g. 1.0e-3"
    return Problem(path, message)


def _formula_field(cls: Any) -> str:
    """The one text field of a custom component (its formula), or ''."""
    if cls is None or not issubclass(cls, Component):
        return ""
    texts = [n for n, f in cls.model_fields.items() if f.annotation is str and n != "kind"]
    return texts[0] if len(texts) == 1 else ""


def _is_float_text(text: str) -> bool:
    if not any(ch.isdigit() for ch in text):
        return False  # 'inf', 'nan': YAML has its own spelling (.inf), not worth a hint
    try:
        float(text)
    except ValueError:
        return False
    return True


def _literals(cls: Any, field: str) -> list[Any]:
    """The Literal values a field accepts, read from its annotation."""
    if cls is None or field not in cls.model_fields:
        return []
    found: list[Any] = []
    pending = [cls.model_fields[field].annotation]  # unwrap Optional, Annotated, unions
    while pending:
        annotation = pending.pop(0)
        if get_origin(annotation) is Literal:
            found.extend(get_args(annotation))
        else:
            pending.extend(get_args(annotation))
    return found


def _elsewhere(field: Any, name: str) -> str:
    """'; grad_at is a field of l2 retention only (...)' when other kinds have the field."""
    if field not in CATALOGUE:
        return ""
    kinds = [kind for kind, cls in CATALOGUE[field].items() if name in cls.model_fields]
    if not kinds:
        return ""
    reason = FIELD_REASONS.get((field, name))
    why = f" ({reason})" if reason else ""
    only = " only" if len(kinds) == 1 else ""
    return f"; {name} is a field of {', '.join(kinds)} {field}{only}{why}"
