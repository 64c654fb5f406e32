"""Build hook: install the documentation (``docs/*.md``) as package data, at ``syncless/_docs/``.

Everything else is declared in ``pyproject.toml``. The pages live once, in ``docs/`` at the top of the
source tree, where the README and the repository link to them; a wheel has no such folder, so this copies
them into the package when it is built, for ``syncless docs`` to find (``syncless.doctor._pages``). An
editable install reads ``docs/`` from the source tree instead.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class BuildPyWithDocs(build_py):
    """``build_py`` that also copies ``docs/*.md`` into ``<build_lib>/syncless/_docs/``."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        pages = sorted((HERE / "docs").glob("*.md"))
        if not pages:
            raise RuntimeError(f"no documentation to ship: {HERE / 'docs'} has no *.md (is MANIFEST.in's graft gone?)")
        target = Path(self.build_lib) / "syncless" / "_docs"
        self.mkpath(str(target))
        for page in pages:
            self.copy_file(str(page), str(target / page.name))


setup(cmdclass={"build_py": BuildPyWithDocs})
