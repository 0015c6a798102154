"""`tidal bench simulate`: how long `tidal simulate` takes at cluster scale.

The workload: `recipes/mixed_npu_gpu.yaml` on the 1,024-device spec
`recipes/clusters/npu512_gpu512.yaml`: 512 Ascend 910B train one Qwen2.5-7B data-parallel
group, 128 rollout engines of 4 H100 each generate, 512 prompts x 16 samples a step,
responses of 2,000 tokens on average (up to 8,192), one simulated token for 64 real ones.
The figure is real seconds per simulated step; the 200-step time is measured when
`--steps 200` is given and extrapolated (and labelled so) otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

TARGET_STEPS = 200
OVERRIDES = (
    "rollout.max_new_tokens=8192",
    "model.max_positions=16384",
    "placement.train.count=512",
    "placement.rollout.count=128",
    "placement.rollout.devices_each=4",
    "algorithm.prompts_per_step=512",
    "algorithm.group_size=16",
    "rollout.prompts_per_generate=4",
)


def run(*, num_steps: int, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    from tidal.tools.config import load_config  # noqa: PLC0415
    from tidal.tools.recipes import recipes_dir, resolve_recipe  # noqa: PLC0415
    from tidal.tools.sim.cluster import load_cluster  # noqa: PLC0415
    from tidal.tools.sim.costs import ModelShape  # noqa: PLC0415
    from tidal.tools.sim.lengths import LengthModel  # noqa: PLC0415
    from tidal.tools.sim.simulate import Workload, simulate  # noqa: PLC0415

    cluster = load_cluster(recipes_dir() / "clusters" / "npu512_gpu512.yaml")
    cfg = load_config(resolve_recipe("mixed_npu_gpu"), [*OVERRIDES, f"algorithm.num_steps={num_steps}"])
    work = Workload(model=ModelShape.qwen2_5("7b"), lengths=LengthModel(mean_tokens=2000, max_new_tokens=8192), token_scale=64)
    if progress is not None:
        progress(f"simulating {num_steps} steps on {cluster.name} ({cluster.num_devices} devices)")
    began = time.perf_counter()
    prediction, _ = simulate(cfg, cluster, work, tracer_events=1)
    wall = time.perf_counter() - began
    per_step = wall / num_steps
    return {
        "cluster": cluster.name,
        "devices": cluster.num_devices,
        "samples_per_step": cfg.algorithm.prompts_per_step * cfg.algorithm.group_size,
        "steps": num_steps,
        "wall_s": wall,
        "wall_s_per_step": per_step,
        "wall_s_200_steps": wall if num_steps == TARGET_STEPS else per_step * TARGET_STEPS,
        "extrapolated": num_steps != TARGET_STEPS,
        "simulated_s": prediction.total_s,
        "samples_per_s": prediction.samples_per_s,
    }


def table(result: dict[str, Any]) -> list[list[str]]:
    how = f"extrapolated from {result['steps']}" if result["extrapolated"] else "measured"
    return [
        ["cluster", "devices", "samples/step", "steps", "wall s", "wall s/step", "200 steps, wall s", "target"],
        [result["cluster"], str(result["devices"]), f"{result['samples_per_step']:,}", str(result["steps"]), f"{result['wall_s']:.1f}", f"{result['wall_s_per_step']:.2f}", f"{result['wall_s_200_steps']:.0f} ({how})", "< 60"],
    ]
