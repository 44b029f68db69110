"""help() text from the type stubs.

The .pyi stubs beside each module hold ferry's docstrings (what each argument is, what is
raised); the runtime objects had none (help(TransferEngine.write) printed the comment above
it, help(ferry.Op) the bare pybind11 signatures). ``attach`` copies a stub's docstrings onto
the module's classes, functions, methods and properties, keeping a runtime docstring that is
longer than the stub's. The methods of pybind11 classes take no docstring: theirs are listed
in the class's docstring instead. A missing stub changes nothing.
"""

from __future__ import annotations

import ast
import inspect
import os
import types
from typing import Any, Iterator, List, Optional, Tuple


def _settable(obj: Any, doc: str) -> bool:
    """Gives obj the docstring doc unless its own is longer; False where it takes none."""
    target = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    if not isinstance(target, (types.FunctionType, property, type)):
        return False
    if len(target.__doc__ or "") >= len(doc):
        return True
    try:
        target.__doc__ = doc
    except (AttributeError, TypeError):
        return False
    return True


def _signature(fn: ast.FunctionDef) -> str:
    args = fn.args
    if args.args and args.args[0].arg == "self":  # self has no default: defaults stay
        args = ast.arguments(posonlyargs=args.posonlyargs, args=args.args[1:],
                             vararg=args.vararg, kwonlyargs=args.kwonlyargs,
                             kw_defaults=args.kw_defaults, kwarg=args.kwarg,
                             defaults=args.defaults)
    ret = f" -> {ast.unparse(fn.returns)}" if fn.returns is not None else ""
    return f"{fn.name}({ast.unparse(args)}){ret}"


def _members(node: ast.ClassDef) -> Iterator[Tuple[str, Optional[ast.FunctionDef], str]]:
    """(name, its def or None for an attribute, docstring) of the documented members: methods
    with a docstring, and attributes followed by a string ("name: int" then "\"\"\"...\"\"\"")."""
    body = node.body
    for i, member in enumerate(body):
        if isinstance(member, ast.FunctionDef):
            doc = ast.get_docstring(member)
            if doc:
                yield member.name, member, doc
        elif isinstance(member, ast.AnnAssign) and isinstance(member.target, ast.Name) and \
                i + 1 < len(body) and isinstance(body[i + 1], ast.Expr) and \
                isinstance(body[i + 1].value, ast.Constant) and \
                isinstance(body[i + 1].value.value, str):
            yield member.target.id, None, inspect.cleandoc(body[i + 1].value.value)


def _attach_class(cls: type, node: ast.ClassDef) -> None:
    listed: List[str] = []
    for name, member, doc in _members(node):
        attr = cls.__dict__.get(name)
        if attr is not None and _settable(attr, doc):
            continue
        text = doc.replace("\n", "\n    ")
        listed.append(f"{_signature(member) if member else name}\n    {text}")
    doc: Optional[str] = ast.get_docstring(node) or ""
    if listed:
        doc += "\n\nMembers:\n\n" + "\n\n".join(listed)
    if doc:
        _settable(cls, doc)


def attach(module: Any, stub: str) -> None:
    """Docstrings of the stub file `stub` (beside module's file) onto module's objects."""
    path = os.path.join(os.path.dirname(module.__file__), stub)
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError):
        return
    for node in tree.body:
        if not isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            continue
        obj = module.__dict__.get(node.name)
        if isinstance(node, ast.ClassDef) and isinstance(obj, type):
            _attach_class(obj, node)
        elif isinstance(node, ast.FunctionDef) and obj is not None:
            doc = ast.get_docstring(node)
            if doc:
                _settable(obj, doc)
