"""Packaging details pyproject.toml cannot express: conf/ and tasks/ (top-level in the checkout) ship inside the wheel
as evalkit/_conf and evalkit/_tasks, so an installed evalkit finds them (see evalkit/core/paths.py); evalkit-lm-eval.pth
goes to site-packages, for wheels and editable installs alike, so that lm-eval's own CLI knows `--model evalkit`
(see evalkit/lm/plugin.py); hydra_plugins/evalkit_sweeper, the presets' sweeper, is a package Hydra finds in both."""

import shutil
from pathlib import Path

from setuptools import find_namespace_packages, find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "evalkit-lm-eval.pth"
PLUGIN = "hydra_plugins/evalkit_sweeper"  # the presets' Hydra sweeper (evalkit/run/sweeper.py)


class BuildWithPth(build_py):
    def run(self):
        super().run()
        shutil.copy(PTH, Path(self.build_lib) / PTH)  # the wheel's root is site-packages


class EditableWithPth(editable_wheel):
    # Editable wheels carry only what their strategy links, plus what lies in the unpacked wheel's root. Hydra finds
    # its plugins by listing the folders of hydra_plugins, which an editable install's import hook does not show: a
    # package there whose __path__ is the checkout's folder lets Hydra find evalkit's sweeper, edits to it included.
    def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
        result = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
        shutil.copy(PTH, Path(unpacked_wheel) / PTH)
        plugin = Path(unpacked_wheel) / PLUGIN
        plugin.mkdir(parents=True, exist_ok=True)
        (plugin / "__init__.py").write_text(f"__path__ = [{str(Path(PLUGIN).resolve())!r}]\n")
        return result


def data_packages(name: str, folder: str, patterns: list[str]) -> dict[str, list[str]]:
    """``folder`` and each folder below it as a package of ``name`` holding only data files (setuptools warns about
    every importable folder not listed as a package)."""
    subs = sorted(p.relative_to(folder) for p in Path(folder).rglob("*") if p.is_dir() and p.name != "__pycache__")
    return {name: patterns} | {".".join([name, *sub.parts]): patterns for sub in subs}


DATA = (data_packages("evalkit._conf", "conf", ["*.yaml"]) | data_packages("evalkit._tasks", "tasks", ["*.yaml", "*.py"])
        | data_packages("evalkit.assets", "evalkit/assets", ["*"]))

setup(
    # Hydra takes plugins from the hydra_plugins namespace package only
    packages=find_packages(include=["evalkit*"]) + find_namespace_packages(include=["hydra_plugins.*"]) + list(DATA),
    package_dir={"evalkit._conf": "conf", "evalkit._tasks": "tasks"},
    package_data=DATA,
    cmdclass={"build_py": BuildWithPth, "editable_wheel": EditableWithPth},
)
