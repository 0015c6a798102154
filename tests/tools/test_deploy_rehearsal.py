"""docs/deploy.md's rehearsal, run as written: two Ray nodes on this machine (`ray start`,
one advertising NPUs, one GPUs), `tidal doctor --cluster`, `tidal plan` and a few steps of
the mixed recipe on fake platforms; then the checks on a broken cluster: a node with
another tidal release, and roles the nodes cannot hold, named by `tidal doctor --cluster`
and refused by `tidal run` before it starts an actor.

Only the Ray processes of this test's own folder are ended (by pid): `ray stop` would end
every Ray of the user on the machine, the test session's own among them."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _rehearsal() -> str:
    text = (ROOT / "docs" / "deploy.md").read_text()
    block = re.search(r"<!-- rehearsal:begin -->\s*```bash\n(.*?)```\s*<!-- rehearsal:end -->", text, re.S)
    assert block, "docs/deploy.md has no rehearsal block"
    return block[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _end_processes_of(folder: str) -> None:
    """End every process whose command line names `folder` (this test's Ray), and their children."""
    import psutil

    own = [p for p in psutil.process_iter(["cmdline"]) if any(folder in a for a in (p.info["cmdline"] or []))]
    tree = set(own)
    for p in own:
        try:
            tree.update(p.children(recursive=True))
        except psutil.Error:
            pass
    for p in tree:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(list(tree), timeout=15)


def _bash(script: str, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-eo", "pipefail", "-c", script], capture_output=True, text=True, env=env, timeout=timeout, cwd=env["RUN_CWD"])


@pytest.mark.slow
def test_the_deploy_guides_rehearsal_runs_and_a_broken_cluster_is_named_before_the_run(tmp_path):
    ray_tmp = tempfile.mkdtemp(prefix="tidal-rh-", dir="/tmp")  # short: Ray's socket paths live under it
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "TIDAL_DEVICE")}
    env.update(PATH=f"{BIN}:{env.get('PATH', '')}", RAY_AUTH_MODE="disabled", PORT=str(_free_port()), RAY_TMP=ray_tmp, RUN_DIR=str(tmp_path / "run"), RUN_CWD=str(tmp_path), COLUMNS="200")
    try:
        done = _bash(_rehearsal(), env)
        assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        assert "Ray cluster at 127.0.0.1:" in done.stdout and "2 node(s)" in done.stdout
        assert "no problem found" in done.stdout
        assert re.search(r"npu-0 .* 2 npu .* 2 NPU, 2 CPU", done.stdout) and re.search(r"gpu-0 .* 2 cuda .* 2 GPU, 2 CPU", done.stdout), done.stdout  # free before the run
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        assert summary["trainer_platform"]["kind"] == "npu" and summary["trainer_platform"]["fake"]
        runtime = json.loads((tmp_path / "run" / "runtime.json").read_text())
        assert [a["platform"]["kind"] for a in runtime["rollout_actors"]] == ["cuda"]
        assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3

        # A third node whose environment has another tidal release (its package metadata first on the path).
        stale = tmp_path / "stale"
        info = stale / "tidal_rl-9.9.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tidal-rl\nVersion: 9.9.0\n")
        small = "cluster.fake=true cluster.nodes=[] train.backend=torch placement.train.count=1 placement.rollout.count=1 placement.rollout.devices_each=1"
        start = f"PYTHONPATH={stale} ray start --address=127.0.0.1:$PORT --num-cpus=1 --node-name=stale-0 --disable-usage-stats"
        assert _bash(start, env, timeout=180).returncode == 0
        env["RAY_ADDRESS"] = f"127.0.0.1:{env['PORT']}"
        doctor = _bash(f"tidal doctor --cluster --recipe mixed_npu_gpu {small} placement.train.count=3", env, timeout=300)
        assert doctor.returncode == 1, doctor.stdout + doctor.stderr
        out = " ".join(doctor.stdout.split())
        assert "3 node(s)" in out
        assert "node stale-0 (cpu only) runs tidal-rl 9.9.0, the driver" in out
        assert "recipe 'mixed_npu_gpu' cannot be placed on this cluster's nodes: placement:" in out
        assert "node npu-0" not in out.split("would break a run:")[1] and "node gpu-0" not in out.split("would break a run:")[1]  # the sound nodes are not blamed

        refused = _bash(f"tidal run mixed_npu_gpu {small} run_dir={tmp_path / 'refused'} --no-progress", env, timeout=300)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert "cannot run this recipe" in refused.stderr and "node stale-0 (cpu only) runs tidal-rl 9.9.0" in refused.stderr
        assert not (tmp_path / "refused" / "metrics.jsonl").exists()  # no actor started, no step taken
    finally:
        _end_processes_of(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_doctor_cluster_says_what_to_set_without_a_cluster_and_refuses_stray_arguments(tidal_cli):
    out = tidal_cli("doctor", "--cluster", env={"RAY_ADDRESS": ""})
    assert out.returncode == 2 and "RAY_ADDRESS is not set" in out.stderr and "docs/deploy.md" in out.stderr, out.stderr
    out = tidal_cli("doctor", "--recipe", "mixed_npu_gpu")
    assert out.returncode == 2 and "go with --cluster" in out.stderr, out.stderr
