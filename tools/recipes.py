"""Finding recipes: a path, or the name of a recipe shipped with tidal.

Shipped recipes live in the repository's `recipes/` folder; a wheel carries them as the
data folder `tidal/recipes`, so `tidal run quickstart_cpu` works from either install.
"""

from __future__ import annotations

import difflib
from pathlib import Path

import tidal
from tidal.tools.config import ConfigError


def recipes_dir() -> Path:
    """`tidal/recipes` inside an installed wheel, else `recipes/` of the source checkout."""
    package = Path(tidal.__file__).resolve().parent
    for candidate in (package / "recipes", package.parent / "recipes"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"the shipped recipes folder is missing from this install (looked beside {package})")


def shipped_recipes() -> list[Path]:
    return sorted(recipes_dir().glob("*.yaml"))


def resolve_recipe(arg: str) -> Path:
    """Return the recipe file `arg` names: an existing path, or a shipped recipe's name."""
    path = Path(arg)
    if path.is_file():
        return path
    shipped = {p.stem: p for p in shipped_recipes()}
    name = path.stem if path.suffix in (".yaml", ".yml") else path.name
    if path.parent in (Path("."), Path("recipes")) and name in shipped:
        return shipped[name]
    close = difflib.get_close_matches(name, shipped, n=1)
    guess = f"did you mean {close[0]}? " if close else ""
    raise ConfigError(f"recipe {arg!r} is neither a file nor a shipped recipe; {guess}shipped recipes: {sorted(shipped)}")
