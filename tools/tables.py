"""Tables the `tidal` commands print (rich, escaped: names as written are never markup)."""

from __future__ import annotations

import sys


def print_table(title: str, header_and_rows: list[list[str]]) -> None:
    from rich.console import Console  # noqa: PLC0415
    from rich.markup import escape  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    header, *rows = header_and_rows
    table = Table(title=escape(title))
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*map(escape, row))  # node names and tags as written: `[a100]` is no markup
    Console(width=None if sys.stdout.isatty() else 160).print(table)
