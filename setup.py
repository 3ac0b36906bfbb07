"""The one build step pyproject.toml cannot say: the config tree at the checkout's root (conf/ and experiments/, the
files users read and edit) copied into the wheel's grpo package (grpo/conf/, grpo/experiments/), where grpo.conf finds
them when the package is installed, so `grpo-train` composes the same files outside the checkout. An editable install
or `PYTHONPATH=src` reads the root's own files (docs/architecture.md, "The config tree")."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# Checkout directory -> its place in the installed grpo package.
SHIPPED_TREES = {"conf": "conf", "experiments": "experiments"}


class BuildPyWithConfigTree(build_py):
    """build_py, then the YAML files of SHIPPED_TREES into the build's grpo/ (not for an editable install)."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        for source, target in SHIPPED_TREES.items():
            for path in sorted((ROOT / source).rglob("*.yaml")):
                out = Path(self.build_lib, "grpo", target, path.relative_to(ROOT / source))
                self.mkpath(str(out.parent))
                self.copy_file(str(path), str(out))


setup(cmdclass={"build_py": BuildPyWithConfigTree})
