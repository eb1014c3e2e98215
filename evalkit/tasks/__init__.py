"""The code of evalkit's tasks as a package: ``tasks/<name>/<module>.py`` imports as ``evalkit.tasks.<name>.<module>``
(``from evalkit.tasks.aime24 import aime``), from a checkout and from an installed wheel alike
(:func:`evalkit.core.paths.tasks_dir`). A task's code lives in its folder, beside its YAML; each folder is a namespace
package, so it needs no ``__init__.py``."""

from evalkit.core.paths import tasks_dir

__path__ = [str(tasks_dir())]
