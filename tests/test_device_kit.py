"""The device kit's vLLM wheel parts fit one device call beside the checkout (issue 44.9): fixed 58 MiB parts and a
6.2 MiB checkout made 64.2 MiB, over the 64 MiB a call carries."""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import subprocess
import sys

from conftest import REPO

SPLIT = REPO / "scripts" / "device" / "split-wheel"
MIB = 1024 * 1024


def _split_wheel_module():
    loader = importlib.machinery.SourceFileLoader("split_wheel", str(SPLIT))
    spec = importlib.util.spec_from_loader("split_wheel", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_each_wheel_part_fits_a_call_beside_the_checkout_and_the_parts_join_back(tmp_path):
    wheel = tmp_path / "vllm-0.26.0-cp38-abi3-manylinux1_x86_64.whl"
    with open(wheel, "wb") as f:  # 150 MiB, each MiB different, so a part out of order would show
        for i in range(150):
            f.write(i.to_bytes(4, "little") * (MIB // 4))
    out = tmp_path / "kit"
    run = subprocess.run([sys.executable, str(SPLIT), str(wheel), str(out)], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    checkout = _split_wheel_module().checkout_bytes(REPO)
    folders = sorted(out.iterdir(), key=lambda p: int(p.name[1:]))
    assert [p.name for p in folders] == [f"p{i}" for i in range(len(folders))] and len(folders) >= 3
    for folder in folders:
        assert checkout + sum(p.stat().st_size for p in folder.iterdir()) <= 64 * MIB, folder
    joined = hashlib.sha256()
    for part in sorted(p for folder in folders for p in folder.iterdir()):  # install-kit: cat vllmpart.* (glob order)
        joined.update(part.read_bytes())
    assert joined.hexdigest() == hashlib.sha256(wheel.read_bytes()).hexdigest()


COMPILE = REPO / "scripts" / "device" / "compile-wheels"


def test_compile_wheels_writes_the_bytecode_of_what_a_wheel_installed(tmp_path):
    """install-kit installs with --no-compile and then compiles on every core: each package and module a wheel
    installs gets its bytecode, so the run's first import compiles nothing."""
    import zipfile

    wheel = tmp_path / "demo_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("demo_pkg/__init__.py", "X = 1\n")
        z.writestr("demo_pkg/sub/mod.py", "Y = 2\n")
        z.writestr("demo_single.py", "Z = 3\n")
        z.writestr("demo_pkg-1.0.dist-info/METADATA", "Name: demo-pkg\n")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:  # what pip install --no-compile leaves: the files, no __pycache__
        z.extractall(site)
    run = subprocess.run([sys.executable, str(COMPILE), str(wheel)], cwd=REPO, capture_output=True, text=True,
                         timeout=60, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    tag = sys.implementation.cache_tag
    for source in ("demo_pkg/__init__.py", "demo_pkg/sub/mod.py", "demo_single.py"):
        path = site / source
        assert (path.parent / "__pycache__" / f"{path.stem}.{tag}.pyc").is_file(), source
