"""miras: a declarative explorer of the MIRAS design space of test-time-memorization models.

spec = miras.load_spec("specs/gated_deltanet.yaml")   # a path, a dict, or YAML text
rule = miras.compile(spec)                            # derived, checked, cached
print(rule.derivation())
result = miras.train(spec, task, steps=1000)          # a model from the spec's `model:` section
"""

from miras.errors import DerivationError, FormulaError, SpecError, TrainingDiverged
from miras.rule import Derivation, MemoryRule, compile
from miras.spec import Spec, load_spec
from miras.training import TrainResult, evaluate, train

__version__ = "0.1.0"

__all__ = [
    "Derivation",
    "DerivationError",
    "FormulaError",
    "MemoryRule",
    "Spec",
    "SpecError",
    "TrainResult",
    "TrainingDiverged",
    "__version__",
    "compile",
    "evaluate",
    "load_spec",
    "train",
]
