"""`Program`: what `miras.runtime.run` reads of one compiled rule, frozen.

    program = Program.from_ir(compiled, kernels=provider)   # the facade builds it
    o, state = run(program, q, k, v, gates, backend="chunk")
    y = program.read(phi_q_or_q, state)                       # M_W(phi(q)), no update

The compiler produces plain data (`miras.ir.CompiledRule`); the facade (`miras.rule`) joins it
and the runtime by building a Program. The runtime imports neither the facade nor the
compiler: the Triton kernels reach it through `kernels`, a `KernelProvider` the compiler side
supplies, which emits and loads the kernel module only when first asked (docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

import torch

from miras.ir import BiasRule, CompiledRule, Plan
from miras.runtime.core import Runtime, State
from miras.runtime.memory import MemoryModel
from miras.spec import Spec


class KernelProvider(Protocol):
    """The Triton kernels of one compiled rule, as the compiler side supplies them.

    `refusal()`: why the kernels do not cover the rule (None when they do); `gate_plan()`:
    where each gate enters the kernels (`.order`, `.window`, `.step`, `.fixed`); `module()`:
    the emitted module, written and imported on the first call."""

    def refusal(self) -> str | None: ...

    def gate_plan(self): ...

    def module(self) -> ModuleType: ...


@dataclass(frozen=True)
class Program:
    """A compiled rule as the runtime runs it: its spec, plan and derived bias, the pieces
    every backend calls (`runtime`), and the Triton kernels' provider (None: the triton
    backend is refused, naming the reason)."""

    spec: Spec
    plan: Plan
    bias: BiasRule
    runtime: Runtime
    kernels: KernelProvider | None = None

    @classmethod
    def from_ir(
        cls, compiled: CompiledRule[Spec], kernels: KernelProvider | None = None
    ) -> Program:
        """The Program of a compiled rule (its passes run: plan, bias and emitted functions)."""
        module = compiled.functions
        memory = MemoryModel(
            compiled.spec.memory,
            activation=getattr(module, "activation", None),
            activation_grad=getattr(module, "activation_grad", None),
        )
        start_path = compiled.plan.chunk_form.start_path
        runtime = Runtime(compiled.spec, memory, module, start_path, compiled.plan.linear_step)
        return cls(compiled.spec, compiled.plan, compiled.bias, runtime, kernels)

    @property
    def gates(self) -> list[str]:
        """The per-token inputs the rule takes, by name."""
        return list(self.spec.gates())

    @property
    def functions(self) -> ModuleType:
        """The emitted torch module: bias_loss, bias_grad, retention_step, retention_read, ..."""
        return self.runtime.functions

    def default_params(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """Initial values of the learnable component parameters (polynomial coefficients)."""
        initial = self.spec.feature_map.initial_params()
        return {name: value.to(dtype) for name, value in initial.items()}

    def initial_state(self, batch: int, heads: int, d_key: int, d_value: int, dtype=torch.float32):
        """The default initial state for inputs of these sizes (what `initial_state=None`
        uses), on the CPU, in the public form (a tensor for a lone W, else a dict)."""
        d_phi = self.spec.feature_map.output_dim(d_key)
        if self.plan.chunk_form.form == "minimizer":  # zero statistics, or an empty window
            from miras.runtime.exact_minimizer import initial_state

            return initial_state(batch, heads, d_phi, d_value, dtype, "cpu", self.spec.window.c)
        state = self.runtime.initial_state(batch, heads, d_phi, d_value, dtype, "cpu")
        return state["W"] if list(state) == ["W"] else state

    # Reading the memory ---------------------------------------------------------------------
    def feature(
        self, x: torch.Tensor, params: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """phi(x): [..., Dk] -> [..., Dphi] with the rule's feature map; `params` None: the
        default parameters in x's dtype."""
        params = self.default_params(x.dtype) if params is None else params
        return self.runtime.feature(x, params)

    def read(
        self,
        q: torch.Tensor,
        state: torch.Tensor | State,
        params: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """M_W(phi(q)) with no update: q [B, H, T, Dk] heads first, `state` a memory state in
        the public form (a tensor W [B, H, Dv, Dphi] or a dict of [B, H, out, in]) -> [B, H,
        T, Dv]. The weights are read as reads and gradients see them (lq's normalization);
        nothing is cast: q comes in the dtype the caller wants phi in."""
        state = {"W": state} if isinstance(state, torch.Tensor) else state
        rt = self.runtime
        weights = {name: w.unsqueeze(2) for name, w in rt.weights(state).items()}  # [B,H,1,o,i]
        return rt.memory.forward(weights, self.feature(q, params))
