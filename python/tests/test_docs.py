"""The docstrings live beside the code: in the .py files, and in the pybind11 bindings for the
extension's classes. help() on every public name of ferry, ferry.kv and ferry.moe, and on every
public method and property of their classes, shows text of its own (the docstrings were once
copied in at import time from .pyi stubs, and a name the copier missed had none). The
extension's type stub (_ferry.pyi) names what the extension has, no more and no less."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re

import pytest

import ferry
from conftest import torch_or_skip

# pybind11's first line of a function's docstring: its signature, "name(args) -> type".
_SIGNATURE = re.compile(r"^\w+\(.*\)( -> .+)?$")


def _own_doc(obj) -> str:
    """obj's docstring without pybind11's signature line: empty for a pybind11 function or
    method bound without a docstring."""
    doc = inspect.getdoc(obj) or ""
    lines = doc.splitlines()
    if lines and _SIGNATURE.match(lines[0]):
        lines = lines[1:]
    return "\n".join(lines).strip()


def _undocumented(module_name):
    mod = importlib.import_module(module_name)
    missing = []
    for name in mod.__all__:
        obj = getattr(mod, name)
        if isinstance(obj, str):  # __version__
            continue
        if not _own_doc(obj):
            missing.append(name)
        if not isinstance(obj, type) or issubclass(obj, BaseException):
            continue
        for attr, value in vars(obj).items():
            if attr.startswith("_"):
                continue
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if not callable(value) and not isinstance(value, property) and \
                    not hasattr(value, "__get__"):
                continue  # a plain class attribute (a dataclass field's default)
            if not _own_doc(value):
                missing.append(f"{name}.{attr}")
    return missing


def test_every_public_name_of_ferry_has_a_docstring():
    assert _undocumented("ferry") == []


def test_every_public_name_of_ferry_kv_has_a_docstring():
    assert _undocumented("ferry.kv") == []


def test_every_public_name_of_ferry_moe_has_a_docstring():
    torch_or_skip()
    assert _undocumented("ferry.moe") == []


def test_help_shows_the_docs_of_native_classes():
    """help(ferry.Region) printed bare pybind11 signatures before the stubs' docstrings were
    copied in; the bindings carry them now."""
    import ferry.kv as fkv

    assert "deregisters" in inspect.getdoc(ferry.Region)
    assert "ProtocolError" in _own_doc(ferry.RemoteRegion.from_bytes)
    assert "TimeoutError" in _own_doc(ferry.Op.wait)
    assert "placement" in inspect.getdoc(fkv.KvLayout)
    assert "token" in _own_doc(fkv.KvLayout.token_bytes)
    assert "recv" in inspect.getdoc(fkv.KvEvent)
    assert "FNV-1a" in _own_doc(fkv.transfer_key)
    assert "CUDA devices visible" in _own_doc(ferry.gpu_device_count)


def _stub_names(tree: ast.Module) -> set:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _stub_members(node: ast.ClassDef) -> set:
    names = set()
    for m in node.body:
        if isinstance(m, ast.FunctionDef) and (not m.name.startswith("_") or
                                               m.name in ("__init__", "__enter__", "__exit__")):
            names.add(m.name)
        elif isinstance(m, ast.AnnAssign) and isinstance(m.target, ast.Name):
            names.add(m.target.id)
    return names


def test_the_extension_stub_names_what_the_extension_has():
    """_ferry.pyi lacked transfer_key, pull_params and the log calls the extension has."""
    ext = ferry._ferry
    path = os.path.join(os.path.dirname(ext.__file__), "_ferry.pyi")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    public = {n for n in vars(ext) if not n.startswith("_")}
    assert _stub_names(tree) == public
    for node in tree.body:
        if not isinstance(node, ast.ClassDef) or issubclass(getattr(ext, node.name),
                                                            BaseException):
            continue
        cls = getattr(ext, node.name)
        members = {n for n in vars(cls) if not n.startswith("_") or
                   n in ("__enter__", "__exit__")}
        if node.name in ("Engine", "MoeAllToAll", "KvLayout", "KvConnector", "HandshakeServer"):
            members.add("__init__")  # made by a call; the others say where they come from
        assert _stub_members(node) == members, node.name


@pytest.mark.parametrize("stub", ["__init__.pyi", "kv.pyi", "moe.pyi", "_docs.py"])
def test_no_pure_python_stubs(stub):
    """The docstrings of the pure-Python modules are in the modules: no stub beside them to
    drift from the code."""
    assert not os.path.exists(os.path.join(os.path.dirname(ferry.__file__), stub))
