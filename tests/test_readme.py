"""The README's first two commands are the quickstart and the test command CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _commands() -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_opens_with_install_and_test_commands():
    first, second = _commands()[:2]
    for cmd in (first, second):
        assert "\n" not in cmd and "pip install -c constraints.txt" in cmd
    assert first.endswith(("tidal doctor", "tidal run quickstart_cpu"))
    assert re.search(r"&& pytest( -n \d+)?$", second) and ".[test]" in second


def test_ci_runs_the_readme_test_command_verbatim():
    test_command = _commands()[1]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci, "the test command in .ci/run must be the README's, verbatim"


def test_readme_links_resolve():
    text = (ROOT / "README.md").read_text()
    for link in re.findall(r"\]\(([^)#:]+)\)", text):
        assert (ROOT / link).exists(), f"README links to missing {link}"
