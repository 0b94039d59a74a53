"""`MemoryRule`: the facade that joins a compiled rule (miras.ir) and the runtime.

    rule = miras.compile(spec)          # compiler passes -> CompiledRule -> MemoryRule
    o, state = rule(q, k, v, gates={...}, backend="chunk")

The compiler produces plain data and never imports the runtime; the runtime reads that data.
This module is the one place that imports both (docs/architecture.md, "The IR"): it builds
the runtime's `Program` from the compiled rule, with the Triton kernels' provider from the
compiler's emission pass, and runs it under its autocast guard.
"""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from types import ModuleType

import torch

from miras.compiler.pipeline import compile_ir
from miras.compiler.triton_kernels import TritonKernels
from miras.derive.bias_check import check_bias
from miras.derive.check import CheckResult
from miras.derive.describe import Derivation, describe
from miras.derive.precondition_check import check_precondition
from miras.derive.retention_check import check_retention
from miras.ir import BiasRule, CompiledRule, Plan, RetentionRule
from miras.runtime import run
from miras.runtime.core import Runtime
from miras.runtime.program import Program
from miras.spec import Spec, load_spec


class MemoryRule:
    """A compiled spec: derived pieces, their emitted torch functions, checks, and backends.

        o, state = rule(q, k, v, gates={"lr": beta, "decay": a}, backend="chunk",
                        chunk_size=64, initial_state=None, output_final_state=True)

    q, k [B, T, H, Dk]; v [B, T, H, Dv]; `gates` names the per-token inputs in `rule.gates`,
    each [B, T, H] (per head) or [B, T, H, Dv] (per channel), in natural space (a decay is a
    factor in (0, 1]). No scaling is applied to q. The state of a matrix memory with gd is a
    tensor [B, H, Dv, Dphi]; otherwise a dict of named tensors [B, H, out, in] (momentum
    under "S.<name>"). `params` holds learnable component parameters (`default_params()`).
    `program` is what the runtime runs (`miras.runtime.program.Program`); reading the memory
    without an update is `rule.program.read(q, state)`.
    """

    def __init__(self, compiled: CompiledRule[Spec]):
        self.ir: CompiledRule[Spec] = compiled
        self.spec: Spec = compiled.spec
        self.bias: BiasRule = compiled.bias
        self.retention: RetentionRule = compiled.retention
        self.plan: Plan = compiled.plan
        self.source: str = compiled.source
        self.functions: ModuleType = compiled.functions
        self.checks: list[CheckResult] = compiled.checks
        self.program = Program.from_ir(compiled, kernels=TritonKernels(compiled))

    @property
    def runtime(self) -> Runtime:
        """The pieces every backend calls (`self.program.runtime`)."""
        return self.program.runtime

    @property
    def gates(self) -> list[str]:
        return self.program.gates

    def default_params(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """Initial values of the learnable component parameters (polynomial coefficients)."""
        return self.program.default_params(dtype)

    def initial_state(self, batch: int, heads: int, d_key: int, d_value: int, dtype=torch.float32):
        """The default initial state for inputs of these sizes (what `initial_state=None` uses)."""
        return self.program.initial_state(batch, heads, d_key, d_value, dtype)

    def __call__(self, q, k, v, gates=None, **options):
        # Under autocast (bf16 training) the rule still computes in its state's precision,
        # float32: autocast would run its products in bf16 (docs/training.md).
        with torch.autocast(getattr(q, "device", torch.device("cpu")).type, enabled=False):
            return run(self.program, q, k, v, gates, **options)

    def derivation(self) -> Derivation:
        return describe(self.spec, self.bias, self.retention, self.plan)

    def check(self, seed: int = 0, *, triton: bool = True) -> list[CheckResult]:
        """Re-run every derived-vs-reference check on fresh random inputs, then the end-to-end
        stage: the whole rule on every backend (Triton unless `triton=False`) against an
        autograd oracle (`miras.checks.end_to_end`). The compile-time `check` pass runs the
        piece checks only: the stage takes seconds per spec."""
        from miras.checks.end_to_end import check_end_to_end

        pieces = check_bias(self.spec.bias, self.bias, seed=seed) + check_retention(
            self.spec.retention, self.retention, seed=seed
        )
        pieces += check_precondition(self.spec, self.plan, self.functions, seed=seed)
        return pieces + check_end_to_end(self, seed=seed, triton=triton)

    def __repr__(self) -> str:
        return f"MemoryRule({self.spec.name!r}, gates={self.gates})"


# The whole spec (canonical JSON) -> (the compiled rule it wraps, its MemoryRule). Compiled
# rules are shared by digest (miras.compiler.pipeline); each spec gets a rule carrying its own
# spec, model section and description included.
_RULES: dict[str, tuple[CompiledRule[Spec], MemoryRule]] = {}
_RULES_LOCK = threading.Lock()  # threads compiling one spec get one MemoryRule


def compile(spec: Spec | str | dict, *, checked: bool = True) -> MemoryRule:
    """Derive, emit and (by default) check the rule of `spec`; cached by the spec's digest.

    Raises `SpecError` for an invalid spec and `DerivationError` when a rule cannot be derived
    or a derived piece fails its check.
    """
    spec = load_spec(spec)
    compiled = compile_ir(spec, checked=checked)
    whole = json.dumps(spec.normalized(), sort_keys=True)
    with _RULES_LOCK:
        wrapped, rule = _RULES.get(whole, (None, None))
        if wrapped is not compiled:  # new, or the compiled rule was redone (now checked)
            rule = MemoryRule(replace(compiled, spec=spec))
            _RULES[whole] = (compiled, rule)
    return rule


__all__ = ["Derivation", "MemoryRule", "compile"]
