"""tidal: asynchronous, streaming RL post-training for LLMs on NPUs, GPUs and CPUs.

The subpackages live in the repository's root folders: `tidal.hal` (hal/), `tidal.flow`
(flow/), `tidal.engines` (engines/), `tidal.tools` (tools/). See docs/architecture.md.
"""

__version__ = "0.1.0"
