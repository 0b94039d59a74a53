"""Specs: short and long forms, sources, normal form and digest, and every error at once."""

from __future__ import annotations

import builtins
import json
import os
import re
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from miras.components.bias.lp import LpBias
from miras.errors import SpecError
from miras.spec import COMPATIBILITY_RULES, Spec, Window, load_spec

ROOT = Path(__file__).resolve().parents[2]

# The spec sketch of docs/architecture.md, word for word.
SKETCH = """\
name: gated-deltanet
memory: matrix            # or {kind: mlp, depth: 2, expansion: 4, activation: gelu}
feature_map: identity     # or {kind: polynomial, degree: 2}
bias: l2                  # or {kind: lp, p: 3} | {kind: huber} | {kind: custom, loss: "log(cosh(e))"}
retention: {kind: l2, grad_at: retained}   # none | l2 | lq | kl | elastic_net | bregman
optimizer: gd             # gd | momentum | muon
window: 1                 # Omega context c
"""


def problems_of(source) -> list:
    with pytest.raises(SpecError) as info:
        load_spec(source)
    return info.value.problems


# --- forms, sources, defaults ----------------------------------------------------------------


def test_design_sketch_loads():
    spec = load_spec(SKETCH)
    assert spec.name == "gated-deltanet"
    assert spec.retention.kind == "l2" and spec.retention.grad_at == "retained"
    assert spec.gates() == ["decay", "lr"]


def test_short_and_long_forms_are_equal():
    short = {
        "name": "x",
        "memory": "mlp",
        "feature_map": "taylor",
        "bias": "huber",
        "retention": "l2",
        "optimizer": "muon",
        "window": 4,
    }
    long = {
        "name": "x",
        "memory": {"kind": "mlp"},
        "feature_map": {"kind": "taylor"},
        "bias": {"kind": "huber"},
        "retention": {"kind": "l2"},
        "optimizer": {"kind": "muon"},
        "window": {"c": 4},
    }
    assert load_spec(short) == load_spec(long)
    assert load_spec(short).window == Window(c=4, gamma=1.0)


def test_component_instances_are_accepted():
    assert Spec(name="x", bias=LpBias(p=3)) == load_spec({"name": "x", "bias": {"kind": "lp"}})


def test_defaults():
    spec = load_spec({"name": "minimal"})
    kinds = {field: comp.kind for field, comp in spec.components().items()}
    assert kinds == {
        "memory": "matrix",
        "feature_map": "identity",
        "bias": "l2",
        "retention": "none",
        "optimizer": "gd",
    }
    assert spec.description == ""
    assert spec.window == Window()
    assert (spec.window.c, spec.window.gamma) == (1, 1.0)
    assert spec.gates() == ["lr"]


def test_every_source_gives_the_same_spec(tmp_path):
    path = tmp_path / "sketch.yaml"
    path.write_text(SKETCH)
    other = tmp_path / "sketch.spec"  # an existing file is a path whatever its suffix
    other.write_text(SKETCH)
    expected = load_spec(yaml.safe_load(SKETCH))
    for source in (SKETCH, path, str(path), str(other), expected):
        assert load_spec(source) == expected


def test_one_line_yaml_text_is_text():
    assert load_spec("name: one-line").name == "one-line"


def test_shipped_specs_load():
    paths = sorted((ROOT / "specs").rglob("*.yaml"))
    for path in paths:
        load_spec(path)


def test_gates_in_field_order_with_window_gamma():
    spec = load_spec(
        {
            "name": "x",
            "bias": {"kind": "custom", "loss": "a * e**2", "params": {"a": "gate"}},
            "retention": "l2",
            "optimizer": "momentum",
            "window": {"c": 2, "gamma": "gate"},
        }
    )
    assert spec.gates() == ["a", "decay", "lr", "momentum", "gamma"]


def test_fixed_values_are_not_gates():
    spec = load_spec({"name": "x", "retention": {"kind": "l2", "decay": 0.9}, "optimizer": "gd"})
    assert spec.gates() == ["lr"]


# --- normal form, digest, YAML ---------------------------------------------------------------


def test_normalized_is_the_long_form_in_field_order():
    data = load_spec(SKETCH).normalized()
    assert list(data) == list(Spec.model_fields)
    assert data["retention"] == {"kind": "l2", "decay": "gate", "grad_at": "retained"}
    assert data["window"] == {"c": 1, "gamma": 1.0}
    assert json.loads(json.dumps(data)) == data


def test_digest_ignores_key_order_description_and_number_spelling():
    a = load_spec({"name": "x", "retention": {"kind": "l2", "decay": 1}, "window": 2})
    b = load_spec(
        {
            "window": {"gamma": 1.0, "c": 2},
            "description": "words",
            "retention": {"decay": 1.0, "kind": "l2"},
            "name": "x",
        }
    )
    assert a.digest() == b.digest()
    assert re.fullmatch("[0-9a-f]{64}", a.digest()), a.digest()  # sha256, hex


def test_digest_changes_with_the_math():
    base = {"name": "x", "retention": {"kind": "l2", "decay": 0.5}}
    other = {"name": "x", "retention": {"kind": "l2", "decay": 0.6}}
    assert load_spec(base).digest() != load_spec(other).digest()


@pytest.mark.parametrize(
    "spec",
    [
        pytest.param(SKETCH, id="sketch"),
        pytest.param(
            {
                "name": "custom",
                "description": "a: colon, and a 'quote'",
                "memory": {"kind": "mlp", "depth": 3, "residual_norm": True},
                "feature_map": {"kind": "custom", "formula": "x + b * x**3", "params": {"b": 0.5}},
                "bias": {"kind": "custom", "loss": "c**2*log(1 + e**2/c**2)", "params": {"c": 2}},
                "retention": {"kind": "bregman"},
                "optimizer": {"kind": "muon", "ns_steps": 3},
                "window": {"c": 8, "gamma": "gate"},
            },
            id="custom-everything",
        ),
    ],
)
def test_to_yaml_round_trips(spec):
    loaded = load_spec(spec)
    again = load_spec(loaded.to_yaml())
    assert again == loaded
    assert again.description == loaded.description
    assert again.digest() == loaded.digest()


# --- bad specs: one problem each, with its path and what to do -------------------------------

BAD = [
    pytest.param(
        {"bias": "huberr"},
        "bias.kind",
        ["'huberr'", "dot, l2", "did you mean 'huber'"],
        id="kind-typo",
    ),
    pytest.param(
        {"retention": "elastic-net"},
        "retention.kind",
        ["did you mean 'elastic_net'"],
        id="kind-dash",
    ),
    pytest.param(
        {"bias": {"kind": "huberr", "delta": "x", "extra": 1}},
        "bias.kind",
        ["did you mean 'huber'"],
        id="bad-kind-hides-its-fields",
    ),
    pytest.param(
        {"bias": {"p": 3}}, "bias.kind", ["missing 'kind'", "allowed kinds"], id="kind-missing"
    ),
    pytest.param({"bias": 3}, "bias", ["bias kind", "got 3"], id="component-not-a-mapping"),
    pytest.param(
        {"memory": {"kind": "mlp", "depht": 2}},
        "memory.depht",
        [
            "unknown field 'depht'",
            "allowed fields: kind, depth, expansion, activation, residual_norm",
            "did you mean 'depth'",
        ],
        id="field-typo",
    ),
    pytest.param(
        {"memory": {"kind": "matrix", "depth": 2}},
        "memory.depth",
        ["allowed fields: kind, init", "depth is a field of mlp memory only"],
        id="field-of-another-kind",
    ),
    pytest.param(
        {"retension": "l2"}, "retension", ["did you mean 'retention'"], id="top-level-typo"
    ),
    pytest.param(
        {"bias": {"kind": "custom"}},
        "bias.loss",
        ["missing required field 'loss'"],
        id="custom-bias-without-loss",
    ),
    pytest.param(
        {"memory": {"kind": "mlp", "depth": "two"}},
        "memory.depth",
        ["an integer in [1, 8]", "'two'"],
        id="wrong-type",
    ),
    pytest.param(
        {"memory": {"kind": "mlp", "depth": 2.5}},
        "memory.depth",
        ["an integer"],
        id="not-an-integer",
    ),
    pytest.param(
        {"retention": {"kind": "l2", "decay": 1.5}},
        "retention.decay",
        ["(0, 1]", "1.5"],
        id="gate-out-of-range",
    ),
    pytest.param(
        {"optimizer": {"kind": "gd", "lr": "gat"}},
        "optimizer.lr",
        ["did you mean 'gate'"],
        id="gate-typo",
    ),
    pytest.param(
        {"optimizer": {"kind": "gd", "lr": "1e-3"}},
        "optimizer.lr",
        ["YAML reads 1e-3 as text"],
        id="yaml-exponent-text",
    ),
    pytest.param(
        {"memory": {"kind": "mlp", "activation": "gelux"}},
        "memory.activation",
        ["gelu, silu, relu, tanh", "'gelux'", "did you mean 'gelu'"],
        id="bad-literal",
    ),
    pytest.param(
        {"memory": {"kind": "mlp", "residual_norm": "maybe"}},
        "memory.residual_norm",
        ["true or false"],
        id="bad-bool",
    ),
    pytest.param({"window": 0}, "window.c", ["[1, 1048576]", "got 0"], id="window-zero"),
    pytest.param({"window": "four"}, "window", ["integer c >= 1", "'four'"], id="window-text"),
    pytest.param(
        {"window": {"c": 2, "gamma": -1}}, "window.gamma", ["(0, inf)"], id="window-gamma"
    ),
    pytest.param({"name": "has space"}, "name", ["slug"], id="name-not-a-slug"),
    pytest.param({"description": 5}, "description", ["text", "5"], id="description-not-text"),
    pytest.param(
        {"bias": {"kind": "custom", "loss": "e**2", "params": {"y": 1}}},
        "bias.params",
        ["'y' is reserved"],
        id="reserved-param-name",
    ),
    pytest.param(
        {"bias": {"kind": "custom", "loss": "e**2 * c", "params": {"c": 1, "delta": 2}}},
        "bias.params",
        ["'delta' is declared in params but not used in loss"],
        id="unused-param",
    ),
    pytest.param(
        {"feature_map": {"kind": "custom", "formula": "x", "params": {"scale": 2.0}}},
        "feature_map.params",
        ["'scale' is declared in params but not used in formula"],
        id="unused-feature-map-param",
    ),
    pytest.param(
        {"bias": {"kind": "custom", "loss": "e**2 * z"}},
        "bias.loss",
        ["unknown symbol 'z'"],
        id="undeclared-symbol",
    ),
    # incompatible combinations, one per rule
    pytest.param(
        {"retention": {"kind": "kl", "grad_at": "retained"}},
        "retention.grad_at",
        ["unknown field 'grad_at'", "l2 retention only", "Gated DeltaNet"],
        id="grad-at-without-l2",
    ),
    pytest.param(
        {"memory": {"kind": "matrix", "init": "zeros"}, "retention": "kl"},
        "memory.init",
        ["initial state in its domain (positive)", "log 0", "uniform"],
        id="kl-with-zero-init",
    ),
    pytest.param(
        {"memory": {"kind": "matrix", "init": "zeros"}, "retention": "bregman"},
        "memory.init",
        ["domain (unit_interval)", "zeros are outside it"],
        id="binary-entropy-with-zero-init",
    ),
    pytest.param(
        {"memory": "nonparametric", "bias": "huber"},
        "bias.kind",
        ["softmax attention", "closed-form", "only bias l2", "'huber'"],
        id="nonparametric-bias",
    ),
    pytest.param(
        {"memory": "nonparametric", "retention": "l2"},
        "retention.kind",
        ["only retention none"],
        id="nonparametric-retention",
    ),
    pytest.param(
        {"memory": "nonparametric", "optimizer": "momentum"},
        "optimizer.kind",
        ["only optimizer gd"],
        id="nonparametric-optimizer",
    ),
    pytest.param(
        {"memory": "nonparametric", "feature_map": "taylor"},
        "feature_map.kind",
        ["only feature_map identity"],
        id="nonparametric-feature-map",
    ),
    pytest.param(
        {"memory": "nonparametric", "window": 4},
        "window.c",
        ["c = 1", "memory.window"],
        id="nonparametric-window",
    ),
    pytest.param(
        {
            "bias": {"kind": "custom", "loss": "decay * e**2", "params": {"decay": 0.5}},
            "retention": "l2",
        },
        "bias.params.decay",
        ["'decay'", "retention.decay", "rename"],
        id="param-named-like-a-gate",
    ),
    pytest.param(
        {"feature_map": {"kind": "custom", "formula": "lr * x", "params": {"lr": 2.0}}},
        "feature_map.params.lr",
        ["'lr'", "optimizer.lr"],
        id="map-param-named-like-a-gate",
    ),
    pytest.param(
        {"bias": {"kind": "custom", "loss": "gamma * e**2", "params": {"gamma": 1.0}}},
        "bias.params.gamma",
        ["window.gamma"],
        id="param-named-like-window-gamma",
    ),
    pytest.param(
        {"feature_map": {"kind": "exp_kernel", "order": 4}},  # d = 64 / 2 heads = 32
        "feature_map.max_features",
        ["order 4", "d = 32", "C(d + P, P) = 58905", "max_features = 4096", "lower order"],
        id="exp-kernel-over-budget",
    ),
    pytest.param(
        {"memory": {"kind": "mlp", "residual_norm": True}, "feature_map": "taylor"},
        "memory.residual_norm",
        ["needs Dphi = Dv", "Dphi = 561 at the head width 32", "residual_norm: false"],
        id="residual-with-widening-map",
    ),
    pytest.param(
        {"window": "all"},
        "window",
        ["'global'", "got 'all'"],
        id="window-not-global",
    ),
    pytest.param(
        {"retention": "kl", "optimizer": {"kind": "gd", "steps": 2}},
        "optimizer.steps",
        ["steps: 2", "decay once per token", "none or l2", "'kl'"],
        id="gd-steps-with-kl",
    ),
    pytest.param(
        {"retention": {"kind": "l2", "decay": 0.9}, "optimizer": {"kind": "gd", "steps": 3}},
        "retention.decay",
        ["steps: 3", "once per token", "'gate'", "or 1", "got 0.9"],
        id="gd-steps-with-fixed-decay",
    ),
    pytest.param(
        {"optimizer": {"kind": "gd", "steps": 2}, "window": 2},
        "window.c",
        ["steps: 2", "Omega window", "window 1", "got 2"],
        id="gd-steps-with-window",
    ),
    pytest.param(
        {"optimizer": {"kind": "gd", "keys": "per_step"}},
        "optimizer.steps",
        ["per_step", "steps >= 2", "got steps: 1"],
        id="gd-per-step-keys-one-step",
    ),
    pytest.param(
        {"memory": "nonparametric", "optimizer": {"kind": "gd", "steps": 2}},
        "optimizer.steps",
        ["softmax attention", "steps 1"],
        id="gd-steps-with-attention",
    ),
    pytest.param(
        {"optimizer": {"kind": "gd", "steps": 17}},
        "optimizer.steps",
        ["[1, 16]", "got 17"],
        id="gd-steps-over-the-limit",
    ),
]


@pytest.mark.parametrize(("spec", "path", "words"), BAD)
def test_bad_spec(spec, path, words):
    problems = problems_of({"name": "bad", **spec})
    assert [p.path for p in problems] == [path]
    message = problems[0].message
    for word in words:
        assert word in message
    assert "\n" not in message and "pydantic" not in message and "http" not in message


def test_every_compatibility_rule_has_a_case():
    ids = {param.id for param in BAD}
    covered = {
        "nonparametric_is_attention": "nonparametric-bias",
        "positive_state_needs_positive_init": "kl-with-zero-init",
        "parameter_names_are_unique": "param-named-like-a-gate",
        "feature_map_within_budget": "exp-kernel-over-budget",
        "residual_needs_equal_widths": "residual-with-widening-map",
        "components_accept_the_spec": "gd-steps-with-kl",
    }
    assert [rule.__name__ for rule in COMPATIBILITY_RULES] == list(covered)
    assert set(covered.values()) <= ids


@pytest.mark.parametrize(
    "spec",
    [
        pytest.param({"memory": {"kind": "nonparametric", "window": 64}}, id="swa"),
        pytest.param(
            {"memory": {"kind": "matrix", "init": "uniform"}, "retention": "kl"}, id="kl-uniform"
        ),
        pytest.param({"memory": "mlp", "retention": "kl"}, id="kl-mlp"),
        pytest.param({"memory": "gated_mlp", "retention": "bregman"}, id="bregman-gated-mlp"),
        pytest.param({"memory": {"kind": "mlp", "residual_norm": True}}, id="residual-norm"),
        pytest.param({"memory": "matrix", "optimizer": "muon"}, id="muon-matrix"),
        pytest.param({"memory": "gated_mlp", "optimizer": "muon"}, id="muon-gated-mlp"),
        pytest.param({"window": {"c": 1, "gamma": "gate"}}, id="gamma-with-c-1"),
        pytest.param({"retention": {"kind": "l2", "grad_at": "retained"}}, id="grad-at-on-l2"),
    ],
)
def test_compatible_combinations(spec):
    load_spec({"name": "fine", **spec})


def test_direct_construction_checks_compatibility_too():
    with pytest.raises(ValidationError, match="softmax attention"):
        Spec(name="x", memory="nonparametric", bias="huber")


def test_every_problem_is_reported_at_once():
    problems = problems_of(
        {
            "name": "many problems",
            "memory": {"kind": "mlp", "depht": 2, "activation": "gelux"},
            "bias": "huberr",
            "retention": {"kind": "l2", "decay": 1.5},
            "optimizer": {"kind": "momentum", "momentum": 1.0},
            "window": {"c": 0},
            "extra": 1,
        }
    )
    assert sorted(p.path for p in problems) == sorted(
        [
            "name",
            "memory.depht",
            "memory.activation",
            "bias.kind",
            "retention.decay",
            "optimizer.momentum",
            "window.c",
            "extra",
        ]
    )


def test_every_incompatibility_is_reported_at_once():
    problems = problems_of(
        {"name": "x", "memory": "nonparametric", "bias": "dot", "retention": "l2", "window": 3}
    )
    assert [p.path for p in problems] == ["bias.kind", "retention.kind", "window.c"]


def test_errors_name_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: bad\nbias: huberr\nwindow: 0\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    text = str(info.value)
    assert info.value.source == str(path)
    assert text.splitlines()[0] == f"{path}: 2 problems in the spec"
    assert "  - bias.kind: unknown bias kind 'huberr'" in text
    assert "  - window.c: expected an integer" in text


@pytest.mark.parametrize(
    ("source", "words"),
    [
        pytest.param(
            "name: x\nbias: {kind: lp, p: 3\n",
            ["invalid YAML at line 3, column 1"],
            id="unclosed-brace",
        ),
        pytest.param("name: x\n  bias: l2\n", ["invalid YAML at line 2"], id="bad-indent"),
        pytest.param(
            "- a\n- b\n", ["top level must be a mapping", "got list"], id="top-level-list"
        ),
        pytest.param("", ["empty"], id="empty"),
        pytest.param(
            "name: x\nbias: l2\nbias: huber\n",
            ["bias", "twice", "first at line 2, again at line 3"],
            id="duplicate-key",
        ),
    ],
)
def test_unreadable_yaml(source, words):
    with pytest.raises(SpecError) as info:
        load_spec(source)
    assert info.value.source == "<yaml text>"
    assert len(info.value.problems) == 1
    for word in words:
        assert word in str(info.value)


def test_missing_file(tmp_path):
    for source in (tmp_path / "nothere.yaml", str(tmp_path / "nothere.yml"), "nothere"):
        problems = problems_of(source)
        assert [p.message for p in problems] == ["no such file"]


def test_a_directory_is_not_a_spec(tmp_path):
    assert "cannot read" in problems_of(tmp_path)[0].message


def test_dict_source_is_named():
    with pytest.raises(SpecError, match=r"^<dict>: 1 problem in the spec"):
        load_spec({"name": "x", "bias": "huberr"})


# --- safety: nothing in a spec is ever run ---------------------------------------------------

SENTINEL = "pwned"

UNSAFE = [
    pytest.param(
        "__import__('os').system('touch {sentinel}')", "cannot be called", id="import-os-system"
    ),
    pytest.param("open('{sentinel}', 'w')", "'open' is not allowed", id="open"),
    pytest.param("{var}.__class__", "attribute access", id="attribute"),
    pytest.param("(lambda: {var})()", "lambda", id="lambda"),
    pytest.param("{var}**100000", "exponent", id="huge-exponent"),
    pytest.param("{var}**2 +", "syntax error", id="syntax-error"),
    pytest.param("[c for c in ().__class__.__bases__]", "not allowed", id="comprehension"),
]


@pytest.fixture
def nothing_runs(monkeypatch):
    """eval, exec and os.system raise if anything calls them while a spec loads."""

    def refuse(*args, **kwargs):
        raise AssertionError("a spec was evaluated")

    monkeypatch.setattr(builtins, "eval", refuse)
    monkeypatch.setattr(builtins, "exec", refuse)
    monkeypatch.setattr(os, "system", refuse)


@pytest.mark.parametrize(("formula", "words"), UNSAFE)
@pytest.mark.parametrize(
    ("field", "path"),
    [("bias", "bias.loss"), ("feature_map", "feature_map.formula")],
    ids=["bias", "feature-map"],
)
def test_unsafe_formulas_are_refused(
    tmp_path, monkeypatch, nothing_runs, formula, words, field, path
):
    monkeypatch.chdir(tmp_path)
    key, var = ("loss", "e") if field == "bias" else ("formula", "x")
    text = formula.format(sentinel=tmp_path / SENTINEL, var=var)
    source = yaml.safe_dump({"name": "unsafe", field: {"kind": "custom", key: text}})
    problems = problems_of(source)
    assert [p.path for p in problems] == [path]
    assert words in problems[0].message
    assert not (tmp_path / SENTINEL).exists()


def test_python_tags_are_refused(tmp_path, nothing_runs):
    sentinel = tmp_path / SENTINEL
    source = f"name: x\nbias: !!python/object/apply:os.system ['touch {sentinel}']\n"
    problems = problems_of(source)
    assert "could not determine a constructor" in problems[0].message
    assert not sentinel.exists()


def test_a_residual_memory_refuses_a_widening_feature_map():
    """x + LN(MLP(x)) needs Dphi = Dv: with taylor features (561 at d = 32) the spec loaded,
    compiled, and `miras check` raised a raw shape RuntimeError (found by test_spec_fuzz.py)."""
    data = {
        "name": "wide",
        "memory": {"kind": "mlp", "residual_norm": True},
        "feature_map": "taylor",
    }
    with pytest.raises(SpecError) as caught:
        load_spec(data)
    [problem] = caught.value.problems
    assert problem.path == "memory.residual_norm"
    assert "Dphi = 561 at the head width 32" in problem.message
    load_spec({**data, "feature_map": "polynomial"})  # keeps the width
