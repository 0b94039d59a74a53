"""Emission: printed torch functions assembled into a module, written to a cache, imported.

The module text is built only from `TorchPrinter` output over whitelisted sympy expressions,
so what is imported is exactly what `miras derive --code` shows.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import sympy as sp

from miras.derive.printer import torch_code
from miras.derive.symbols import soft_threshold


def function_source(
    name: str,
    args: list[str],
    result: sp.Expr,
    *,
    prelude: list[tuple[str, str]] = (),
    doc: str = "",
) -> str:
    """`def name(args): ...` returning `result`, with common subexpressions hoisted.

    `prelude`: (variable, torch source) lines placed first, e.g. ("e", "y - v").
    """
    # The printer writes soft_threshold(z, t) as sign(z) * clamp(|z| - t, 0): z twice. Offered
    # to cse beside the result, a compound z is hoisted into a variable, computed once.
    shared = [a.args[0] for a in result.atoms(soft_threshold) if not a.args[0].is_Atom]
    replacements, (reduced, *_) = sp.cse([result, *shared], symbols=sp.numbered_symbols("t"))
    lines = [f"def {name}({', '.join(args)}):"]
    if doc:
        lines.append(f'    """{doc}"""')
    lines += [f"    {var} = {src}" for var, src in prelude]
    lines += [f"    {sym} = {torch_code(expr)}" for sym, expr in replacements]
    lines.append(f"    return {torch_code(reduced)}")
    return "\n".join(lines) + "\n"


def module_source(header: str, functions: list[str]) -> str:
    """A module: a comment header, `import torch`, then the functions."""
    comment = "\n".join(f"# {line}" if line else "#" for line in header.splitlines())
    return comment + "\n\nimport torch\n\n\n" + "\n\n".join(functions)


def cache_dir() -> Path:
    """Where emitted sources live: $MIRAS_CACHE_DIR, else ~/.cache/miras."""
    root = os.environ.get("MIRAS_CACHE_DIR") or Path.home() / ".cache" / "miras"
    return Path(root)


def load_module(source: str, kind: str = "torch") -> ModuleType:
    """Write `source` under the cache (named by its content hash) and import it."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    name = f"miras_emitted_{kind}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    path = cache_dir() / kind / f"{digest}.py"
    if not path.exists() or path.read_text() != source:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(source)
        tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module
