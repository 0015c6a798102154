"""The `tidal` command line's help texts: the description, the examples and each command's help."""

import textwrap

from tidal.hal.versions import PACKAGES

DESCRIPTION = """\
tidal: asynchronous, streaming RL post-training of LLMs on Ascend NPUs, NVIDIA GPUs,
mixed NPU+GPU clusters and CPUs.

A run is described by a recipe, a YAML file checked against tidal's typed schema; any
key can be overridden on the command line as key=value. The platform (cpu, cuda, npu,
or fake:<kind>:<n> for CI) comes from the TIDAL_DEVICE variable, else the recipe's
`device` key, else detection (NPU, then CUDA, then CPU).
"""

EPILOG = """\
examples:
  tidal doctor                                  what tidal sees on this machine
  TIDAL_DEVICE=fake:npu:8 tidal doctor          pretend to be a node with 8 NPUs
  tidal config --keys                           every recipe key, its type and meaning
  tidal run recipes/quickstart_cpu.yaml seed=1 --check
  tidal plan mixed_npu_gpu placement.train.lend_to=rollout   where each role would run
  tidal bench store                             the data store against TransferQueue and raw ZeroMQ
  tidal simulate mixed_npu_gpu cluster=npu64_gpu32   predicted throughput on a 64 NPU + 32 GPU cluster
  tidal profile quickstart_cpu                  measure this device for the simulator's calibration
  tidal store serve --port 5555                 a store server on its own (tidal store serve --help)
  tidal export runs/quickstart_cpu-... model/   a run's last checkpoint as a Hugging Face model

exit codes: 0 success, 1 runtime failure (such as a platform that cannot load),
2 a mistake in the command, recipe or overrides (the message names the key),
128 + the signal's number when stopped by one (130 Ctrl-C, 143 SIGTERM, 141 when the
reader of tidal's output went away, as in `tidal config --keys | head`).
"""

RUN_HELP = """\
Run a recipe. RECIPE is a YAML file or the name of a shipped recipe (see `tidal doctor`).
Overrides are key=value pairs merged over the recipe, nested keys with dots
(`tidal config --keys` lists them). An unknown key or a value of the wrong type stops the
run before anything starts, naming the key.

Every run gets a run directory (run_dir=..., or <output_dir>/<name>-<timestamp>) that
receives config.yaml, the fully resolved config, and platform.json, the platform and
how it was chosen. tidal never writes into a run directory that already holds files.

An RL recipe then warm-starts the policy, measures held-out accuracy, runs the async
staleness-bounded GRPO workflow with a progress bar, measures accuracy again and writes
metrics.jsonl (and TensorBoard scalars in tensorboard/ when it is installed),
timeline.json (Chrome trace, open in Perfetto), progress.png, checkpoints/ and
summary.json. resume=<previous run_dir> continues from its last checkpoint (weights,
optimizer, data position, version, RNG and the store's in-flight rows, and the totals
its metrics count, such as failed_rewards); the keys that differ from that run are
listed, the model's shape cannot change, and a missing or damaged checkpoint file stops
it (and --check) before its run directory is made. The first Ctrl-C
or SIGTERM during RL finishes the current step and saves a checkpoint there (exit 130 or
143; a second one stops at once); a run that stops early, so or with an error, prints
the command that continues it.
"""

DOCTOR_HELP = textwrap.fill(f"""\
Show the platform tidal would choose here and how it was chosen (TIDAL_DEVICE, the
recipe, or detection), its device count, collective backend and visible-devices
variable; the installed versions of {", ".join(PACKAGES)}; which shipped
recipes can run on this machine; and /dev/shm (usable, free space, tidal's files in it and
which of them killed processes left; --clean deletes those). Nothing vendor-specific is imported unless that
platform is selected. Exits with 1 if the selected platform cannot load (the message
says what is missing) and 2 if TIDAL_DEVICE is not a valid value.

With --cluster: check the Ray cluster at RAY_ADDRESS instead (docs/deploy.md). A probe on
every node reports its devices and tags as Ray sees them, its tidal, Python, Ray, torch
and vendor versions, and whether it reaches every other node on a port the OS picks (as
the store and the weight transports do); with --recipe, whether the recipe's roles can be
placed on the cluster's nodes. Exits with 1 and one line per problem, naming the node:
versions that differ from this machine's, a node advertising NPUs or GPUs without their
vendor's torch (not with cluster.fake=true), nodes that cannot connect, roles that do not
fit. `tidal run` makes the same checks before it starts an actor on a cluster it joins.
""", width=88)

CONFIG_HELP = """\
Print the resolved config of a recipe with overrides applied (every default filled in),
or with --keys, every key of the recipe schema with its type, default and meaning.
"""


PLAN_HELP = """\
Print where each role of a recipe would run, without starting anything: the cluster
(the recipe's `cluster.nodes`, else, under runtime=ray, the Ray cluster at RAY_ADDRESS,
which `tidal run` joins, else this machine) and one row per role instance with its
node, device kind, device indices, mode (own, colocated, borrowed) and the roles it
time-shares devices with. The layout is
named from the placement block: disaggregated (each role on its own devices), colocated
(placement.rollout.colocate_with=train), hybrid (colocated, with more rollout
instances than the trainer's devices hold) or multiplexed (placement.train.lend_to=rollout:
idle training devices run rollout until the next optimizer step).

A request the cluster cannot hold fails at once with exit code 2, naming the role and
what it lacked. A plan that `tidal run` would refuse (a combination it cannot run, or
under runtime=ray a shared layout it cannot seat) is printed, followed by
"tidal run would refuse this: " and the message `tidal run` gives, with exit code 2.
--json prints the cluster (each node's kind, devices and tags), the layout, every
assignment, and run_refuses: that message, or null.
"""


BENCH_HELP = """\
Run a benchmark and print its table (ratios against baselines measured in the same run).

  store   the streaming store across processes: small rows (4096 x 4 columns of 256,
          batches of 64 and of 256), 1 MB rows (batches of 8), a trickle (1024 one-row puts,
          gets of 256) and one-row hand-off latency (10 ms idle before each put), the
          consumer reading every page it gets. tidal is
          the user's path: a plain StoreServer(Store()) process, put waiting for each
          reply, get then ack; tidal-tuned adds --put-window puts in flight,
          get(partial=True, ack=...) and a server keeping freed memory; tidal-socket (no
          shared memory), tidal-embedded (the store in the producer's process), tidal-split
          (the data on the producer's storage unit), TransferQueue 0.1.11 (installed with the
          [bench] extra; skipped otherwise) and raw ZeroMQ PUSH/PULL of the same buffers (no
          codec). Each figure is the median of --repeats runs (slowest-fastest beside it); no
          warm-up pass. Takes a few minutes on 2 cores.
  e2e     the quickstart trained with async GRPO (max_staleness=1) in one process and
          on Ray (trainer and rollout actors), and sync GRPO (max_staleness=0), from
          the same warm start, several seeds: RL samples/s, tokens/s, wall time and
          held-out accuracy (the task's strict verifier), response length at the
          start and end of RL and how many runs drifted to longer answers, with
          ratios against sync and against TRL 1.16's GRPOTrainer on the same warm
          start and prompts (installed with the [bench] extra; skipped otherwise).
          Sync and TRL run with torch's default threads and with one (-1t), sync
          also with one for rollout and the default for training (-split); each
          ratio is against the fastest of them. Systems
          run in rounds, one per seed, in reverse every other round, so the
          machine's drift falls on all of them. --steps and --seeds size it;
          --systems picks some (e.g. tidal-async,tidal-sync over --seeds 0,1,2,3,4
          for the stability figures); key=value arguments override the recipe for
          every system, e.g. device=cuda or train.precision=bf16.
          --workload longtail runs every system (TRL too) on the gsm8k_qwen recipe
          with a small local Qwen2 checkpoint whose response lengths are
          long-tailed (most end early, a few run to the 256-token budget; built
          once into ~/.cache/tidal): where a sync step waits on its stragglers.

  weights the weight transports (host, collective, ipc, and ipc-placed: the sender's
          weights kept in the shared buffer) moving a model of 4 MB .. 1 GB between two
          processes, in GB/s, against the raw channel under each: one ZeroMQ PUSH of
          the flat buffer, one gloo broadcast, one shared-memory copy. --sizes (MB) and
          --repeats size it; --systems picks some.

  simulate  real seconds `tidal simulate` takes per simulated step on the 1,024-device
          spec recipes/clusters/npu512_gpu512.yaml (mixed_npu_gpu, Qwen2.5-7B shape,
          512 prompts x 16 samples a step), and the time for 200 steps (measured with
          --steps 200, else extrapolated and labelled so; --steps defaults to 10).

  simulate-check  tidal simulate's prediction of this machine against real runs:
          profiles this machine at the quickstart's shapes (tidal profile), runs the
          quickstart async (max_staleness=1), sync (0) and async with rollout
          time-sharing the trainer's device (colocated) with `tidal run`'s path for each
          of --seeds, simulates each run on two devices of the profiled device (one core
          a role) with the run's own response lengths and rewards, and prints measured
          and predicted samples/s and step times, and the async / sync ratio against
          its targets (ratio within 10%, step times within 15%). From the runs of
          another seed come how much each role slows beside the other (async's median
          train step and generate time per token over sync's, per second the other role
          worked beside), the reward and advantage stages' time a batch, a weight
          sync's time, and the engines' time in a run over the profile's; the ratio
          with the profile's own contention figures is printed beside.
          --steps (default 150) sizes the runs; --repeats (default 7) times each
          profile point that many times (the median).

Record results in docs/benchmarks.md with the date and machine. --json prints the raw
numbers instead of the table.
"""

EXPORT_HELP = """\
Write a run's checkpoint to OUT_DIR as a Hugging Face model directory: config.json,
model.safetensors, generation_config.json (with the end and pad token ids) and the
tokenizer's files, which transformers' AutoModelForCausalLM.from_pretrained(OUT_DIR) and
AutoTokenizer.from_pretrained(OUT_DIR) load unchanged. The checkpoint is the one
RUN_DIR/checkpoints/latest names, or --step N's. OUT_DIR must not exist or be empty
(--force replaces it). The export is written beside OUT_DIR and renamed into place once
whole, so a failure leaves OUT_DIR as it was. A run directory without that checkpoint,
or an OUT_DIR in the way, exits with 2, naming it. A model that is code of its own
(config.json's auto_map: a run with model.trust_remote_code=true) keeps its code files,
and the check runs that code when the run trusted it or with --trust-remote-code. A run
that trained LoRA adapters (train.lora_rank) exports the merged weights, and its adapters
in peft's format in OUT_DIR/lora_adapter, for the weights RL started from.
"""
