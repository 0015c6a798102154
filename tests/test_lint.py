"""The linter and the type checker, run in CI by the README's test command: ruff over the
repository (ruff.toml: pyflakes, import order, bugbear, naming, blind excepts, imports at
the top unless a noqa says why) and mypy over every package: `tidal.hal`, `tidal.flow`, `tidal.engines` and `tidal.tools` (mypy.ini)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hal", "flow", "engines", "tools")
TYPE_CHECKED = ("tidal.hal", "tidal.flow", "tidal.engines", "tidal.tools")


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is not installed: pip install -c constraints.txt -e '.[test]'"
    out = subprocess.run([ruff, "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


def test_mypy_finds_nothing_in_any_package(tmp_path):
    # `tidal.hal` is the folder hal/ (setup.py's package_dir): a tree of links lets mypy see the packages by name
    tree = tmp_path / "tree" / "tidal"
    tree.mkdir(parents=True)
    shutil.copy(ROOT / "tidal" / "__init__.py", tree / "__init__.py")
    for folder in PACKAGES:
        (tree / folder).symlink_to(ROOT / folder, target_is_directory=True)
    args = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "mypy.ini"), "--cache-dir", str(tmp_path / "cache"), *(a for p in TYPE_CHECKED for a in ("-p", p))]
    out = subprocess.run(args, cwd=tree.parent, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
