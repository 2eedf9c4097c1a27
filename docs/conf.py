"""Sphinx configuration of the documentation site.

Build it (warnings are errors, as in CI's tests/test_docs_site.py)::

    python -m sphinx -W --keep-going -b html docs docs/_build/html

The pages are Markdown (MyST); the reference is generated at build time from the code:
the API from the docstrings (autodoc), the environment variables from the one table in
``collectives/settings.py`` and the command lines from the scripts' own argparse parsers
(``docs/_ext/collectives_docs``).
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
# The repository's own packages, not an installed copy, and the site's extensions.
sys.path[:0] = [str(ROOT), str(DOCS / "_ext")]

from collectives import __version__  # noqa: E402

project = "collectives"
author = "the collectives authors"
copyright = "the collectives authors, MIT licence"
release = __version__
version = ".".join(__version__.split(".")[:2])

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",   # the docstrings' "Args:" sections
    "collectives_docs",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "Thumbs.db", ".DS_Store"]

# MyST: anchors for the headings (pages link to page.md#a-heading), ::: fences and
# definition lists.
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence", "deflist"]

# autodoc: members in source order, signatures with their annotations as written.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autodoc_default_options = {"members": True, "show-inheritance": True}
# A method without a docstring shows none, rather than its base class's (torch's
# autograd.Function.forward, for one, whose text links into torch's own site).
autodoc_inherit_docstrings = False

html_theme = "alabaster"
html_title = f"collectives {release}"
html_static_path: list[str] = []
