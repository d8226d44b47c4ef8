"""The map's rules, checked on every module's imports (the AST, function
bodies included): the product never imports the tooling, no service imports
another, the plumbing imports no service, the memory core never imports grpc
or the protos, and nothing the product imports is a test-only package."""

from __future__ import annotations

import ast
import pathlib
import re
import tomllib
from importlib.metadata import packages_distributions

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SERVICES = ("memory_service", "executor_service", "gateway")
PRODUCT = ("kvpager", "kvpager_kernels", *SERVICES)
TOOLING = "kvpager_tools"
TEST_ONLY = ("pytest", "hypothesis", "grpc_tools", "openai", "playwright")
# The memory service's gRPC layer; everything else in it is the core (pure Python, no grpc).
MEMORY_WIRE = {"memory_service/service.py", "memory_service/servicer.py"}


def modules(package: str):
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("kvpager/v1/"):  # generated stubs
            continue
        yield rel, path


def imports(path: pathlib.Path):
    """(line, top-level package) of every import in the module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module


def top(name: str) -> str:
    return name.split(".")[0]


def violations() -> list[str]:
    bad = []
    for package in PRODUCT:
        for rel, path in modules(package):
            for line, name in imports(path):
                t = top(name)
                where = f"{rel}:{line} imports {name}"
                if t == TOOLING:
                    bad.append(f"{where}: the product never imports the tooling")
                if t in TEST_ONLY:
                    bad.append(f"{where}: a test-only package")
                if package in SERVICES and t in SERVICES and t != package:
                    bad.append(f"{where}: a service never imports another service's package")
                if package in ("kvpager", "kvpager_kernels") and t in SERVICES:
                    bad.append(f"{where}: the plumbing and the kernels import no service")
                if package == "memory_service" and rel not in MEMORY_WIRE and (
                        t == "grpc" or t.startswith("grpc_") or name.startswith("kvpager.v1")):
                    bad.append(f"{where}: the memory core imports neither grpc nor the protos")
    return bad


def test_import_rules_hold():
    assert violations() == []


def test_the_check_sees_a_violation(tmp_path, monkeypatch):
    """The rules bite: a core module importing grpc is reported with its line."""
    fake = tmp_path / "memory_service"
    fake.mkdir()
    (fake / "planner.py").write_text("import os\n\ndef f():\n    import grpc\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    monkeypatch.setattr(__import__(__name__), "PRODUCT", ("memory_service",))
    assert violations() == ["memory_service/planner.py:4 imports grpc: the memory core imports neither grpc nor "
                            "the protos"]


@pytest.mark.parametrize("package", PRODUCT)
def test_product_modules_are_small(package):
    """No product module over ~400 lines unless its docstring says it is one concept."""
    for rel, path in modules(package):
        text = path.read_text()
        lines = text.count("\n")
        if lines > 420:
            doc = ast.get_docstring(ast.parse(text)) or ""
            assert "one concept" in doc.lower(), f"{rel}: {lines} lines and no 'one concept' in its docstring"


def test_the_packaged_top_levels_are_the_map():
    """What pyproject ships is exactly the product and the tooling."""
    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert sorted(p.rstrip("*") for p in found["include"]) == sorted((*PRODUCT, TOOLING))


def test_no_top_level_package_of_ours_is_another_distributions_import_name():
    """Our top-level packages sit in site-packages beside everything else a
    user installs: a name another installed distribution provides would
    shadow it, or be overwritten by it. ``kernels`` did: transformers 5.25
    depends on Hugging Face's ``kernels`` and imports it by that name."""
    owners = packages_distributions()
    clashes = {name: sorted(set(owners.get(name, ())) - {"kvpager"}) for name in (*PRODUCT, TOOLING)}
    assert {name: d for name, d in clashes.items() if d} == {}
    # the check reads real metadata: transformers' own top level is known to it
    assert "transformers" in owners.get("transformers", ())


def test_the_image_copies_every_packaged_top_level():
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\w+) \./\1$", dockerfile, flags=re.M))
    assert copied == {*PRODUCT, TOOLING}
