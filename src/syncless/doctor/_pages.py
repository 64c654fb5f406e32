"""``syncless docs [PAGE]``: the documentation that comes with the installed package.

A wheel carries the pages of ``docs/`` as ``syncless/_docs/*.md`` (copied
in by the build, ``setup.py``); a source tree or an editable install reads
``docs/`` itself. The project has no public web address, so this is how a
``pip install`` user reaches the pages: ``syncless docs`` lists them with
their files, ``syncless docs syncs`` prints one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["add_arguments", "docs_dir", "pages", "run"]

_PACKAGE_DIR = Path(__file__).resolve().parents[1]


def docs_dir() -> Path | None:
    """The folder of the documentation pages: the installed copy, else the source tree's ``docs/``; None if neither."""
    for candidate in (_PACKAGE_DIR / "_docs", _PACKAGE_DIR.parents[1] / "docs"):
        if (candidate / "README.md").is_file():
            return candidate
    return None


def _title(page: Path) -> str:
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return ""


def pages() -> dict[str, Path]:
    """Every page by name (``syncs`` for ``syncs.md``), the index (``README``) first."""
    folder = docs_dir()
    if folder is None:
        return {}
    found = sorted(folder.glob("*.md"), key=lambda p: (p.stem != "README", p.stem))
    return {page.stem: page for page in found}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``docs`` subcommand's arguments."""
    parser.add_argument("page", nargs="?", default=None, metavar="PAGE",
                        help="the page to print, e.g. syncs, cc, pp, trace, configuration (default: list them all)")
    parser.add_argument("--path", action="store_true",
                        help="print the page's file (or the folder of all pages) instead of its text (default: off)")


def run(args: argparse.Namespace) -> int:
    """List the pages, or print one; return 2 for a page that does not exist."""
    from syncless._core.exits import UsageError

    found = pages()
    if not found:
        raise UsageError("no documentation was found next to this installation of syncless (syncless/_docs/); "
                         "reinstall it from a wheel or the source distribution")
    if args.page is None:
        folder = docs_dir()
        if args.path:
            print(folder)
            return 0
        print(f"syncless documentation, in {folder} (`syncless docs PAGE` prints one):")
        width = max(len(name) for name in found)
        for name, page in found.items():
            print(f"  {name:<{width}}  {_title(page)}")
        return 0
    name = args.page.removesuffix(".md")
    page = found.get(name)
    if page is None:
        raise UsageError(f"no page {args.page!r}; the pages are: {', '.join(found)}")
    if args.path:
        print(page)
        return 0
    sys.stdout.write(page.read_text(encoding="utf-8"))
    return 0
