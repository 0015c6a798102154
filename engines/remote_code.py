"""The code of a `trust_remote_code` checkpoint, carried to processes that do not have it.

transformers imports such a checkpoint's modeling and configuration files as dynamic modules
(`transformers_modules.<folder>.<hash>.<file>`), which it copies into its modules cache
(`HF_MODULES_CACHE`) in the process that loads the checkpoint. An object of one of their
classes pickled there - the model recipe a led train group's followers build from
(`tidal.engines.fsdp_commands.model_recipe`) - cannot be unpickled in a process that did
not load that checkpoint (a follower rank, on this node or another one): `ModuleNotFoundError:
No module named 'transformers_modules'`. `module_files` reads the source files such classes
need; `install` writes them into this process's cache where transformers would have, so the
pickle then imports them as rank 0 did.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from tidal.flow.files import write_whole

DYNAMIC_PACKAGE = "transformers_modules"
"""The package transformers imports remote code under (`TRANSFORMERS_DYNAMIC_MODULE_NAME`)."""


def module_files(*classes: type) -> dict[str, str]:
    """The source files of the dynamic modules `classes` and their bases are defined in:
    every `.py` file in each such module's folder (its relative imports live beside it),
    keyed by their path under the modules cache. Empty when none is remote code."""
    files: dict[str, str] = {}
    for cls in classes:
        for klass in cls.__mro__:
            parts = klass.__module__.split(".")
            if parts[0] != DYNAMIC_PACKAGE:
                continue
            source = getattr(sys.modules.get(klass.__module__), "__file__", None)
            if source is None:
                raise ValueError(f"{klass.__qualname__} comes from {klass.__module__}, which has no source file to send to the other ranks")
            folder = Path(source).parent
            cache = folder.parents[len(parts) - 2]  # the folder `transformers_modules` is in
            for file in sorted(folder.glob("*.py")):
                files[file.relative_to(cache).as_posix()] = file.read_text(encoding="utf-8")
    return files


def install(files: dict[str, str]) -> None:
    """Write `module_files`' files into this process's modules cache (a file already there
    with the same text is left alone; others are replaced whole, so ranks that share the
    cache never read a half-written file) and make them importable."""
    if not files:
        return
    from transformers.dynamic_module_utils import HF_MODULES_CACHE, create_dynamic_module  # noqa: PLC0415 - remote code is rare

    cache = Path(HF_MODULES_CACHE)
    for name, text in files.items():
        relative = Path(name)
        if relative.is_absolute() or ".." in relative.parts or relative.parts[0] != DYNAMIC_PACKAGE:
            raise ValueError(f"remote code file {name!r} is not under {DYNAMIC_PACKAGE}/")
        create_dynamic_module(relative.parent)  # the packages' __init__ files, and the cache on sys.path
        path = cache / relative
        if path.is_file() and path.read_text(encoding="utf-8") == text:
            continue
        write_whole(path, text)
    importlib.invalidate_caches()
