"""docs/coming-from.md stays true: every tidal key its tables name exists, and every value
they give one is a value that key takes (`load_config` accepts it; a complaint about another
key, one the value needs beside it, is fine)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tidal.tools.config import ConfigError, RecipeConfig, iter_keys, load_config
from tidal.tools.recipes import resolve_recipe

PAGE = Path(__file__).resolve().parents[1] / "docs" / "coming-from.md"


def _tidal_cells() -> list[tuple[str, str]]:
    """(the other framework's setting, the tidal cell) of every table row."""
    rows = []
    for line in PAGE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if line.startswith("| ") and len(cells) == 3 and not set(cells[1]) <= set("-") and cells[1] != "tidal":
            rows.append((cells[0], cells[1]))
    return rows


def _named(cell: str) -> list[str]:
    """The tidal keys a cell names, each as written (`key` or `key=value`); not another framework's flags."""
    return [item for item in re.findall(r"`([^`]+)`", cell) if not item.startswith("--")]


def test_the_page_maps_many_settings_and_says_what_is_not_built():
    rows = _tidal_cells()
    assert len(rows) > 80 and sum(cell == "not built" for _, cell in rows) >= 3
    assert all(_named(cell) or cell == "not built" for _, cell in rows), [row for row in rows if not _named(row[1]) and row[1] != "not built"]


@pytest.mark.parametrize(("theirs", "cell"), _tidal_cells(), ids=lambda value: value[:60])
def test_every_tidal_key_it_names_exists_and_takes_the_value_given(theirs, cell):
    keys = {k.key for k in iter_keys(RecipeConfig)}
    for item in _named(cell):
        key, _, value = item.partition("=")
        assert key in keys, f"{theirs}: {key!r} is not a tidal key"
        if value and value != "module:function":
            try:
                load_config(resolve_recipe("quickstart_cpu"), [item])
            except ConfigError as e:
                assert not str(e).startswith(f"{key}="), f"{theirs}: {e}"
