"""The documentation site's own Sphinx directives.

``collectives-sections``
    the home page's table of contents: sections in a set order, each listing the pages
    that exist, and every other page under a last section, so a new page is never left
    out of the site (sections.py)
``collectives-settings``
    the table of ``COLLECTIVES_*`` environment variables, from ``collectives.settings``
    (settings_table.py)
``collectives-command-lines``
    the options of every command line (``collectives`` subcommands, examples,
    benchmarks), read from their own argparse parsers (command_lines.py)
"""

from __future__ import annotations

from typing import Any

from .command_lines import CommandLines
from .sections import Sections
from .settings_table import SettingsTable


def setup(app: Any) -> dict:
    app.add_directive("collectives-sections", Sections)
    app.add_directive("collectives-settings", SettingsTable)
    app.add_directive("collectives-command-lines", CommandLines)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
