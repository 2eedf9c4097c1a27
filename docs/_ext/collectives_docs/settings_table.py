"""``collectives-settings``: the table of ``COLLECTIVES_*`` variables, generated.

The rows come from ``collectives.settings.SETTINGS``, the one table the library reads
its variables through, so the page cannot drift from the code. Each variable is also an
``envvar`` object of Sphinx's standard domain: a page may link one with
``{envvar}`COLLECTIVES_TIMEOUT```.
"""

from __future__ import annotations

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

from .tables import table


class SettingsTable(SphinxDirective):
    """The variables, one row each: name, type, default, who reads it, meaning."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        from collectives import settings

        std = self.env.get_domain("std")
        rows = []
        for setting in settings.SETTINGS:
            node_id = f"envvar-{setting.name.lower()}"
            target = nodes.target("", "", ids=[node_id])
            self.set_source_info(target)
            std.note_object("envvar", setting.name, node_id, location=target)
            name = nodes.paragraph("", "", target, nodes.literal(text=setting.name))
            rows.append([name, setting.type_doc, setting.default_text, setting.scope,
                         setting.doc])
        return [table(["variable", "type", "default", "read by", "meaning"], rows,
                      widths=[30, 12, 18, 10, 40])]
