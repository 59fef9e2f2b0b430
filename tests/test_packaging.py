"""The wheel ships the device sources and the console script.

The device code lives in ``device/`` and reaches the package through the symlink
``symmring/_device -> ../device`` plus ``[options.package_data]`` in setup.cfg; an installed symmring
JIT-compiles its kernels from ``symmring/_device``. This test builds a wheel from a copy of the source
tree (so parallel runs, e.g. one per MPI rank, never share a build directory) with
``pip wheel --no-deps --no-build-isolation --no-index`` (offline: it uses the setuptools already
installed) and checks that every file under ``device/`` is in it, byte for byte, and that the
``symmring`` console script points at a module the wheel contains.
"""

from __future__ import annotations

import ast
import configparser
import email.parser
import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IGNORED = shutil.ignore_patterns(".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__",
                                 ".pytest_cache", "out", ".whl", "*.o", "*.cubin")


def _setuptools_builds_wheels() -> bool:
    """setuptools >= 70.1 has ``bdist_wheel`` built in; older ones need the ``wheel`` package."""
    if importlib.util.find_spec("setuptools") is None:
        return False
    if importlib.util.find_spec("wheel") is not None:
        return True
    import setuptools
    major, minor = (int(p) for p in setuptools.__version__.split(".")[:2])
    return (major, minor) >= (70, 1)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    if not _setuptools_builds_wheels():
        pytest.skip("building a wheel offline needs setuptools>=70.1 (or the 'wheel' package) in this "
                    "environment; the 'test' extra should require it")
    if not (ROOT / "setup.cfg").is_file():
        pytest.skip(f"no source tree at {ROOT} (tests run from an installed copy)")
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    # symlinks=True keeps symmring/_device a symlink, as in a checkout: that is what is being tested.
    shutil.copytree(ROOT, src, symlinks=True, ignore=IGNORED)
    out = work / "dist"
    cmd = [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "--no-index",
           "-q", "-w", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=work)
    if run.returncode:
        raise AssertionError(f"{' '.join(cmd)} failed ({run.returncode}):\n{run.stdout}\n{run.stderr}")
    wheels = sorted(out.glob("symmring-*.whl"))
    assert len(wheels) == 1, wheels
    with zipfile.ZipFile(wheels[0]) as zf:
        yield zf


def _dist_info(zf: zipfile.ZipFile, name: str) -> str:
    matches = [n for n in zf.namelist() if n.count("/") == 1 and n.endswith(f".dist-info/{name}")]
    assert len(matches) == 1, (name, matches)
    return zf.read(matches[0]).decode()


def test_device_symlink_is_in_place():
    link = ROOT / "symmring" / "_device"
    assert link.is_symlink(), "symmring/_device must be a symlink to ../device"
    assert link.resolve() == (ROOT / "device").resolve()


def test_wheel_contains_every_device_file_byte_for_byte(wheel):
    device_files = sorted(p for p in (ROOT / "device").rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    assert any(p.suffix == ".cuh" for p in device_files)
    names = set(wheel.namelist())
    missing = [str(p.relative_to(ROOT)) for p in device_files
               if f"symmring/_device/{p.relative_to(ROOT / 'device').as_posix()}" not in names]
    assert not missing, f"device files missing from the wheel (setup.cfg package_data / MANIFEST.in): {missing}"
    for path in device_files:
        member = f"symmring/_device/{path.relative_to(ROOT / 'device').as_posix()}"
        assert wheel.read(member) == path.read_bytes(), member
    # The patterns the issue names are covered (kernels and headers).
    for suffix in (".cu", ".cuh"):
        expected = {p for p in device_files if p.suffix == suffix}
        shipped = {n for n in names if n.startswith("symmring/_device/") and n.endswith(suffix)}
        assert len(shipped) == len(expected), suffix


def test_wheel_contains_every_python_module(wheel):
    modules = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "symmring").rglob("*.py")
                     if "_device" not in p.relative_to(ROOT).parts and "__pycache__" not in p.parts)
    names = set(wheel.namelist())
    assert [m for m in modules if m not in names] == []


def test_wheel_installs_the_console_script(wheel):
    entry_points = configparser.ConfigParser()
    entry_points.read_string(_dist_info(wheel, "entry_points.txt"))
    assert entry_points.has_section("console_scripts")
    target = entry_points["console_scripts"].get("symmring")
    assert target is not None, dict(entry_points["console_scripts"])
    module, _, func = target.strip().partition(":")
    member = module.replace(".", "/") + ".py"
    assert member in wheel.namelist(), f"console script target {target} is not in the wheel"
    tree = ast.parse(wheel.read(member))
    defined = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assert func in defined, f"{member} does not define {func}()"


def test_wheel_metadata_names_the_package(wheel):
    import symmring
    metadata = email.parser.Parser().parsestr(_dist_info(wheel, "METADATA"), headersonly=True)
    assert metadata["Name"] == "symmring"
    assert metadata["Version"] == symmring.__version__


def test_wheel_ships_license_and_py_typed(wheel):
    names = set(wheel.namelist())
    assert "symmring/py.typed" in names
    licenses = [n for n in names if ".dist-info/" in n and n.rsplit("/", 1)[-1] == "LICENSE"]
    assert licenses and wheel.read(licenses[0]) == (ROOT / "LICENSE").read_bytes()
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text \
        and "END OF TERMS AND CONDITIONS" in text


def test_metadata_python_versions_and_extras(wheel):
    import symmring
    metadata = email.parser.Parser().parsestr(_dist_info(wheel, "METADATA"), headersonly=True)
    assert metadata["Requires-Python"] == ">=3.10"
    classifiers = metadata.get_all("Classifier")
    assert "Typing :: Typed" in classifiers and "Programming Language :: Python :: 3.11" in classifiers
    extras = set(metadata.get_all("Provides-Extra"))
    assert {"mpi", "gpu", "device", "cpu", "hf", "test", "bench", "deepgemm"} <= extras
    requires = metadata.get_all("Requires-Dist")
    by_extra = {}
    for line in requires:
        req, _, marker = line.partition(";")
        extra = marker.split("extra ==")[-1].strip().strip("'\"") if "extra ==" in marker else None
        by_extra.setdefault(extra, []).append(req.strip().replace(" ", ""))
    # DeepGEMM's wheel links libtorch: the extra pins it with the torch it was built against.
    from symmring.moe.engines.deepgemm import BUILT_FOR_TORCH
    ((dist, version), (major, minor)), = BUILT_FOR_TORCH.items()
    assert sorted(by_extra["deepgemm"]) == sorted([f"{dist}=={version}", f"torch=={major}.{minor}.*"])
    from symmring.moe.integrations.hf import TRANSFORMERS_RANGE
    assert by_extra["hf"] == [f"transformers{TRANSFORMERS_RANGE}".replace(">=5.13,<6", "<6,>=5.13")] \
        or by_extra["hf"] == [f"transformers{TRANSFORMERS_RANGE}"]
    assert any(r.startswith("torch==") and r.endswith("+cpu") for r in by_extra["cpu"])
    assert metadata["Version"] == symmring.__version__


def test_changelog_names_the_version():
    import re
    import symmring
    text = (ROOT / "CHANGELOG.md").read_text()
    newest = re.search(r"^## (\S+)", text, re.M)
    assert newest is not None and newest.group(1) == symmring.__version__, (newest and newest.group(1))
