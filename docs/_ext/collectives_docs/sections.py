"""``collectives-sections``: the home page's table of contents, in sections.

Each line of the content is ``Caption: page page ...``; the directive makes one toctree
per section holding the listed pages that exist (a page another helper has yet to write
is simply not listed yet), then one last section, ``More``, with every page no section
names, so that no page is ever left out of the site (Sphinx would warn about it, and
the build treats warnings as errors)::

    ```{collectives-sections}
    Start: getting-started install concepts
    Reference: reference/api settings reference/command-lines
    ```
"""

from __future__ import annotations

from typing import Any

from docutils import nodes
from sphinx.directives.other import TocTree

LAST_CAPTION = "More"


def parse_sections(lines: list[str]) -> list[tuple[str, list[str]]]:
    """``Caption: a b c`` lines as ``[(caption, [page, ...])]``; blank lines skipped."""
    sections = []
    for line in lines:
        if not line.strip():
            continue
        caption, sep, pages = line.partition(":")
        if not sep:
            raise ValueError(f"collectives-sections: {line!r} is not 'Caption: page ...'")
        sections.append((caption.strip(), pages.split()))
    return sections


class Sections(TocTree):
    """Several captioned toctrees from one list of sections (see the module's doc)."""

    option_spec: dict[str, Any] = {"maxdepth": int}

    def run(self) -> list[nodes.Node]:
        # Re-read the home page on every build: the set of pages may have changed.
        self.env.note_reread()
        here = self.env.current_document.docname
        found = set(self.env.found_docs)
        sections = parse_sections(list(self.content))
        named = {page for _, pages in sections for page in pages}
        rest = sorted(found - named - {here})
        if rest:
            sections.append((LAST_CAPTION, rest))
        depth = self.options.get("maxdepth", 2)
        result: list[nodes.Node] = []
        for caption, pages in sections:
            present = [page for page in pages if page in found]
            if present:   # TocTree.run reads its options and, through parse_content, _pages
                self._pages = present
                self.options = {"caption": caption, "maxdepth": depth}
                result.extend(super().run())
        return result

    def parse_content(self, toctree: Any) -> None:
        toctree["entries"] = [(None, page) for page in self._pages]
        toctree["includefiles"] = list(self._pages)
