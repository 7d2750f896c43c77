"""The `.pyi` stubs match the built module, and everything is documented."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import orbitkv
import orbitkv._native as native
import orbitkv.errors as errors


def test_stubtest(tmp_path: Path):
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\n")
    env = dict(os.environ, MYPY_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "orbitkv._native", "--mypy-config-file", str(config)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Success" in proc.stdout, proc.stdout


def _public(cls: type) -> list[str]:
    return [n for n in vars(cls) if not n.startswith("_") or n in ("__enter__", "__exit__")]


def test_native_module_is_documented():
    assert native.__doc__
    for name in native.__all__:
        obj = getattr(native, name)
        if inspect.isclass(obj):
            assert obj.__doc__ and obj.__doc__.strip(), name
            members = _public(obj)
            assert members, name
            for member in members:
                doc = getattr(obj, member).__doc__
                assert doc and doc.strip(), f"{name}.{member} has no docstring"


def test_stub_has_docstrings_for_every_public_member():
    import ast

    stub = Path(native.__file__).with_name("_native.pyi")
    tree = ast.parse(stub.read_text())
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and not n.name.startswith("_")]
    assert {c.name for c in classes} == {"MooncakeTransferEngine", "Batch", "Runtime", "RuntimeEvent", "SideChannel", "StagingArena"}
    for cls in classes:
        assert ast.get_docstring(cls), cls.name
        for node in cls.body:
            if isinstance(node, ast.FunctionDef) and node.name != "__new__":
                assert ast.get_docstring(node), f"stub of {cls.name}.{node.name} has no docstring"


def test_package_exports():
    for name in orbitkv.__all__:
        assert hasattr(orbitkv, name), name
    for name in errors.__all__:
        assert getattr(orbitkv, name) is getattr(errors, name)
        assert getattr(errors, name).__doc__, name
    assert orbitkv.__version__ == "0.1.0"
    assert orbitkv.PINNED_MOONCAKE_VERSION == "0.3.13.post1"
    assert (Path(orbitkv.__file__).parent / "py.typed").exists()
