"""Tests that start `tidal` add to the interpreter's PYTHONPATH rather than replace it (issue 40:
on a GPU machine the package came from PYTHONPATH, and a test's own entry hid it)."""

from __future__ import annotations

import os


def test_a_childs_pythonpath_is_added_to_not_replaced(child_env, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/bundle/site")
    monkeypatch.setenv("TIDAL_DEVICE", "cuda")
    env = child_env({"PYTHONPATH": "/tests/tools", "RAY_ADDRESS": ""})
    assert env["PYTHONPATH"] == f"/tests/tools{os.pathsep}/bundle/site" and env["RAY_ADDRESS"] == "" and "TIDAL_DEVICE" not in env
    monkeypatch.delenv("PYTHONPATH")
    assert child_env({"PYTHONPATH": "/tests/tools"})["PYTHONPATH"] == "/tests/tools"
