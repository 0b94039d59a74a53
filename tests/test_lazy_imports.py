"""Import cost is paid where it is used: loading and validating a spec, `miras validate`, the
training config the CLI reads its defaults from, and `import miras` itself load no torch; a
spec without formula text loads and validates without sympy too (docs/spec.md).
Each check runs in a fresh interpreter, since this test process has torch loaded already."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted([*ROOT.glob("specs/*.yaml"), *ROOT.glob("specs/examples/*.yaml")])
# The spec fields that hold formula text, parsed (by sympy) when the spec is validated.
FORMULA_FIELDS = {"loss", "formula", "potential", "f"}


def has_formula(path: Path) -> bool:
    sections = yaml.safe_load(path.read_text()).values()
    return any(isinstance(s, dict) and FORMULA_FIELDS & s.keys() for s in sections)


FORMULA_FREE = [p for p in SPECS if not has_formula(p)]


def loaded_after(code: str) -> set[str]:
    """The top-level modules a fresh interpreter holds after running `code`."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True
    )
    return {name.split(".")[0] for name in json.loads(done.stdout.splitlines()[-1])}


@pytest.mark.parametrize(
    "code",
    [
        pytest.param("import miras", id="import-miras"),
        pytest.param(
            "import miras.errors, miras.spec.validation, miras.training.config", id="layers"
        ),
    ],
)
def test_the_package_and_the_validation_layer_load_neither_torch_nor_sympy(code):
    loaded = loaded_after(code)
    assert "torch" not in loaded and "sympy" not in loaded


# The `hf` extra's packages: only `import miras.hf` (and the text task's files) load them.
HF_PACKAGES = {"transformers", "tokenizers", "datasets", "lm_eval", "safetensors"}


def test_import_miras_and_its_models_load_none_of_the_hf_extra():
    loaded = loaded_after("import miras, miras.models, miras.training.recipe")
    assert not HF_PACKAGES & loaded


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="the hf extra: pip install -e '.[hf]'",
)
def test_import_miras_hf_loads_transformers():
    """The counterpart: the check above is not vacuous."""
    assert "transformers" in loaded_after("import miras.hf")


def test_loading_every_shipped_spec_loads_no_torch():
    paths = [str(p) for p in SPECS]
    loaded = loaded_after(f"from miras.spec import load_spec\nfor p in {paths!r}: load_spec(p)")
    assert "torch" not in loaded


def test_formula_free_specs_are_most_of_the_shipped_ones():
    names = {p.stem for p in FORMULA_FREE}
    assert {"deltanet", "titans", "memora", "moneta", "atlas", "attention"} <= names
    assert {"logcosh_deltanet", "cauchy_memory"}.isdisjoint(names)  # these carry a loss formula


def test_loading_every_formula_free_spec_loads_neither_torch_nor_sympy():
    paths = [str(p) for p in FORMULA_FREE]
    code = f"from miras.spec import load_spec\nfor p in {paths!r}: load_spec(p)"
    loaded = loaded_after(code)
    assert "torch" not in loaded and "sympy" not in loaded


def test_validating_formula_free_specs_loads_neither_torch_nor_sympy():
    paths = [str(p) for p in FORMULA_FREE]
    code = (
        "from typer.testing import CliRunner\nfrom miras.cli import app\n"
        f"result = CliRunner().invoke(app, ['validate', *{paths!r}])\n"
        "assert result.exit_code == 0, result.output"
    )
    loaded = loaded_after(code)
    assert "torch" not in loaded and "sympy" not in loaded


def test_a_spec_with_a_formula_parses_it_with_sympy():
    """The counterpart: the parser needs sympy, so the check above is not vacuous."""
    path = str(ROOT / "specs/examples/logcosh_deltanet.yaml")
    assert "sympy" in loaded_after(f"from miras.spec import load_spec\nload_spec({path!r})")


def test_miras_validate_loads_no_torch():
    paths = [str(p) for p in SPECS]
    code = (
        "from typer.testing import CliRunner\nfrom miras.cli import app\n"
        f"result = CliRunner().invoke(app, ['validate', *{paths!r}])\n"
        "assert result.exit_code == 0, result.output"
    )
    assert "torch" not in loaded_after(code)


def test_a_public_name_is_imported_on_first_use():
    loaded = loaded_after("import miras\nassert miras.load_spec and miras.TrainConfig")
    assert "torch" not in loaded
    assert "torch" in loaded_after("import miras\nmiras.train")
