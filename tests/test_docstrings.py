"""Every public callable of lsn_ext has a complete Google-style docstring.

The API reference of the docs site renders these docstrings with mkdocstrings-python, so a missing
``Args:`` entry is a parameter the reference does not explain. Ruff's pydocstyle rules (``D``,
convention ``google``, in pyproject.toml) check that docstrings exist and are formatted, but not
that an ``Args:`` section names every parameter, nor that a ``Returns:`` section exists, on
functions that have no ``Args:`` section at all; this test does.

Public means: every callable in ``lsn_ext.__all__`` and in the ``__all__`` of the public
submodules below (those the docs' API reference renders); for a class, the class itself (its
constructor's parameters under ``Args:``, or ``Attributes:`` for dataclasses and named tuples)
and every method, class method, static method, ``__call__`` and property that the class defines
itself (not underscore-prefixed and written in lsn_ext; methods inherited from laplace-torch,
BackPACK, StochMan or torch are documented there). An override without a docstring of a method
that an lsn_ext base class documents (a ``Rule`` subclass's ``input_rule``: pyproject.toml's D102
exemption for ``lsn_ext/rules``) passes: the contract is on the base, and mkdocstrings leaves an
object without a docstring out of the reference (``show_if_no_docstring`` is false).

Checks per callable:

- a docstring exists;
- every parameter (``self``/``cls`` aside) appears under ``Args:``;
- no ``Args:`` entry names a parameter that does not exist;
- a ``Returns:`` (or, for a generator, ``Yields:``) section when the return annotation is not
  ``None``.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FunctionType, ModuleType

import pytest

import lsn_ext

# The documented modules whose ``__all__`` is public API (besides lsn_ext.__all__ itself).
PUBLIC_MODULES = (
    "lsn_ext.data",
    "lsn_ext.distributed",
    "lsn_ext.exact",
    "lsn_ext.rules",
    "lsn_ext.laplace_ext.last_layer",
    "lsn_ext.lsn",
    "lsn_ext.models",
    "lsn_ext.metrics",
    "lsn_ext.vi",
    "lsn_ext.kron",
    "lsn_ext.lowrank",
    "lsn_ext.bridge",
    "lsn_ext.forward",
    "lsn_ext.backpack_ext",
    "lsn_ext.stochman_ext",
    "lsn_ext.laplace_ext",
)

SECTION = re.compile(
    r"^(Args|Arguments|Parameters|Params|Keyword Args|Keyword Arguments|Other Parameters|"
    r"Returns|Return|Yields|Yield|Raises|Raise|Warns|Attributes|Examples?|Notes?|Warnings?|"
    r"See Also|References|Methods|Todo):\s*$"
)
ENTRY = re.compile(r"^(\*{0,2}\w+)\s*(\([^)]*\))?\s*:")
NO_RETURN = (None, "None", inspect.Signature.empty)
GENERATOR_HINTS = ("Iterator", "Generator", "Iterable")


@dataclasses.dataclass(frozen=True)
class Target:
    """One public callable: what to call it in the report and what to inspect."""

    name: str  # module.qualname of the definition
    kind: str  # "function", "method", "staticmethod", "class" or "property"
    obj: object
    owner: type | None = None  # the class that defines a method or property


def sections(doc: str) -> dict[str, list[str]]:
    """The Google-style sections of a docstring: section title -> the entry names under it."""
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    indent: int | None = None
    for line in inspect.cleandoc(doc).splitlines():
        title = SECTION.match(line)
        if title:
            current = found.setdefault(title.group(1), [])
            indent = None
            continue
        if current is None or not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if depth == 0:  # text after a section at the left margin ends it
            current = None
            continue
        if indent is None:
            indent = depth
        if depth == indent:
            entry = ENTRY.match(line.strip())
            current.append(entry.group(1).lstrip("*") if entry else line.strip())
    return found


def defined_here(obj: object) -> bool:
    """Whether ``obj`` is written in lsn_ext (rather than inherited from an upstream library)."""
    return (getattr(obj, "__module__", None) or "").startswith("lsn_ext")


def class_members(cls: type) -> Iterator[Target]:
    """The methods and properties a public class defines itself."""
    for name, attr in vars(cls).items():
        if name.startswith("_") and name != "__call__":
            continue
        qualname = f"{cls.__module__}.{cls.__qualname__}.{name}"
        if isinstance(attr, property):
            if attr.fget is not None and defined_here(attr.fget):
                yield Target(qualname, "property", attr.fget, cls)
            continue
        function = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
        if isinstance(function, FunctionType) and defined_here(function):
            kind = "staticmethod" if isinstance(attr, staticmethod) else "method"
            yield Target(qualname, kind, function, cls)


def public_targets() -> list[Target]:
    """Every public callable, each once, under the module path that defines it."""
    modules: list[ModuleType] = [lsn_ext, *map(importlib.import_module, PUBLIC_MODULES)]
    seen: dict[int, Target] = {}
    for module in modules:
        for name in module.__all__:
            obj = getattr(module, name)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)) or not defined_here(obj):
                continue  # constants, submodules, Literal aliases, upstream re-exports
            if id(obj) in seen:
                continue
            if inspect.isclass(obj):
                seen[id(obj)] = Target(f"{obj.__module__}.{obj.__qualname__}", "class", obj)
                for member in class_members(obj):
                    seen.setdefault(id(member.obj), member)
            else:
                seen[id(obj)] = Target(f"{obj.__module__}.{obj.__qualname__}", "function", obj)
    return sorted(seen.values(), key=lambda target: target.name)


def documented_on_base(owner: type, name: str) -> bool:
    """Whether an lsn_ext base class of ``owner`` gives ``name`` a docstring."""
    for base in owner.__mro__[1:]:
        attr = vars(base).get(name)
        if attr is None or not defined_here(base):
            continue
        function = attr.fget if isinstance(attr, property) else getattr(attr, "__func__", attr)
        if getattr(function, "__doc__", None):
            return True
    return False


def constructor_parameters(cls: type) -> list[str] | None:
    """The parameters of ``cls(...)`` when lsn_ext defines its constructor, else None."""
    init = next((vars(base)["__init__"] for base in cls.__mro__ if "__init__" in vars(base)), None)
    generated = dataclasses.is_dataclass(cls) or hasattr(cls, "_fields")
    if (init is None or not defined_here(init)) and not generated:
        return None
    parameters = inspect.signature(cls).parameters.values()
    return [p.name for p in parameters]


def signature_parameters(target: Target) -> list[str]:
    parameters = list(inspect.signature(target.obj).parameters.values())
    if target.kind == "method":  # self or cls
        parameters = parameters[1:]
    return [p.name for p in parameters]


def problems(target: Target) -> list[str]:
    """What is missing or wrong in the docstring of ``target`` (empty when it is complete)."""
    doc = target.obj.__doc__  # its own: mkdocstrings does not render an inherited docstring
    if not doc or not doc.strip():
        name = target.name.rsplit(".", 1)[-1]
        inherited = target.owner is not None and documented_on_base(target.owner, name)
        return [] if inherited else ["no docstring"]
    if target.kind == "property":
        return []
    found = sections(doc)
    if target.kind == "class":
        parameters = constructor_parameters(target.obj)
        if parameters is None:
            return []
        documented = found.get("Args", []) + found.get("Attributes", [])
        args = found.get("Args", [])
    else:
        parameters = signature_parameters(target)
        documented = args = found.get("Args", []) + found.get("Keyword Args", [])
    issues = [
        f"parameter {name!r} is not under Args:" for name in parameters if name not in documented
    ]
    issues += [
        f"Args: names {name!r}, which is not a parameter" for name in args if name not in parameters
    ]
    if target.kind != "class":
        annotation = inspect.signature(target.obj).return_annotation
        if annotation not in NO_RETURN:
            generator = inspect.isgeneratorfunction(target.obj) or str(annotation).startswith(
                GENERATOR_HINTS
            )
            wanted = (
                ("Yields", "Yield", "Returns", "Return") if generator else ("Returns", "Return")
            )
            if not any(section in found for section in wanted):
                issues.append(f"no {wanted[0]}: section (returns {annotation})")
    return issues


TARGETS = public_targets()


def test_the_walk_finds_the_public_api() -> None:
    """The walk sees the names the issue names, so an empty walk cannot pass silently."""
    names = {target.name for target in TARGETS}
    for name in (
        "lsn_ext.bridge.laplace_bridge",
        "lsn_ext.rules.supported_modules",
        "lsn_ext.rules.losses.Loss.value",
        "lsn_ext.vi.families.StructuredGaussian.log_prob",
        "lsn_ext.vi.posterior.VariationalPosterior.sample",
        "lsn_ext.lsn.fit_lsn",
        "lsn_ext.laplace_ext.predictive.predict",
    ):
        assert name in names
    assert len(TARGETS) > 250


@pytest.mark.parametrize("target", TARGETS, ids=[target.name for target in TARGETS])
def test_docstring_is_complete(target: Target) -> None:
    issues = problems(target)
    assert not issues, f"{target.name}: " + "; ".join(issues)


def test_griffe_parses_every_public_docstring_without_warnings() -> None:
    """The parser behind mkdocstrings-python reads every public docstring without a warning.

    ``mkdocs build --strict`` fails on griffe's warnings (an entry it cannot split into
    ``name: description``, a returned value without a type, an ``Args:`` name that is not a
    parameter), so this is what the API reference needs. Skipped without griffe (the docs
    extra).
    """
    griffe = pytest.importorskip("griffe")
    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logger = logging.getLogger("griffe")
    handler = Collect(logging.WARNING)
    logger.addHandler(handler)
    try:
        root = Path(lsn_ext.__file__).parent.parent
        package = griffe.load("lsn_ext", search_paths=[root], resolve_aliases=False)
        for target in TARGETS:  # a missing docstring is test_docstring_is_complete's failure
            docstring = package[target.name.removeprefix("lsn_ext.")].docstring
            if docstring is not None:
                before = len(warnings)
                docstring.parse("google")
                warnings[before:] = [f"{target.name}: {m}" for m in warnings[before:]]
    finally:
        logger.removeHandler(handler)
    assert not warnings, "\n".join(warnings)


def test_sections_parser() -> None:
    """The parser reads entries with and without types, nested text and varargs."""
    doc = """Summary.

    Args:
        x (Tensor): ``[N, C]`` input,
            continued here: not an entry.
        *args: Extra.
        **kwargs: More.

    Returns:
        Tensor: the output.

    Extra text at the margin.
    """
    assert sections(doc) == {"Args": ["x", "args", "kwargs"], "Returns": ["Tensor"]}


def test_problems_catches_each_gap() -> None:
    """Each check fires on a docstring with exactly that gap."""

    def undocumented(a: int) -> int:
        return a

    def missing_arg(a: int, b: int) -> int:
        """Sum.

        Args:
            a: First.
            c: Not a parameter.

        Returns:
            The sum.
        """
        return a + b

    def missing_returns(a: int) -> int:
        """Identity.

        Args:
            a: The value.
        """
        return a

    def complete(a: int) -> None:
        """Nothing.

        Args:
            a: The value.
        """

    def check(function: Callable[..., object]) -> list[str]:
        return problems(Target(function.__name__, "function", function))

    assert check(undocumented) == ["no docstring"]
    assert check(missing_arg) == [
        "parameter 'b' is not under Args:",
        "Args: names 'c', which is not a parameter",
    ]
    assert check(missing_returns) == ["no Returns: section (returns int)"]
    assert check(complete) == []


def test_an_override_inherits_only_a_documented_contract() -> None:
    """An undocumented override passes where an lsn_ext base documents the method, else not."""

    class Base:
        def rule(self, x: int) -> int:
            """Documented contract.

            Args:
                x: The value.

            Returns:
                The value.
            """
            return x

        def bare(self) -> None:
            pass

    class Child(Base):
        def rule(self, x: int) -> int:
            return x + 1

        def bare(self) -> None:
            pass

    for obj in (Base, Child, Base.rule, Base.bare, Child.rule, Child.bare):
        obj.__module__ = "lsn_ext.example"  # as if written in lsn_ext
    members = {target.name.rsplit(".", 1)[-1]: target for target in class_members(Child)}
    assert problems(members["rule"]) == []
    assert problems(members["bare"]) == ["no docstring"]
