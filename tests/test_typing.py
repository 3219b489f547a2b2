"""The compiled core's stub (``_core_c.pyi``) against the twins, so it cannot drift.

The stub must name what the pure twin exports, with the same signatures written the
same way (parameter names, kinds, defaults and annotations, and return annotations),
and what the compiled twin exports where it is built (names, parameter names, kinds
and defaults: Cython keeps no annotations). The programs under tests/typing/ are
checked by mypy with the project's strict configuration (``mypy``, which lists them
in its files), and the stub against the compiled module by
``python -m mypy.stubtest joblock._core_c --ignore-disjoint-bases --allowlist
tests/typing/stubtest_allowlist.txt``; neither needs a Redis server.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import joblock
from joblock import _core_py

STUB = Path(joblock.__file__).parent / "_core_c.pyi"

# What the pure twin has under another name, or has and the compiled one has not.
PURE_CLASSES = {"Lease": "Lease", "Reader": "PyReader"}
PURE_ONLY = {
    "PyReader",
    "LeaseOwner",
    "LeaseWatch",
    "Sure",
}  # its own RESP parser; the Protocols of a lease's owner and watch; RedlockLease's base
# Members every class has, that the stub need not restate.
IMPLIED = {"__repr__", "__new__", "__init_subclass__", "__subclasshook__", "__class_getitem__"}


@dataclass(frozen=True)
class Param:
    name: str
    kind: str
    default: str | None
    annotation: str | None


@dataclass(frozen=True)
class Sig:
    params: tuple[Param, ...]
    returns: str | None


def norm(source: str | None) -> str | None:
    """An annotation as ast.unparse writes it, however the source spaced it."""
    return None if source is None else ast.unparse(ast.parse(source, mode="eval"))


def stub_sig(fn: ast.FunctionDef) -> Sig:
    a = fn.args
    params: list[Param] = []
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        kind = "POSITIONAL_ONLY" if i < len(a.posonlyargs) else "POSITIONAL_OR_KEYWORD"
        params.append(Param(arg.arg, kind, _literal(default), _ann(arg)))
    if a.vararg is not None:
        params.append(Param(a.vararg.arg, "VAR_POSITIONAL", None, _ann(a.vararg)))
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        params.append(Param(arg.arg, "KEYWORD_ONLY", _literal(default), _ann(arg)))
    if a.kwarg is not None:
        params.append(Param(a.kwarg.arg, "VAR_KEYWORD", None, _ann(a.kwarg)))
    return Sig(tuple(params), None if fn.returns is None else ast.unparse(fn.returns))


def _ann(arg: ast.arg) -> str | None:
    return None if arg.annotation is None else ast.unparse(arg.annotation)


def _literal(node: ast.expr | None) -> str | None:
    return None if node is None else repr(ast.literal_eval(node))


def runtime_sig(fn: Any, annotated: bool) -> Sig:
    sig = inspect.signature(fn)
    params = tuple(
        Param(
            p.name,
            p.kind.name,
            None if p.default is inspect.Parameter.empty else repr(p.default),
            norm(p.annotation) if annotated and p.annotation is not inspect.Parameter.empty else None,
        )
        for p in sig.parameters.values()
    )
    returns = norm(sig.return_annotation) if annotated else None
    return Sig(params, returns)


def unannotated(sig: Sig) -> Sig:
    return Sig(tuple(Param(p.name, p.kind, p.default, None) for p in sig.params), None)


@dataclass
class StubClass:
    methods: dict[str, ast.FunctionDef]
    properties: dict[str, str | None]  # name: return annotation
    attributes: dict[str, str]  # name: annotation


@dataclass
class Stub:
    functions: dict[str, ast.FunctionDef]
    classes: dict[str, StubClass]
    constants: dict[str, str]
    reexports: set[str]

    @property
    def names(self) -> set[str]:
        return {*self.functions, *self.classes, *self.constants, *self.reexports}


def read_stub() -> Stub:
    stub = Stub({}, {}, {}, set())
    for node in ast.parse(STUB.read_text()).body:
        if isinstance(node, ast.FunctionDef):
            stub.functions[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            stub.constants[node.target.id] = ast.unparse(node.annotation)
        elif isinstance(node, ast.ImportFrom):
            # `import X as X` re-exports X; a plain import is for the stub's own use.
            stub.reexports |= {alias.name for alias in node.names if alias.asname == alias.name}
        elif isinstance(node, ast.ClassDef):
            cls = StubClass({}, {}, {})
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    decorators = {ast.unparse(d) for d in item.decorator_list}
                    if "property" in decorators:
                        cls.properties[item.name] = (
                            None if item.returns is None else ast.unparse(item.returns)
                        )
                    else:
                        cls.methods[item.name] = item
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    cls.attributes[item.target.id] = ast.unparse(item.annotation)
            stub.classes[node.name] = cls
        elif not isinstance(node, ast.Import | ast.Expr):
            raise AssertionError(f"the stub has a statement this test does not read: {ast.unparse(node)}")
    return stub


def exported(module: ModuleType) -> set[str]:
    """A core's public names: its own functions and classes, constants, re-exported errors."""
    names = set()
    for name, value in vars(module).items():
        if name.startswith("_") or isinstance(value, ModuleType) or name == "annotations":
            continue
        owner = getattr(value, "__module__", None)
        if isinstance(value, int) or owner in (module.__name__, "joblock.errors") or name == "Reader":
            names.add(name)
    return names


def class_members(cls: type) -> dict[str, Any]:
    """The methods and properties a class defines or inherits from the core's own bases
    (the pure Lease's ``Sure``), private (``_x``) ones left out."""
    defined: dict[str, Any] = {}
    for klass in reversed(cls.__mro__[:-1]):  # object's are no member of the class
        defined.update(vars(klass))
    return {
        name: value
        for name, value in defined.items()
        if (not name.startswith("_") or (name.startswith("__") and name.endswith("__")))
        and name not in IMPLIED
        # A Cython property is a getset descriptor.
        and (inspect.isroutine(value) or isinstance(value, property) or inspect.isgetsetdescriptor(value))
        and not name.startswith(("__reduce", "__setstate"))  # Cython's pickling hooks
    }


STUB_API = read_stub()


def test_the_stub_names_what_the_pure_twin_exports() -> None:
    assert STUB_API.names == (exported(_core_py) - PURE_ONLY)


@pytest.mark.parametrize("name", sorted(STUB_API.functions))
def test_stub_functions_have_the_pure_twins_signatures(name: str) -> None:
    assert stub_sig(STUB_API.functions[name]) == runtime_sig(getattr(_core_py, name), annotated=True)


@pytest.mark.parametrize("name", sorted(STUB_API.constants))
def test_stub_constants_have_the_pure_twins_types(name: str) -> None:
    assert STUB_API.constants[name] == type(getattr(_core_py, name)).__name__


@pytest.mark.parametrize("name", sorted(STUB_API.classes))
def test_stub_classes_have_the_pure_twins_members(name: str) -> None:
    stub = STUB_API.classes[name]
    cls = getattr(_core_py, PURE_CLASSES[name])
    members = class_members(cls)
    assert {*stub.methods, *stub.properties} == set(members)
    for method, node in stub.methods.items():
        assert stub_sig(node) == runtime_sig(members[method], annotated=True), method
    for prop, returns in stub.properties.items():
        assert returns == norm(members[prop].fget.__annotations__.get("return")), prop
    declared = {k: norm(v) for k, v in getattr(cls, "__annotations__", {}).items()}
    assert stub.attributes == declared


def test_the_stub_describes_the_pure_twins_lease_class() -> None:
    # Type checkers see the pure twin's Lease (joblock.Lease); the compiled Lease is
    # the one the stub describes. Both must be one API.
    assert set(PURE_CLASSES) == set(STUB_API.classes)
    assert PURE_CLASSES["Lease"] == joblock.Lease.__name__


def built_compiled_twin() -> ModuleType | None:
    """The compiled twin where it is built, even with JOBLOCK_NO_EXTENSIONS set."""
    if importlib.util.find_spec("joblock._core_c") is None:
        return None
    return importlib.import_module("joblock._core_c")


def test_the_stub_matches_the_compiled_twin_where_it_is_built() -> None:
    compiled = built_compiled_twin()
    if compiled is None:  # PyPy, or no compiler: only the pure twin exists
        return
    assert STUB_API.names == exported(compiled)
    for name, node in STUB_API.functions.items():
        assert unannotated(stub_sig(node)) == runtime_sig(getattr(compiled, name), annotated=False), name
    for name, cls in STUB_API.classes.items():
        members = {*cls.methods, *cls.properties}
        runtime = getattr(compiled, name)
        # A cdef class may inherit object's __init__ where the pure class writes one.
        assert set(class_members(runtime)) <= members, name
        assert all(hasattr(runtime, member) for member in members), name
