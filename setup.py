"""The package list, found rather than listed: a subpackage added under hal/, flow/, engines/
or tools/ is in the wheel without anyone remembering to name it (the hand-written list in
pyproject.toml once left out `tidal.hal.transfer`, and every `tidal run` from the wheel
failed). Everything else about the package is in pyproject.toml."""

from setuptools import find_packages, setup

FOLDERS = {"tidal": "tidal", "tidal.hal": "hal", "tidal.flow": "flow", "tidal.engines": "engines", "tidal.tools": "tools"}
"""Import package -> the folder at the repository root that holds it."""

package_dir = {**FOLDERS, "tidal.recipes": "recipes"}  # recipes/ is a plain data folder: its YAML files ship as tidal/recipes
packages = ["tidal.recipes"]
for name, folder in FOLDERS.items():
    packages += [name, *(f"{name}.{sub}" for sub in find_packages(folder))]

setup(packages=packages, package_dir=package_dir)
