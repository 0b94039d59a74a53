"""miras: a declarative explorer of the MIRAS design space of test-time-memorization models.

spec = miras.load_spec("specs/gated_deltanet.yaml")   # a path, a dict, or YAML text
rule = miras.compile(spec)                            # derived, checked, cached
print(rule.derivation())
result = miras.train(spec, task, steps=1000, out_dir="runs/x")  # the spec's `model:` section
model = miras.load_model("runs/x")                    # the trained model, in eval mode

`import miras` loads nothing heavy: each public name is imported from its module on first use
(the table below), so validating a spec never pays for torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it (PEP 562: imported on first access)
LAZY: dict[str, str] = {
    "Derivation": "miras.rule",
    "MemoryRule": "miras.rule",
    "compile": "miras.rule",
    "DerivationError": "miras.errors",
    "FormulaError": "miras.errors",
    "SpecError": "miras.errors",
    "TrainingDiverged": "miras.errors",
    "Spec": "miras.spec",
    "load_spec": "miras.spec",
    "TrainConfig": "miras.training.config",
    "TrainResult": "miras.training.recipe",
    "evaluate": "miras.training.evaluation",
    "load_model": "miras.training.checkpoint",
    "train": "miras.training.recipe",
}

__all__ = [
    "Derivation",
    "DerivationError",
    "FormulaError",
    "MemoryRule",
    "Spec",
    "SpecError",
    "TrainConfig",
    "TrainResult",
    "TrainingDiverged",
    "__version__",
    "compile",
    "evaluate",
    "load_model",
    "load_spec",
    "train",
]


def lazy_names(
    package: str, table: dict[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """PEP 562 for a package whose public names live in its modules: `__getattr__` imports
    `table[name]` (a module) on first use and keeps the value in `namespace` (the package's
    globals), so later lookups skip it; an unknown name is an AttributeError, so a submodule
    of that name is still imported by `from package import name`. `__dir__` lists them."""

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(table[name]), name)
        namespace[name] = value  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted([*namespace, *table])

    return __getattr__, __dir__


__getattr__, __dir__ = lazy_names(__name__, LAZY, globals())


if TYPE_CHECKING:
    from miras.errors import DerivationError, FormulaError, SpecError, TrainingDiverged
    from miras.rule import Derivation, MemoryRule, compile
    from miras.spec import Spec, load_spec
    from miras.training.checkpoint import load_model
    from miras.training.config import TrainConfig
    from miras.training.evaluation import evaluate
    from miras.training.recipe import TrainResult, train
