"""The documentation site builds with warnings as errors, and its generated reference
holds what the code has: every environment variable of the settings table, every
command line's parser, every public package.

The build is the README's command, into a temporary folder::

    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

from __future__ import annotations

import html
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs" / "_ext"))
BUILD_TIMEOUT_S = 300

pytest.importorskip("sphinx", reason="sphinx is not installed (pip install -e '.[docs]')")
pytest.importorskip("myst_parser",
                    reason="myst-parser is not installed (pip install -e '.[docs]')")

from collectives_docs.parsers import has_command_line  # noqa: E402


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site") / "html"
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-E", "-q", "-b", "html",
         "-d", str(out.parent / "doctrees"), "docs", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
    assert done.returncode == 0, f"the site's build failed:\n{done.stderr[-6000:]}"
    return out


def text_of(page: Path) -> str:
    """A built page's text, its typographic apostrophes (Sphinx's smartquotes) plain."""
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text())).replace("\u2019", "'")


def test_the_site_builds_without_warnings(site):
    assert (site / "index.html").is_file()


def test_every_page_is_in_the_table_of_contents(site):
    # Sphinx warns about a page no toctree holds, but only for pages it read: check from
    # the sources that each one reached the site's navigation.
    index = (site / "index.html").read_text()
    for page in sorted((ROOT / "docs").rglob("*.md")):
        name = page.relative_to(ROOT / "docs").with_suffix(".html").as_posix()
        if "_build" in page.parts or name == "index.html":
            continue
        assert f'href="{name}' in index, f"{name} is not linked from the home page"


def test_the_environment_reference_has_every_variable(site):
    from collectives import settings

    page = text_of(site / "settings.html")
    missing = [s.name for s in settings.SETTINGS if s.name not in page]
    assert not missing, f"docs/settings.md lacks {missing}"
    for setting in settings.SETTINGS:
        assert setting.default_text in page


def test_the_command_line_reference_has_every_command(site):
    from collectives import cli

    page = text_of(site / "reference" / "command-lines.html")
    for name in cli.COMMANDS:
        assert f"collectives {name}" in page
    for group in ("examples", "benchmarks"):
        for script in sorted((ROOT / group).glob("*.py")):
            if has_command_line(script.read_text()):
                assert f"{group}/{script.name}" in page, f"{group}/{script.name} is missing"
    assert "--nproc" in page and "--backend" in page


def test_the_api_reference_documents_the_public_names(site):
    import collectives
    import parallel

    page = text_of(site / "reference" / "api.html")
    for name in collectives.__all__:
        if name != "__version__":
            assert f"collectives.{name}" in page, name
    for name in ("DistributedDataParallel", "FullyShardedDataParallel", "DeviceMesh"):
        assert f"parallel.{name}" in page, name
