"""The docs' hand-written lists of component kinds, held to the catalogue
(`miras.components.CATALOGUE`) exactly: a kind added, renamed or removed fails here until each
list says so.

- docs/spec.md: each family's table names exactly the family's kinds, and each kind's rows
  exactly its fields;
- docs/kernels.md: each family's row of "What is covered" names every kind once, in the
  covered or the not-covered cell, and the cell agrees with the Triton pass
  (`unsupported_reason`) on a spec of that kind;
- README.md: "What is in the box" names exactly each family's kinds;
- an error shown in the docs that lists the allowed kinds lists them as the spec does.

A kind is a backticked name outside parentheses, before any `;` (what follows a `;` or stands
in parentheses qualifies it).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from miras.compiler.triton_kernels import unsupported_reason
from miras.components import CATALOGUE
from miras.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([*ROOT.glob("docs/*.md"), ROOT / "README.md"])
FAMILIES = sorted(CATALOGUE)
# The label of each family's row in README's and kernels.md's tables.
README_ROWS = {
    "memory": "memories",
    "feature_map": "feature maps",
    "bias": "biases",
    "retention": "retentions",
    "optimizer": "optimizers",
}
KERNEL_ROWS = {family: family.replace("_", " ") for family in CATALOGUE}
# The fields a kind needs set for a spec of it to validate.
REQUIRED = {("feature_map", "custom"): {"formula": "x"}, ("bias", "custom"): {"loss": "e**2/2"}}


def kinds_in(text: str) -> list[str]:
    """The backticked names in `text` outside parentheses and before its first `;`."""
    while True:
        stripped = re.sub(r"\([^()]*\)", "", text)
        if stripped == text:
            break
        text = stripped
    return re.findall(r"`([a-z_0-9]+)`", text.split(";")[0])


def cells(line: str) -> list[str]:
    """The cells of a markdown table row (read for its first cells only: a later one may hold
    a `|`)."""
    return [c.strip() for c in line.strip().strip("|").split("|")]


def row(path: Path, label: str) -> str:
    """What follows the label in the one table row of `path` labelled `label`, up to the
    row's last `|`."""
    prefix = f"| {label} |"
    found = [line for line in path.read_text().splitlines() if line.startswith(prefix)]
    assert len(found) == 1, f"{path.name}: {len(found)} table rows labelled {label!r}"
    return found[0].removeprefix(prefix).strip().removesuffix("|")


def spec_md_table(family: str) -> dict[str, set[str]]:
    """docs/spec.md's table under `## family`: kind -> the fields its rows name, with the
    rows for "every kind" added to each."""
    section = (ROOT / "docs" / "spec.md").read_text().split(f"\n## {family}\n", 1)[1]
    section = section.split("\n## ", 1)[0]
    lines = section.split("\n|", 1)[1].split("\n\n", 1)[0].splitlines()  # the first table
    lines = ["|" + lines[0], *lines[1:]]
    assert cells(lines[0]) == ["kind", "field", "default", "accepts"], lines[0]
    fields: dict[str, set[str]] = {}
    every: set[str] = set()
    current: list[str] = []
    for line in lines[2:]:
        kind_cell, field_cell = cells(line)[:2]
        named = set(re.findall(r"`([a-z_0-9]+)`", field_cell))
        if kind_cell == "every kind":
            every |= named
            continue
        if kind_cell:
            current = re.findall(r"`([a-z_0-9]+)`", kind_cell)
            assert current, f"docs/spec.md, {family}: no kind in {line!r}"
        for kind in current:
            fields.setdefault(kind, set()).update(named)
    return {kind: named | every for kind, named in fields.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_spec_md_tables_name_exactly_each_kind_and_its_fields(family):
    documented = spec_md_table(family)
    kinds = CATALOGUE[family]
    assert sorted(documented) == sorted(kinds), f"docs/spec.md, ## {family}: kinds"
    wrong = {
        kind: sorted(documented[kind] ^ (set(cls.model_fields) - {"kind"}))
        for kind, cls in kinds.items()
        if documented[kind] != set(cls.model_fields) - {"kind"}
    }
    assert not wrong, f"docs/spec.md, ## {family}: fields missing or stale, by kind: {wrong}"


@pytest.mark.parametrize("family", FAMILIES)
def test_readme_names_exactly_each_familys_kinds(family):
    cell = row(ROOT / "README.md", README_ROWS[family])
    assert sorted(kinds_in(cell)) == sorted(CATALOGUE[family]), f"README.md, {family}"


def default_spec(family: str, kind: str):
    return load_spec(
        {"name": f"docs_{kind}", family: {"kind": kind, **REQUIRED.get((family, kind), {})}}
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_kernels_md_covers_each_kind_as_the_triton_pass_does(family):
    covered, refused = map(
        kinds_in, row(ROOT / "docs" / "kernels.md", KERNEL_ROWS[family]).split("|")
    )
    named = covered + refused
    assert sorted(set(named)) == sorted(CATALOGUE[family]), f"docs/kernels.md, {family}"
    # A kind in both cells is covered in some settings only (bregman: not with solver newton).
    wrong = [
        kind
        for kind in named
        if named.count(kind) == 1
        and (unsupported_reason(default_spec(family, kind)) is None) != (kind in covered)
    ]
    assert not wrong, f"docs/kernels.md, {family}: in the wrong cell: {wrong}"


def test_the_docs_errors_list_the_allowed_kinds_as_the_spec_does():
    shown = [
        (path.name, family, listed)
        for path in DOCS
        for family, listed in re.findall(
            r"unknown (\w+) kind '\w+'; allowed kinds: ([\w, ]+?) \(", path.read_text()
        )
    ]
    assert shown, "no error with the allowed kinds in the docs"
    wrong = [s for s in shown if s[2] != ", ".join(CATALOGUE[s[1]])]
    assert not wrong, f"(doc, family, kinds listed): {wrong}"


def test_the_allowed_kinds_are_the_spec_errors_own():
    """The counterpart of the test above: the spec's error lists the kinds that way."""
    with pytest.raises(
        ValueError, match=re.escape(f"allowed kinds: {', '.join(CATALOGUE['bias'])}")
    ):
        load_spec({"name": "bad", "bias": "huberr"})


def test_kinds_in_reads_names_outside_parentheses_and_before_a_semicolon():
    cell = "`gd`, `l2` (`grad_at: state`, `x(y)`), `kl` (`no`); `steps` on gd"
    assert kinds_in(cell) == ["gd", "l2", "kl"]
