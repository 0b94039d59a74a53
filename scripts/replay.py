"""Replay the compiler on every shipped spec and diff what it emits against the golden copies.

    .venv/bin/python scripts/replay.py                 # every spec, every output: diffs, exit 1
    .venv/bin/python scripts/replay.py --update        # rewrite the golden copies
    .venv/bin/python scripts/replay.py specs/deltanet.yaml --outputs torch

A change to a printer, a pass or a component changes some emitted text; the replay shows which
specs' text changed and how, so a refactoring that should change nothing is seen to change
nothing, and one that should is reviewed as the diff of its outputs. Each spec under specs/
(and its examples/ and probes/) is compiled afresh (no emit cache) and gives up to three
outputs, each compared with its copy under tests/golden/:

- `derivation`: the derived update rule as `miras derive` prints it (golden/derivation/);
- `torch`: the emitted torch module, `rule.source` (golden/torch/);
- `triton`: the emitted Triton module where the kernels cover the spec, as `miras kernel`
  prints it (golden/<name>.py.golden, the copies tests/kernels/test_triton.py also reads).

A golden copy that is missing counts as a difference (run --update to write it); so does one
whose spec no longer exists. tests/compiler/test_replay.py runs the replay in the suite.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
SPECS = ("specs/*.yaml", "specs/examples/*.yaml", "specs/probes/*.yaml")


def shipped_specs() -> list[Path]:
    paths = sorted(p for pattern in SPECS for p in ROOT.glob(pattern))
    stems = [p.stem for p in paths]
    twice = sorted({s for s in stems if stems.count(s) > 1})
    if twice:  # the golden copies are named by stem
        raise SystemExit(f"replay: two shipped specs share a file name: {', '.join(twice)}")
    return paths


def _derivation(spec) -> str | None:
    import miras

    return miras.compile(spec).derivation().text + "\n"


def _torch(spec) -> str | None:
    import miras

    return miras.compile(spec).source


def _triton(spec) -> str | None:
    from miras.compiler.pipeline import kernel_source
    from miras.compiler.triton_kernels import unsupported_reason

    return None if unsupported_reason(spec) is not None else kernel_source(spec)


# output name -> (how to emit it from a Spec (None: the output does not apply), the folder of
# its golden copies, their suffix after the spec's file stem)
OUTPUTS: dict[str, tuple[Callable, Path, str]] = {
    "derivation": (_derivation, GOLDEN / "derivation", ".txt.golden"),
    "torch": (_torch, GOLDEN / "torch", ".py.golden"),
    "triton": (_triton, GOLDEN, ".py.golden"),
}


def golden_of(output: str, stem: str) -> Path:
    _, folder, suffix = OUTPUTS[output]
    return folder / f"{stem}{suffix}"


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def replay(paths: list[Path], outputs: list[str], update: bool = False) -> list[str]:
    """Emit `outputs` for each spec at `paths` and compare with (or, `update`, write) the golden
    copies: one unified diff per difference ([] when everything matches)."""
    from miras.spec import load_spec

    diffs = []
    for path in paths:
        spec = load_spec(path)
        for name in outputs:
            text, golden = OUTPUTS[name][0](spec), golden_of(name, path.stem)
            if text is None:
                if golden.exists():
                    diffs.append(f"{_shown(golden)}: {path.stem} no longer emits {name}")
                continue
            if update:
                golden.parent.mkdir(parents=True, exist_ok=True)
                if not golden.exists() or golden.read_text() != text:
                    golden.write_text(text)
                continue
            want = golden.read_text() if golden.exists() else ""
            if text != want:
                where = _shown(golden)
                lines = difflib.unified_diff(
                    want.splitlines(keepends=True),
                    text.splitlines(keepends=True),
                    fromfile=where if golden.exists() else f"{where} (missing)",
                    tofile=f"{_shown(path)} ({name}, emitted now)",
                )
                diffs.append("".join(lines))
    return diffs


def stale(paths: list[Path], outputs: list[str]) -> list[str]:
    """Golden copies of `outputs` whose spec is not among `paths` (a renamed or removed spec)."""
    stems = {p.stem for p in paths}
    found = []
    for name in outputs:
        _, folder, suffix = OUTPUTS[name]
        for golden in sorted(folder.glob(f"*{suffix}")):
            if golden.name[: -len(suffix)] not in stems:
                found.append(f"{_shown(golden)}: no shipped spec named it")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("specs", nargs="*", type=Path, help="spec files (default: every shipped)")
    parser.add_argument("--outputs", nargs="+", choices=list(OUTPUTS), default=list(OUTPUTS))
    parser.add_argument("--update", action="store_true", help="rewrite the golden copies")
    args = parser.parse_args(argv)
    # A fresh emit cache: a cached module would replay the text of an earlier compiler.
    os.environ["MIRAS_CACHE_DIR"] = tempfile.mkdtemp(prefix="miras-replay-")
    paths = [p.resolve() for p in args.specs] if args.specs else shipped_specs()
    for p in paths:
        if not p.exists():
            parser.error(f"spec: no file {p}")
    diffs = replay(paths, args.outputs, update=args.update)
    if not args.specs:
        diffs += stale(paths, args.outputs)
    if args.update:
        print(f"replay: golden copies of {len(paths)} specs written ({', '.join(args.outputs)})")
        return 0
    for d in diffs:
        print(d)
    print(
        f"replay: {len(paths)} specs x {', '.join(args.outputs)}: "
        + (f"{len(diffs)} differences" if diffs else "identical to the golden copies")
    )
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
