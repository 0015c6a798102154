"""`tidal run`: load and validate a recipe, choose the platform, set up the run directory.

The run directory always receives `config.yaml` (the resolved config, every default
filled in) and `platform.json` (the platform descriptor and how it was chosen), before
any work starts, so every run can be reproduced from its own folder.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tidal.tools.config import ConfigError, check_runnable, load_config, to_yaml


def _new_run_dir(cfg: Any) -> Path:
    if cfg.run_dir:
        run_dir = Path(cfg.run_dir)
        if run_dir.exists() and any(run_dir.iterdir()):
            raise ConfigError(
                f"run_dir {str(run_dir)!r} already holds files; tidal never writes over a run: "
                "choose a new run_dir (or leave it unset for a timestamped one)"
            )
    else:
        stem = Path(cfg.output_dir) / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        run_dir, n = stem, 1
        while run_dir.exists():
            run_dir, n = Path(f"{stem}-{n}"), n + 1
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def prepare_run(recipe: Path, overrides: Sequence[str]) -> tuple[Any, Path]:
    """Validate `recipe` + `overrides`, select the platform, write the run directory.

    Raises:
        ConfigError: a bad key or value, or a combination `tidal run` cannot run (the CLI
            exits with code 2).
        PlatformError: the platform the recipe or TIDAL_DEVICE asks for cannot load.
    """
    from tidal.hal import init_platform  # noqa: PLC0415 - imports torch

    cfg = load_config(recipe, overrides)
    check_runnable(cfg)
    selection = init_platform(cfg.device)
    selection.platform.seed_all(cfg.seed)
    run_dir = _new_run_dir(cfg)
    cfg.run_dir = str(run_dir)
    _write(run_dir / "config.yaml", to_yaml(cfg))
    platform_info = {
        "spec": selection.spec,
        "chosen_by": selection.chosen_by,
        "reason": selection.reason,
        "descriptor": selection.platform.descriptor.to_dict(),
    }
    _write(run_dir / "platform.json", json.dumps(platform_info, indent=2) + "\n")
    return cfg, run_dir
