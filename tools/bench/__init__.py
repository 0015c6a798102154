"""`tidal bench`: each benchmark in a module of its own, ratios against baselines measured in
the same run (docs/benchmarks.md records the results).

- `e2e`: whole RL runs (tidal async and sync, TRL) on the quickstart or the `longtail` workload.
- `store`: the streaming store on the user's path, beside TransferQueue (`tq`) and raw ZeroMQ.
- `weights`: the weight transports between two processes.
- `simulate`: how long `tidal simulate` takes on a 1,024-device cluster.
- `fixture`: the local checkpoints and files the benches and tests build.
"""
