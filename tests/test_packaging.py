"""The wheel: built from the sources, installed into a fresh venv, every subpackage and the
shipped recipes found from the installed copy (not from this checkout), and a few
quickstart steps run from it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("tidal", "hal", "flow", "engines", "tools", "recipes", "setup.py", "pyproject.toml", "README.md", "constraints.txt")
FOLDERS = {"tidal": "tidal", "hal": "tidal.hal", "flow": "tidal.flow", "engines": "tidal.engines", "tools": "tidal.tools"}


def source_packages() -> list[str]:
    """Every package of this checkout, as imported: each folder under FOLDERS with an __init__.py."""
    found = []
    for folder, name in FOLDERS.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            parts = init.parent.relative_to(ROOT / folder).parts
            found.append(".".join((name, *parts)))
    return found


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(src)],
        check=True, capture_output=True, text=True,
    )
    (wheel,) = dist.glob("tidal_rl-*.whl")

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    # The fresh venv borrows this environment's dependencies (torch, ray, ...) through a
    # .pth line, so no download is needed; tidal itself comes only from the wheel.
    new_site = Path(subprocess.check_output([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    (new_site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)], check=True)

    env = {k: v for k, v in os.environ.items() if k not in ("TIDAL_DEVICE", "PYTHONPATH")}
    packages = source_packages()
    assert "tidal.hal.transfer" in packages and "tidal.flow.store" in packages
    code = f"import importlib, json; print(json.dumps([importlib.import_module(name).__file__ for name in {packages!r}]))"
    files = json.loads(subprocess.check_output([str(py), "-c", code], cwd=tmp_path, env=env, text=True))
    assert len(files) == len(packages) and all(str(new_site) in f for f in files), files  # every subpackage, from the wheel

    tidal_exe = env_dir / "bin" / "tidal"
    doctor = subprocess.run([str(tidal_exe), "doctor", "--json"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert doctor.returncode == 0, doctor.stderr
    recipes = json.loads(doctor.stdout)["recipes"]
    assert recipes and all(str(new_site / "tidal" / "recipes") in r["path"] for r in recipes)
    assert "quickstart_cpu" in {r["recipe"] for r in recipes}

    run = subprocess.run(
        [str(tidal_exe), "run", "quickstart_cpu", f"run_dir={tmp_path / 'run'}", "--check"],
        cwd=tmp_path, env=env, capture_output=True, text=True,
    )
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "run" / "config.yaml").is_file()
    small = ["algorithm.num_steps=3", "sft.steps=2", "task.num_eval_prompts=10", "checkpoint_every=10", "tensorboard=false", "--no-progress"]
    run = subprocess.run([str(tidal_exe), "run", "quickstart_cpu", f"run_dir={tmp_path / 'steps'}", *small], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads((tmp_path / "steps" / "summary.json").read_text())["steps"] == 3
