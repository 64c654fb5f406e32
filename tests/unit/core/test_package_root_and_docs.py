"""What ``import syncless`` offers, and that the documentation keeps up with the code it describes."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import syncless
from syncless._core import config, errors

REPO = Path(__file__).resolve().parents[3]
DOCS = REPO / "docs"


def _error_classes() -> dict[str, type]:
    return {name: obj for name, obj in vars(errors).items()
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == errors.__name__}


def test_the_root_re_exports_the_whole_shared_error_hierarchy():
    classes = _error_classes()
    assert "TransportError" in classes and "SynclessError" in classes
    exported = set(syncless.__all__) - {"__version__"}
    assert exported == set(classes), "syncless/__init__.py re-exports exactly the classes of _core/errors.py"
    for name, cls in classes.items():
        assert getattr(syncless, name) is cls


def test_the_capabilities_raise_the_same_classes_the_root_exports():
    # The capability packages import torch; the root must hand out the very same objects.
    from syncless import pp, syncs

    for name in ("TransportError", "TransportSetupError", "CopyEngineUnavailable", "PeerTimeoutError",
                 "TransportFailedError", "TransportClosedError"):
        assert getattr(pp, name) is getattr(syncless, name)
    assert syncs.SyncViolation is syncless.SyncViolation


def test_importing_the_root_imports_neither_torch_nor_cuda():
    code = ("import sys, syncless;"
            "bad = [m for m in ('torch', 'cuda.bindings', 'pynvml', 'cupti') if m in sys.modules];"
            "print(bad); assert not bad; syncless.TransportError")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def _configuration_rows() -> dict[str, tuple[str, str]]:
    """docs/configuration.md's table: variable -> (default, allowed), as written."""
    rows = {}
    for line in (DOCS / "configuration.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and re.fullmatch(r"`SYNCLESS_[A-Z0-9_]+`", cells[0]):
            rows[cells[0].strip("`")] = (cells[1].strip("`"), cells[2])
    return rows


def test_docs_configuration_lists_every_registered_variable_with_its_default():
    rows = _configuration_rows()
    registered = {setting.name: setting for setting in config.settings()}
    assert set(rows) == set(registered), (
        f"missing from docs/configuration.md: {sorted(set(registered) - set(rows))}; "
        f"not settings: {sorted(set(rows) - set(registered))}")
    for name, (default, allowed) in rows.items():
        setting = registered[name]
        assert default == setting.default, (
            f"{name}: the page says default {default!r}, the registry {setting.default!r}")
        # Every word of a choice list, or every number of a range, that the registry allows is on the page.
        for token in re.findall(r"[A-Za-z_]+|\d+(?:\.\d+)?", setting.allowed):
            if token in {"a", "or", "such", "as", "from", "to", "number", "of", "seconds", "one", "day", "whole",
                         "byte", "count"}:
                continue
            assert token in allowed, f"{name}: the page's allowed values {allowed!r} leave out {token!r}"


def test_no_file_of_the_project_cites_a_page_outside_the_repository_or_a_missing_one():
    cited = set()
    for folder in ("src", "tests", "examples", "scripts", "bench"):
        for path in (REPO / folder).rglob("*"):
            if path.suffix not in {".py", ".md", ""} or not path.is_file() or "results" in path.parts:
                continue
            if path == Path(__file__).resolve() or "__pycache__" in path.parts:
                continue  # this file names what it looks for
            text = path.read_text(errors="replace")
            assert "DESIGN.md" not in text and "../shared" not in text, f"{path} cites a file outside the repository"
            assert "docs/_incoming" not in text, f"{path} cites docs/_incoming, which was folded into docs/"
            cited |= set(re.findall(r"docs/([a-z_-]+\.md)", text))
    missing = sorted(page for page in cited if not (DOCS / page).is_file())
    assert not missing, f"pages cited but absent from docs/: {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_link_between_the_pages_reaches_a_file_and_heading_that_exist():
    pages = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
    anchors = {}
    for page in pages:
        headings = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.MULTILINE)
        anchors[page.resolve()] = {_slug(h) for h in headings}
    broken = []
    for page in pages:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path = (page.parent / target).resolve() if target else page.resolve()
            if not path.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and path.suffix == ".md" and anchor not in anchors.get(path, set()):
                broken.append(f"{page.name}: {target}#{anchor}")
    assert not broken, broken


# -- what a pip user gets (#28 items 3 and 14): the sdist carries what the README links to; the wheel built
# from it carries the pages (for `syncless docs`) and py.typed.


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """An sdist of this tree, and a wheel built from that sdist (as pip builds one), unpacked."""
    import tarfile
    import zipfile

    import shutil

    out = tmp_path_factory.mktemp("dist")
    # A clean copy, as a fresh clone is: a stale *.egg-info/SOURCES.txt left by an earlier build would add its
    # files to the sdist whatever MANIFEST.in says.
    clean = out / "tree"
    shutil.copytree(REPO, clean, ignore=shutil.ignore_patterns("*.egg-info", "__pycache__", "build", "dist", ".git",
                                                              ".venv", ".pytest_cache", "bench-out"))
    build = ("import sys\nfrom setuptools import build_meta as b\n"
             "print(getattr(b, sys.argv[1])(sys.argv[2]))")
    sdist = subprocess.run([sys.executable, "-c", build, "build_sdist", str(out)], cwd=clean, capture_output=True,
                           text=True, timeout=300)
    assert sdist.returncode == 0, sdist.stderr
    with tarfile.open(out / sdist.stdout.strip().splitlines()[-1]) as archive:
        archive.extractall(out / "sdist", filter="data")
    root = next((out / "sdist").iterdir())
    wheel = subprocess.run([sys.executable, "-c", build, "build_wheel", str(out)], cwd=root, capture_output=True,
                           text=True, timeout=300)
    assert wheel.returncode == 0, wheel.stderr
    with zipfile.ZipFile(out / wheel.stdout.strip().splitlines()[-1]) as archive:
        archive.extractall(out / "wheel")
    return root, out / "wheel"


def test_every_file_the_readme_links_to_is_in_the_sdist(built):
    root, _ = built
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)\s]+)?\)", (REPO / "README.md").read_text())
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    assert "docs/syncs.md" in local
    missing = [link for link in local if not (root / link).exists()]
    assert not missing, f"dead in the sdist: {missing}"
    assert sorted(p.name for p in (root / "docs").glob("*.md")) == sorted(p.name for p in DOCS.glob("*.md"))


def test_the_wheel_carries_every_page_and_py_typed_and_syncless_docs_finds_them(built):
    _, wheel = built
    assert (wheel / "syncless" / "py.typed").is_file()
    shipped = wheel / "syncless" / "_docs"
    assert sorted(p.name for p in shipped.glob("*.md")) == sorted(p.name for p in DOCS.glob("*.md"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYNCLESS_")}
    env["PYTHONPATH"] = str(wheel)  # the installed package, not this tree's src/
    found = subprocess.run([sys.executable, "-m", "syncless", "docs", "--path"], capture_output=True, text=True,
                           env=env, timeout=120, cwd=wheel)
    assert found.returncode == 0, found.stderr
    assert Path(found.stdout.strip()) == shipped
    page = subprocess.run([sys.executable, "-m", "syncless", "docs", "trace"], capture_output=True, text=True,
                          env=env, timeout=120, cwd=wheel)
    assert page.stdout == (DOCS / "trace.md").read_text()


def test_the_package_index_page_links_to_nothing_that_a_pip_user_cannot_reach():
    text = (DOCS / "package-description.md").read_text()
    assert not re.findall(r"\]\((?!https?://)[^)]+\)", text), "a relative link is dead on a package index"
    assert "syncless docs" in text


def test_the_declared_torch_floor_is_the_one_the_docs_give_and_the_tested_one():
    """#28 item 12: the metadata said torch>=2.6 while only 2.11 to 2.13 were ever tested."""
    floor = re.search(r'"torch>=([\d.]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    assert floor == "2.11"
    for page in (REPO / "README.md", DOCS / "package-description.md"):
        assert f"torch >= {floor}" in page.read_text(), page.name


def test_the_quick_start_says_how_to_get_the_cpu_build_of_torch_on_an_ordinary_machine():
    """#28 item 13: "CPU build, from local disk" was true only where CI runs."""
    readme = (REPO / "README.md").read_text()
    quick = readme[readme.index("## Quick start"):readme.index("## Measured")]
    assert "--index-url https://download.pytorch.org/whl/cpu" in quick
    assert "from local disk" not in quick.split("```")[1]  # not in the commands a user copies
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci in quick  # CI's command is still in the README, as written
