"""miras: a declarative explorer of the MIRAS design space of test-time-memorization models.

spec = miras.load_spec("specs/gated_deltanet.yaml")   # a path, a dict, or YAML text
rule = miras.compile(spec)                            # derived, checked, cached
print(rule.derivation())
"""

from miras.compiler.pipeline import Derivation, MemoryRule, compile
from miras.errors import DerivationError, FormulaError, SpecError
from miras.spec import Spec, load_spec

__version__ = "0.1.0"

__all__ = [
    "Derivation",
    "DerivationError",
    "FormulaError",
    "MemoryRule",
    "Spec",
    "SpecError",
    "__version__",
    "compile",
    "load_spec",
]
