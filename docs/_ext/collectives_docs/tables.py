"""A docutils table from rows of cells, for the generated reference pages."""

from __future__ import annotations

from typing import Sequence, Union

from docutils import nodes

Cell = Union[str, nodes.Node]


def _entry(cell: Cell) -> nodes.entry:
    entry = nodes.entry()
    if isinstance(cell, nodes.Node):
        entry += cell if isinstance(cell, nodes.paragraph) else nodes.paragraph("", "", cell)
    else:
        entry += nodes.paragraph(text=cell)
    return entry


def _row(cells: Sequence[Cell]) -> nodes.row:
    row = nodes.row()
    for cell in cells:
        row += _entry(cell)
    return row


def table(headers: Sequence[str], rows: Sequence[Sequence[Cell]],
          widths: Sequence[int]) -> nodes.table:
    """A table with one header row; ``widths`` are the columns' relative widths."""
    group = nodes.tgroup(cols=len(headers))
    for width in widths:
        group += nodes.colspec(colwidth=width)
    head = nodes.thead()
    head += _row(headers)
    body = nodes.tbody()
    for cells in rows:
        body += _row(cells)
    group += head
    group += body
    result = nodes.table(classes=["longtable"])
    result += group
    return result
