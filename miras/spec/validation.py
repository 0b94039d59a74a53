"""One validation layer for what users write: specs, studies and task options.

    data = read_mapping(source, "spec", SpecError, fields)   # a path or YAML text -> a dict
    problems = translate(error, Spec)                       # pydantic's errors -> Problems
    name: Slug                                               # letters, digits, '-' and '_'

The same mistake reads the same wherever it is made: an unknown field names the allowed ones
and a near miss, a wrong literal names the allowed values, a YAML syntax error names the line
and column, a key written twice names both lines. Only the safe YAML loader is used: nothing in
a file is turned into a Python object other than plain data.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import AfterValidator, BaseModel, ValidationError

from miras.errors import Problem, did_you_mean

SOURCE_DICT = "<dict>"
SOURCE_TEXT = "<yaml text>"

MakeError = Callable[[str, list[Problem]], Exception]  # (source, problems) -> SpecError, ...

# A spec or study is a few dozen nodes (the largest shipped one, 160). These bound the work of
# reading one: nodes with every alias expanded, and nesting depth of collections.
MAX_YAML_NODES = 10_000
MAX_YAML_DEPTH = 50


# ---------------------------------------------------------------------------------------------
# Names


def check_slug(name: str) -> str:
    """A name used in file and run names: letters, digits, '-' and '_'."""
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise ValueError(f"expected a slug of letters, digits, '-' and '_', got {name!r}")
    return name


Slug = Annotated[str, AfterValidator(check_slug)]


# ---------------------------------------------------------------------------------------------
# YAML


def looks_like_path(text: str) -> bool:
    """A str is a path when it ends in .yaml/.yml or names an existing file, and YAML text when
    it holds a newline or ':'; anything else is reported as a missing file."""
    if "\n" in text or not text.strip():
        return False
    if text.endswith((".yaml", ".yml")):
        return True
    try:
        if Path(text).is_file():
            return True
    except OSError:  # e.g. a name too long for the file system: not a path
        return False
    return ":" not in text


def read_mapping(
    source: str | Path, what: str, error: MakeError, fields: Any
) -> tuple[dict[str, Any], str]:
    """(the top-level mapping, the source's name) of a YAML file path or YAML text. `what`
    names the document ('spec'), `fields` its allowed top-level fields (for the message when
    the top level is not a mapping). Raises `error(source, problems)`."""
    if isinstance(source, Path) or looks_like_path(source):
        name = str(source)
        try:
            text = Path(source).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise error(name, [Problem("", "no such file")]) from None
        except (OSError, UnicodeDecodeError) as err:
            raise error(name, [Problem("", f"cannot read the file: {err}")]) from None
    else:
        name, text = SOURCE_TEXT, source
    return parse_mapping(text, name, what, error, fields), name


def parse_mapping(
    text: str, source: str, what: str, error: MakeError, fields: Any
) -> dict[str, Any]:
    """YAML text -> its top-level mapping; a syntax error, an empty document, a key written
    twice or a top level that is not a mapping raises `error(source, problems)`."""
    # The safe loader (no tags that build Python objects), in its two steps: compose the node
    # graph, check its size, and only then construct plain data from it.
    loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()
        problem = yaml_size_problem(node)
        if problem is not None:
            raise error(source, [problem])
        duplicates = duplicate_keys(node)
        if duplicates:
            raise error(source, duplicates)
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as err:
        raise error(source, [yaml_syntax_problem(err)]) from None
    except _TooDeep:
        message = f"the YAML nests collections too deeply; at most {MAX_YAML_DEPTH} levels"
        raise error(source, [Problem("", message)]) from None
    finally:
        loader.dispose()
    listed = ", ".join(fields)
    if data is None:
        message = f"the {what} is empty; expected a mapping of fields ({listed})"
        raise error(source, [Problem("", message)])
    if not isinstance(data, dict):
        message = f"the top level must be a mapping of fields ({listed}), got {type(data).__name__}"
        raise error(source, [Problem("", message)])
    return data


def yaml_syntax_problem(err: yaml.YAMLError) -> Problem:
    """A YAML syntax error as one problem naming the line and column."""
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    what = getattr(err, "problem", None) or str(err).splitlines()[0]
    return Problem("", f"invalid YAML{where}: {what}")


def yaml_size_problem(node: yaml.Node | None) -> Problem | None:
    """A problem when the document, with every alias expanded, has more than MAX_YAML_NODES
    nodes; else None. An alias (`*a`) is a second edge to
    one composed node, so nine lines of `a2: &a2 [*a1, *a1, ...]` stand for 10**9 nodes: the
    expanded size is counted on the node graph, each node once (memoized by id), so the count
    itself never expands an alias."""
    sizes: dict[int, int] = {}

    def size(n: yaml.Node) -> int:  # recursion depth: at most MAX_YAML_DEPTH (composed so)
        if id(n) in sizes:
            return sizes[id(n)]
        sizes[id(n)] = 1  # a node that contains itself (`&a [*a]`) counts once
        total = 1
        if isinstance(n, yaml.SequenceNode):
            total += sum(size(item) for item in n.value)
        elif isinstance(n, yaml.MappingNode):
            total += sum(size(k) + size(v) for k, v in n.value)
        sizes[id(n)] = total = min(total, MAX_YAML_NODES + 1)  # saturate: no huge integers
        return total

    if node is None:
        return None
    total = size(node)
    if total > MAX_YAML_NODES:
        # Name the first top-level field that is too large on its own, if one is.
        entries = node.value if isinstance(node, yaml.MappingNode) else []
        large = [k.value for k, v in entries if sizes[id(v)] > MAX_YAML_NODES]
        return Problem(
            str(large[0]) if large else "",
            f"the YAML has more than {MAX_YAML_NODES} nodes once its aliases (*name) are "
            f"expanded; at most {MAX_YAML_NODES} (an alias of an anchor that holds aliases "
            "multiplies the size: write the values out, or use fewer nested aliases)",
        )
    return None


class _TooDeep(Exception):
    pass


class _BoundedLoader(yaml.SafeLoader):
    """The safe loader, refusing collections nested deeper than MAX_YAML_DEPTH while it
    composes (PyYAML composes recursively: 3000 levels ended in a RecursionError)."""

    _depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise _TooDeep
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def duplicate_keys(node: yaml.Node | None, prefix: str = "") -> list[Problem]:
    """safe_load keeps the last of two equal keys silently; a file that says `bias` twice is a
    mistake worth naming. Walks the composed node graph (nothing is constructed), each node
    once: a node reached again through an alias has been checked (and named) already."""
    problems: list[Problem] = []
    seen: set[int] = set()

    def walk(node: yaml.Node | None, prefix: str) -> None:
        if node is None or id(node) in seen:
            return
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, f"{prefix}[{i}].")
            return
        if not isinstance(node, yaml.MappingNode):
            return
        first_line: dict[str, int] = {}
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else "?"
            line = key.start_mark.line + 1
            if name in first_line:
                where = f"first at line {first_line[name]}, again at line {line}"
                path = (prefix + name).replace(".[", "[")
                problems.append(Problem(path, f"the key appears twice ({where})"))
            first_line.setdefault(name, line)
            walk(value, f"{prefix}{name}.")

    walk(node, prefix)
    return problems


# ---------------------------------------------------------------------------------------------
# pydantic errors -> Problems


class CarriesProblems(ValueError):
    """Raised inside a validator to hand several finished Problems through pydantic (e.g. a
    spec's compatibility rules): `translate` reports them as they are."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("; ".join(str(p) for p in problems))


# (the model that owns the field, its path so far, the field name) -> more words for the
# message of an unknown field ('; grad_at is a field of l2 retention only').
UnknownHint = Callable[[type[BaseModel] | None, list[Any], str], str]
# (the model whose own validator failed, the message) -> the field to point at, or ''.
ModelErrorField = Callable[[type[BaseModel], str], str]


def translate(
    error: ValidationError,
    root: type[BaseModel],
    *,
    noun: str = "field",
    unknown_hint: UnknownHint | None = None,
    model_error_field: ModelErrorField | None = None,
) -> list[Problem]:
    """Every error of `error` (raised validating `root`) as a Problem: the dotted path of the
    bad field (list items as [i], a discriminated union's tag left out: 'bias.p', not
    'bias.lp.p') and what is wrong, with the allowed values where there is a list of them.
    `noun` names what the fields are to the user ('field', 'option')."""
    problems: list[Problem] = []
    for item in error.errors(include_url=False):
        raised = (item.get("ctx") or {}).get("error")
        if isinstance(raised, CarriesProblems):
            problems.extend(raised.problems)
        else:
            problems.append(_problem(item, root, noun, unknown_hint or _no_hint, model_error_field))
    return problems


def _no_hint(owner: Any, path: list[Any], name: str) -> str:
    return ""


def render_path(parts: list[Any]) -> str:
    """['spec', 'bias', 'choices', 1, 'kind'] -> 'spec.bias.choices[1].kind'."""
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text


def _problem(
    item: Mapping[str, Any],
    root: type[BaseModel],
    noun: str,
    unknown_hint: UnknownHint,
    model_error_field: ModelErrorField | None,
) -> Problem:
    parts, owner, annotation = _walk(root, tuple(item["loc"]))
    path = render_path(parts)
    error_type, value = item["type"], item.get("input")
    name = str(parts[-1]) if parts else ""

    if error_type in ("union_tag_invalid", "union_tag_not_found"):
        tag_field, tags = _tags(annotation)
        tag = item["ctx"].get("tag") if error_type == "union_tag_invalid" else None
        got = f"unknown {name} {tag_field} {tag!r}" if tag is not None else f"missing {tag_field!r}"
        hint = did_you_mean(tag, tags) if tag is not None else ""
        return Problem(
            f"{path}.{tag_field}", f"{got}; allowed {tag_field}s: {', '.join(tags)}{hint}"
        )
    if error_type == "extra_forbidden":
        allowed = list(owner.model_fields) if owner is not None else []
        message = f"unknown {noun} {name!r}; allowed {noun}s: {', '.join(allowed)}"
        return Problem(
            path, message + did_you_mean(name, allowed) + unknown_hint(owner, parts, name)
        )
    if error_type == "missing":
        return Problem(path, f"missing required {noun} {name!r}")
    if error_type == "literal_error":
        allowed = literals(annotation)
        hint = did_you_mean(value, allowed) if isinstance(value, str) else ""
        shown = ", ".join(str(a) for a in allowed) or item["ctx"].get("expected", "")
        return Problem(path, f"expected one of {shown}, got {value!r}{hint}")
    raised = (item.get("ctx") or {}).get("error")
    if error_type in ("value_error", "assertion_error"):
        message = str(raised) if raised is not None else _plain(item["msg"])
        if model_error_field is not None and _is_model(annotation):
            field = model_error_field(annotation, message)
            path = render_path([*parts, field]) if field else path
    elif error_type in _BOUNDS:
        op, key = _BOUNDS[error_type]
        bound = item["ctx"][key]
        bound = int(bound) if isinstance(bound, float) and bound.is_integer() else bound
        message = f"expected {_noun_of(annotation)} {op} {bound}, got {value!r}"
    else:
        message = f"expected {_TYPES.get(error_type, _plain(item['msg']))}, got {value!r}"
    return Problem(path, message + float_text_hint(value))


_TYPES = {
    "string_type": "text",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "list_type": "a list",
    "tuple_type": "a list",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
}


_BOUNDS = {
    "greater_than": (">", "gt"),
    "greater_than_equal": (">=", "ge"),
    "less_than": ("<", "lt"),
    "less_than_equal": ("<=", "le"),
}


def _noun_of(annotation: Any) -> str:
    kinds = set(_unwrap(annotation)) - {type(None)}
    return "an integer" if kinds == {int} else "a number" if kinds <= {int, float} else "a value"


def _plain(msg: str) -> str:
    """pydantic's 'Input should be a valid list' -> 'a valid list'."""
    return msg.removeprefix("Input should be ").removeprefix("Value error, ").rstrip(".")


def float_text_hint(value: Any) -> str:
    """YAML 1.1 floats need a dot and a signed exponent: 1e-3 and 1.0e3 are read as text."""
    if not isinstance(value, str) or not any(ch.isdigit() for ch in value):
        return ""  # 'inf', 'nan': YAML has its own spelling (.inf), not worth a hint
    try:
        float(value)
    except ValueError:
        return ""
    return f"; YAML reads {value} as text: give it a dot and a signed exponent (write 1.0e-3, not 1e-3)"


# ---------------------------------------------------------------------------------------------
# Following a pydantic location through the model's annotations


def _walk(root: type[BaseModel], loc: tuple[Any, ...]) -> tuple[list[Any], Any, Any]:
    """(the user's path, the model owning the last field, the last part's annotation).

    pydantic's location holds what the user wrote (field names, list indices, dict keys) and
    also a discriminated union's tag and wrapper names ('function-after[...]'): both are left
    out of the path."""
    parts: list[Any] = []
    owner: Any = root
    annotation: Any = root
    for part in loc:
        if isinstance(part, str) and part.startswith(("function-", "nullable", "lax-", "json-")):
            continue
        members = _tagged_members(annotation)
        if isinstance(part, str) and part in members:
            annotation = members[part]
            continue
        model = _model_of(annotation)
        parts.append(part)
        if model is not None and isinstance(part, str):
            owner = model
            field = model.model_fields.get(part)
            annotation = _field_annotation(field) if field is not None else None
        else:
            annotation = _item_type(annotation, part)
    return parts, owner, annotation


def _field_annotation(field: Any) -> Any:
    # pydantic moves a union's `Field(discriminator=...)` out of the annotation into the
    # FieldInfo; put it back so the walk can recognise the tag in a location.
    if isinstance(field.discriminator, str):
        return Annotated[field.annotation, field]
    return field.annotation


def _unwrap(annotation: Any) -> list[Any]:
    """The types an annotation may hold: Annotated, Optional and unions opened up."""
    found, pending = [], [annotation]
    while pending:
        a = pending.pop(0)
        origin = get_origin(a)
        if origin is Annotated:
            pending.append(get_args(a)[0])
        elif origin in (Union, UnionType):
            pending.extend(get_args(a))
        else:
            found.append(a)
    return found


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _model_of(annotation: Any) -> type[BaseModel] | None:
    models = [a for a in _unwrap(annotation) if _is_model(a)]
    return models[0] if len(models) == 1 else None


def _discriminator(annotation: Any) -> str | None:
    pending = [annotation]
    while pending:
        a = pending.pop(0)
        if get_origin(a) is Annotated:
            for meta in get_args(a)[1:]:
                if isinstance(getattr(meta, "discriminator", None), str):
                    return meta.discriminator
            pending.append(get_args(a)[0])
    return None


def _tagged_members(annotation: Any) -> dict[str, type[BaseModel]]:
    """{tag: model} of a discriminated union, {} for anything else."""
    tag_field = _discriminator(annotation)
    if tag_field is None:
        return {}
    members = {}
    for model in _unwrap(annotation):
        if _is_model(model) and tag_field in model.model_fields:
            for tag in literals(model.model_fields[tag_field].annotation):
                members[str(tag)] = model
    return members


def _tags(annotation: Any) -> tuple[str, list[str]]:
    return _discriminator(annotation) or "kind", list(_tagged_members(annotation))


def _item_type(annotation: Any, part: Any) -> Any:
    """The annotation of one item of a list, tuple or dict annotation."""
    for a in _unwrap(annotation):
        args = get_args(a)
        origin = get_origin(a)
        if origin in (list, set, frozenset) and args:
            return args[0]
        if origin is tuple and args:
            return args[0]  # tuple[X, ...]: options of one type
        if origin is dict and len(args) == 2:
            return args[1]
    return None


def literals(annotation: Any) -> list[Any]:
    """The Literal values an annotation accepts (also inside Optional, Annotated, unions)."""
    found: list[Any] = []
    pending = [annotation]
    while pending:
        a = pending.pop(0)
        if get_origin(a) is Literal:
            found.extend(get_args(a))
        else:
            pending.extend(get_args(a))
    return found
