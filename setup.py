"""Packaging details pyproject.toml cannot express: conf/ and tasks/ (top-level in the checkout) ship inside the wheel
as evalkit/_conf and evalkit/_tasks, so an installed evalkit finds them (see evalkit/paths.py); evalkit-lm-eval.pth
goes to site-packages, for wheels and editable installs alike, so that lm-eval's own CLI knows `--model evalkit`
(see evalkit/lm_eval_plugin.py)."""

import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "evalkit-lm-eval.pth"


class BuildWithPth(build_py):
    def run(self):
        super().run()
        shutil.copy(PTH, Path(self.build_lib) / PTH)  # the wheel's root is site-packages


class EditableWithPth(editable_wheel):
    # Editable wheels carry only what their strategy links, plus what lies in the unpacked wheel's root.
    def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
        result = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
        shutil.copy(PTH, Path(unpacked_wheel) / PTH)
        return result


setup(
    packages=find_packages(include=["evalkit*"]) + ["evalkit._conf", "evalkit._tasks"],
    package_dir={"evalkit._conf": "conf", "evalkit._tasks": "tasks"},
    package_data={
        "evalkit": ["assets/*/*"],
        "evalkit._conf": ["*.yaml", "*/*.yaml"],
        "evalkit._tasks": ["*/*.yaml", "*/*.py"],
    },
    cmdclass={"build_py": BuildWithPth, "editable_wheel": EditableWithPth},
)
