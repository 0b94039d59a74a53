"""Search spaces: a template with fixed parts and distributions, parsed, sampled and probed.

A study's `spec:` and `train:` sections are templates. Any value in them may be a distribution:

    bias: {choices: [l2, dot, {kind: lp, p: {float: [1.5, 4.0]}}]}   # categorical
    model: {d_model: {choices: [16, 32]}, n_layers: 1}               # fixed parts beside it
    lr: {float: [1.0e-4, 1.0e-2], log: true}                         # train section
    window: {choices: [1, {label: omega, c: {int: [2, 8]}, gamma: gate}]}

A choice's options may hold distributions of their own, sampled only when that option is picked:
that is how conditional parameters are written (`p` exists only when the bias is lp). Optuna
parameter names are the dotted paths, with the option's label inserted below a choice:
`bias`, `bias.lp.p`, `model.d_model`, `window.omega.c`, `train.lr`.

An option's label is its `kind` (components), its own value (scalars), an explicit `label:` key
(removed before the value is used), or else its compact JSON text.

A `train:` value may also be a sweep, run inside each trial rather than searched:

    lr: {sweep: [1.0e-3, 3.0e-3, 1.0e-2, 3.0e-2]}   # every value, in this order
    lr: {sweep: {logspace: [1.0e-4, 1.0e-2, 4]}}    # 1e-4, 4.64e-4, 2.15e-3, 1e-2
    lr: {sweep: {logspace: [1.0e-4, 1.0e-2, 4], extend: true, max_extend: 3}}

A logspace sweep may extend: a trial whose selected point lies at its lowest or highest value
runs the next value past that edge (miras.search.objective; `Sweep.value_at`).

Several sweeps form their grid (`grid`, the product in template order); `sample(node, trial,
point)` puts one grid point's values in place (miras.search.objective runs them all).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from miras.errors import Problem, did_you_mean
from miras.spec.validation import float_text_hint

DISTRIBUTIONS = ("choices", "int", "float")
SWEEP = "sweep"
LOGSPACE = "logspace"
LOGSPACE_KEYS = (LOGSPACE, "extend", "max_extend")
MAX_SWEEP_POINTS = 64  # grid points of a trial's sweeps, each trained on every seed
# Points an extending sweep may add past its edge: each trains on every seed, so the limit
# keeps a trial's cost known before it starts (docs/search.md).
DEFAULT_MAX_EXTEND = 3
MAX_EXTEND = 10
RANGE_OPTIONS = ("log", "step")
# Values Optuna stores as categorical choices.
Label = str | int | float | bool | None


@dataclass(frozen=True)
class Fixed:
    """A value used as written (a scalar, a list, or a mapping with no distribution inside)."""

    value: Any


@dataclass(frozen=True)
class Group:
    """A mapping where some value, at some depth, is a distribution."""

    fields: dict[str, Node]


@dataclass(frozen=True)
class Choice:
    """A categorical parameter over options, each a template of its own.

    `path` is the study path (for messages), `spec_path` the path inside the section (where
    the value lands), `name` the Optuna parameter name."""

    name: str
    path: str
    spec_path: str
    labels: tuple[Label, ...]
    options: tuple[Node, ...]

    def option(self, label: Label) -> Node:
        return self.options[self.labels.index(label)]


@dataclass(frozen=True)
class Range:
    """A numeric parameter in [low, high]: `int` or `float`, optionally on a log scale."""

    name: str
    path: str
    spec_path: str
    kind: str  # "int" | "float"
    low: float
    high: float
    log: bool = False
    step: float | None = None


@dataclass(frozen=True)
class Sweep:
    """Fixed values all run inside one trial (not an Optuna parameter): `values` in order.

    A logspace sweep keeps its `logspace` (lo, hi, n): its values are `value_at(0..n-1)`, and
    with `extend` a trial may run up to `max_extend` more, `value_at(-1, -2, ...)` below lo or
    `value_at(n, n+1, ...)` above hi."""

    path: str
    spec_path: str
    values: tuple[Any, ...]
    logspace: tuple[float, float, int] | None = None
    extend: bool = False
    max_extend: int = 0

    def value_at(self, index: int) -> float:
        """The logspace's value at position `index`, past either end too (logspace_value)."""
        if self.logspace is None:
            raise ValueError(f"{self.path}: only a logspace sweep has values past its ends")
        return logspace_value(self.logspace, index)


def logspace_value(logspace: tuple[float, float, int], index: int) -> float:
    """Position `index` (any integer) of `logspace: [lo, hi, n]`: lo x (hi / lo) ** (index /
    (n - 1)), so each value is the one before it times (hi / lo) ** (1 / (n - 1)). The ends are
    lo and hi exactly, as written, so that a value printed in the report is the file's."""
    low, high, count = logspace
    if index == 0:
        return float(low)
    if index == count - 1:
        return float(high)
    return low * (high / low) ** (index / (count - 1))


@dataclass(frozen=True)
class Broken:
    """A malformed distribution (its problems are reported); probes leave it out."""


Node = Fixed | Group | Choice | Range | Sweep | Broken
Distribution = Choice | Range


def is_distribution(raw: Any) -> bool:
    return isinstance(raw, dict) and any(key in raw for key in DISTRIBUTIONS)


def parse(raw: Any, path: str, spec_path: str = "", name: str = "") -> tuple[Node, list[Problem]]:
    """The template node of `raw` and every problem in its distributions.

    `path` is where `raw` sits in the study file (e.g. 'spec.bias'); `spec_path` where its value
    lands in the section ('bias'); `name` the parameter-name prefix."""
    if isinstance(raw, dict) and SWEEP in raw:
        return _parse_sweep(raw, path, spec_path)
    if is_distribution(raw):
        kinds = [key for key in DISTRIBUTIONS if key in raw]
        if len(kinds) > 1:
            message = f"a distribution takes one of choices, int, float; got {' and '.join(kinds)}"
            return Broken(), [Problem(path, message)]
        if kinds[0] == "choices":
            # A choice of whole sections (`spec: {choices: [...]}`, a study over known specs)
            # has no field to name it: its parameter is the section's name ('spec').
            return _parse_choice(raw, path, spec_path, name or path)
        return _parse_range(raw, kinds[0], path, spec_path, name)
    if isinstance(raw, dict):
        fields: dict[str, Node] = {}
        problems: list[Problem] = []
        for key, value in raw.items():
            sub = f"{spec_path}.{key}" if spec_path else str(key)
            node, found = parse(value, f"{path}.{key}", sub, f"{name}.{key}" if name else str(key))
            fields[str(key)] = node
            problems += found
        if any(not isinstance(node, Fixed) for node in fields.values()):
            return Group(fields), problems
        return Fixed({key: node.value for key, node in fields.items()}), problems
    return Fixed(raw), []


def _label(option: Any, index: int) -> tuple[Label, Any]:
    """(the label of a choice's option, the option without its `label` key)."""
    if isinstance(option, dict):
        if "label" in option:
            rest = {k: v for k, v in option.items() if k != "label"}
            return option["label"], rest
        if isinstance(option.get("kind"), str):
            return option["kind"], option
        return json.dumps(option, separators=(",", ":"), sort_keys=True), option
    if option is None or isinstance(option, (str, int, float, bool)):
        return option, option
    return json.dumps(option, separators=(",", ":")), option


def _parse_choice(raw: dict, path: str, spec_path: str, name: str):
    problems = [
        Problem(
            f"{path}.{key}",
            f"unknown key of a choice; allowed: choices{did_you_mean(key, ['choices'])}",
        )
        for key in raw
        if key != "choices"
    ]
    options = raw["choices"]
    if not isinstance(options, list) or not options:
        return Broken(), [
            *problems,
            Problem(f"{path}.choices", f"expected a non-empty list of options, got {options!r}"),
        ]
    labels: list[Label] = []
    nodes: list[Node] = []
    for i, option in enumerate(options):
        label, value = _label(option, i)
        where = f"{path}.choices[{i}]"
        if not (label is None or isinstance(label, (str, int, float, bool))):
            problems.append(Problem(f"{where}.label", f"expected text or a number, got {label!r}"))
            label = str(label)
        if str(label) in map(str, labels):
            problems.append(
                Problem(
                    where,
                    f"two options share the label {label!r}; give each a distinct 'label:'",
                )
            )
        node, found = parse(value, where, spec_path, f"{name}.{label}")
        labels.append(label)
        nodes.append(node)
        problems += found
    return Choice(name, path, spec_path, tuple(labels), tuple(nodes)), problems


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _parse_range(raw: dict, kind: str, path: str, spec_path: str, name: str):
    problems = []
    allowed = [kind, *RANGE_OPTIONS]
    for key in raw:
        if key not in allowed:
            hint = did_you_mean(key, allowed)
            problems.append(
                Problem(
                    f"{path}.{key}", f"unknown key of a range; allowed: {', '.join(allowed)}{hint}"
                )
            )
    bounds = raw[kind]
    what = "integers" if kind == "int" else "numbers"
    if (
        not isinstance(bounds, list)
        or len(bounds) != 2
        or not all(_is_number(b) for b in bounds)
        or (kind == "int" and not all(float(b).is_integer() for b in bounds))
    ):
        message = f"expected [low, high], two {what}, got {bounds!r}"
        texts = [b for b in bounds if float_text_hint(b)] if isinstance(bounds, list) else []
        message += float_text_hint(texts[0]) if texts else ""
        return Broken(), [*problems, Problem(f"{path}.{kind}", message)]
    low, high = bounds
    log = raw.get("log", False)
    step = raw.get("step")
    if not isinstance(log, bool):
        problems.append(Problem(f"{path}.log", f"expected true or false, got {log!r}"))
    if low >= high:
        problems.append(Problem(f"{path}.{kind}", f"expected low < high, got [{low}, {high}]"))
    if log is True and low <= 0:
        problems.append(Problem(f"{path}.{kind}", f"a log scale needs low > 0, got {low}"))
    if step is not None:
        if not _is_number(step) or step <= 0 or (kind == "int" and not float(step).is_integer()):
            problems.append(
                Problem(f"{path}.step", f"expected a positive {what[:-1]}, got {step!r}")
            )
        elif log is True:
            # Optuna samples either on a log scale or on a grid, not both.
            problems.append(Problem(f"{path}.step", "a range takes log or step, not both"))
    if kind == "int":
        low, high = int(low), int(high)
        step = int(step) if _is_number(step) else None
    return Range(name, path, spec_path, kind, low, high, log is True, step), problems


def _parse_sweep(raw: dict, path: str, spec_path: str) -> tuple[Node, list[Problem]]:
    """A non-empty list of distinct fixed values (each checked like a fixed value later, by
    the section's probes), or a mapping {logspace: [lo, hi, n], extend, max_extend}."""
    problems = [_misplaced_sweep_key(key, path) for key in raw if key != SWEEP]
    values = raw[SWEEP]
    if isinstance(values, dict):
        node, found = _parse_logspace(values, f"{path}.{SWEEP}", path, spec_path)
        return node, [*problems, *found]
    if not isinstance(values, list) or not values:
        message = (
            f"expected a non-empty list of values or {{{LOGSPACE}: [lo, hi, n]}}, got {values!r}"
        )
        return Broken(), [*problems, Problem(f"{path}.{SWEEP}", message)]
    seen: list[str] = []
    for i, value in enumerate(values):
        where = f"{path}.{SWEEP}[{i}]"
        if isinstance(value, (dict, list)):
            message = f"expected a fixed value (a number, text, true/false or null), got {value!r}"
            problems.append(Problem(where, message))
            continue
        text = json.dumps(value)
        if text in seen:
            message = f"{value!r} appears twice (it is also {SWEEP}[{seen.index(text)}])"
            problems.append(Problem(where, message))
        seen.append(text)
    return Sweep(path, spec_path, tuple(values)), problems


def _misplaced_sweep_key(key: Any, path: str) -> Problem:
    """A key beside `sweep:`. `extend` there is a common slip: it belongs inside the logspace
    mapping, the one form that knows which value lies past an edge."""
    if key in LOGSPACE_KEYS:
        message = (
            f"{key} goes inside a logspace sweep: {{{SWEEP}: {{{LOGSPACE}: [lo, hi, n], "
            f"extend: true}}}}; a list of values does not extend"
        )
        return Problem(f"{path}.{key}", message)
    return Problem(f"{path}.{key}", f"unknown key of a sweep; allowed: {SWEEP}")


def _parse_logspace(
    raw: dict, path: str, sweep_path: str, spec_path: str
) -> tuple[Node, list[Problem]]:
    """{logspace: [lo, hi, n], extend: bool, max_extend: int}: n values from lo to hi, spaced
    evenly on a log scale (0 < lo < hi, n an integer from 2 to MAX_SWEEP_POINTS). `path` is
    the mapping's study path (train.lr.sweep), `sweep_path` the sweep's own (train.lr)."""
    problems = [
        Problem(
            f"{path}.{key}",
            f"unknown key of a logspace sweep; allowed: {', '.join(LOGSPACE_KEYS)}"
            f"{did_you_mean(str(key), list(LOGSPACE_KEYS))}",
        )
        for key in raw
        if key not in LOGSPACE_KEYS
    ]
    extend = raw.get("extend", False)
    if not isinstance(extend, bool):
        problems.append(Problem(f"{path}.extend", f"expected true or false, got {extend!r}"))
    max_extend = raw.get("max_extend", DEFAULT_MAX_EXTEND)
    if "max_extend" in raw:
        problems += _max_extend_problems(max_extend, extend is True, f"{path}.max_extend")
    if LOGSPACE not in raw:
        message = f"a sweep mapping needs {LOGSPACE}: [lo, hi, n] (or give the values as a list)"
        return Broken(), [*problems, Problem(path, message)]
    bounds = _logspace_bounds(raw[LOGSPACE], f"{path}.{LOGSPACE}")
    if isinstance(bounds, list):
        return Broken(), [*problems, *bounds]
    values = tuple(logspace_value(bounds, i) for i in range(bounds[2]))
    extends = extend is True
    node = Sweep(sweep_path, spec_path, values, bounds, extends, max_extend if extends else 0)
    return node, problems


def _max_extend_problems(value: Any, extend: bool, path: str) -> list[Problem]:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_EXTEND:
        return [Problem(path, f"expected an integer from 1 to {MAX_EXTEND}, got {value!r}")]
    if not extend:
        message = "only with extend: true (it bounds the points added past an edge)"
        return [Problem(path, message)]
    return []


def _logspace_bounds(raw: Any, path: str) -> tuple[float, float, int] | list[Problem]:
    """(lo, hi, n) of `logspace: [lo, hi, n]`, or its problems."""
    if not isinstance(raw, list) or len(raw) != 3:
        message = f"expected [lo, hi, n]: the lowest value, the highest and how many, got {raw!r}"
        texts = [b for b in raw if float_text_hint(b)] if isinstance(raw, list) else []
        return [Problem(path, message + (float_text_hint(texts[0]) if texts else ""))]
    low, high, count = raw
    problems = []
    if not _is_number(low) or low <= 0:
        message = f"expected the lowest value, a number > 0 (a log scale), got {low!r}"
        problems.append(Problem(f"{path}[0]", message + float_text_hint(low)))
    if not _is_number(high) or (_is_number(low) and high <= low):
        above = f"lo = {low}" if _is_number(low) else "lo"
        message = f"expected the highest value, a number > {above}, got {high!r}"
        problems.append(Problem(f"{path}[1]", message + float_text_hint(high)))
    if not isinstance(count, int) or isinstance(count, bool) or not 2 <= count <= MAX_SWEEP_POINTS:
        message = (
            f"expected how many values, an integer from 2 to {MAX_SWEEP_POINTS}, got {count!r}"
        )
        problems.append(Problem(f"{path}[2]", message))
    return problems or (float(low), float(high), count)


def sweeps(node: Node) -> Iterator[Sweep]:
    """Every sweep in the template, in template order (options of choices included)."""
    if isinstance(node, Group):
        for child in node.fields.values():
            yield from sweeps(child)
    elif isinstance(node, Choice):
        for option in node.options:
            yield from sweeps(option)
    elif isinstance(node, Sweep):
        yield node


def grid(node: Node) -> list[dict[str, Any]]:
    """The sweep points of a template: the product of its sweeps, the first sweep varying
    slowest, each point {spec_path: value}. One empty point when the template has no sweep."""
    points: list[dict[str, Any]] = [{}]
    for sweep in sweeps(node):
        points = [{**point, sweep.spec_path: value} for point in points for value in sweep.values]
    return points


# ---------------------------------------------------------------------------------------------
# Sampling


def sample(node: Node, trial: Any, point: dict[str, Any] | None = None) -> Any:
    """The value of the template for one Optuna trial (`trial.suggest_*` for each distribution
    on the way; the options not picked are not visited, so their parameters do not exist).
    `point`: the values of the sweeps (one of `grid(node)`); a template with a sweep needs it."""
    if isinstance(node, Fixed):
        return _copy(node.value)
    if isinstance(node, Group):
        return {key: sample(child, trial, point) for key, child in node.fields.items()}
    if isinstance(node, Sweep):
        if point is None or node.spec_path not in point:
            raise ValueError(f"{node.path}: a sweep needs its grid point's value to sample")
        return _copy(point[node.spec_path])
    if isinstance(node, Choice):
        label = trial.suggest_categorical(node.name, list(node.labels))
        return sample(node.option(label), trial, point)
    if node.kind == "int":
        return trial.suggest_int(node.name, node.low, node.high, step=node.step or 1, log=node.log)
    return trial.suggest_float(node.name, node.low, node.high, step=node.step, log=node.log)


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def distributions(node: Node) -> Iterator[Distribution]:
    """Every distribution in the template, options' nested ones included."""
    if isinstance(node, Group):
        for child in node.fields.values():
            yield from distributions(child)
    elif isinstance(node, Choice):
        yield node
        for option in node.options:
            yield from distributions(option)
    elif isinstance(node, Range):
        yield node


# ---------------------------------------------------------------------------------------------
# Validation probes. A template is checked without sampling: one probe holds only the fixed
# parts (searched fields are left out, so their defaults apply), then one probe per option of
# each distribution (and per bound of each range), with everything else as in the first. A
# problem is blamed on the option that was varied when its path lies under that option, and on
# the fixed parts when no distribution touches its path; other problems come from a combination
# the probe made up, and are left for the trial to prune.

_MISSING = object()


def fixed_part(node: Node) -> Any:
    """The template with every distribution left out (`_MISSING` for a distribution itself)."""
    if isinstance(node, Fixed):
        return _copy(node.value)
    if isinstance(node, Group):
        parts = {key: fixed_part(child) for key, child in node.fields.items()}
        return {key: value for key, value in parts.items() if value is not _MISSING}
    return _MISSING


@dataclass(frozen=True)
class Probe:
    """A value of the template, and which option it tries: `owner` is the study path to blame
    (None for the fixed-parts probe), `spec_path` where that option's value lands."""

    value: Any
    owner: str | None = None
    spec_path: str = ""


def probes(node: Node) -> Iterator[Probe]:
    yield Probe(fixed_part(node))
    yield from _varied(node)


def _varied(node: Node) -> Iterator[Probe]:
    if isinstance(node, Group):
        base = fixed_part(node)
        for key, child in node.fields.items():
            for probe in _varied(child):
                yield Probe({**base, key: probe.value}, probe.owner, probe.spec_path)
    elif isinstance(node, Choice):
        for i, option in enumerate(node.options):
            value = fixed_part(option)
            if value is not _MISSING:
                yield Probe(value, f"{node.path}.choices[{i}]", node.spec_path)
            yield from _varied(option)
    elif isinstance(node, Range):
        for i, bound in enumerate((node.low, node.high)):
            yield Probe(bound, f"{node.path}.{node.kind}[{i}]", node.spec_path)
    elif isinstance(node, Sweep) and node.logspace is not None:
        # Its values lie between its ends, so the ends stand for them all (as a range's bounds
        # do); a problem names the logspace, whose values are not written in the file.
        for i, end in enumerate(node.logspace[:2]):
            yield Probe(end, f"{node.path}.{SWEEP}.{LOGSPACE}[{i}]", node.spec_path)
    elif isinstance(node, Sweep):
        for i, value in enumerate(node.values):
            if not isinstance(value, (dict, list)):  # those are refused by _parse_sweep
                yield Probe(value, f"{node.path}.{SWEEP}[{i}]", node.spec_path)


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".") or prefix == ""


def check_template(
    node: Node, section: str, validate: Callable[[dict[str, Any]], list[Problem]]
) -> list[Problem]:
    """Every problem of the template's values, blamed on the study path that causes it.

    `validate` takes one value of the section and returns its problems, with paths inside the
    section ('bias.kind')."""
    searched = [d.spec_path for d in (*distributions(node), *sweeps(node))]
    found: dict[tuple[str, str], Problem] = {}
    for probe in probes(node):
        value = probe.value if isinstance(probe.value, dict) else {}
        for problem in validate(value):
            where = problem.path
            if probe.owner is not None and _under(where, probe.spec_path):
                rest = where[len(probe.spec_path) :] if probe.spec_path else f".{where}"
                path = probe.owner + (rest if rest.startswith(".") or not rest else f".{rest}")
            elif not any(_under(where, d) or _under(d, where) for d in searched):
                path = f"{section}.{where}" if where else section
            else:
                continue  # a made-up combination of the probe: the trial prunes it if it occurs
            found.setdefault((path, problem.message), Problem(path, problem.message))
    return list(found.values())
