"""The Ray runtime (`runtime: ray`): everything that starts, places, feeds and watches
actors, in one package.

- `placement`: a `flow.placement.Plan` as Ray placement groups and actor options
  (node pinning, device-kind tags, fake devices), and joining or starting a Ray cluster.
- `runtime`: the `RolloutActor` (the same `RolloutWorker` loop the local runtime runs in
  a thread, against the trainer's store over ZeroMQ) and the trainer's `RayRollouts`
  (runs the actors' loops, sends each version's weights, restarts actors Ray brought back).
- `wiring`: one weight wiring per transport (`make_wiring`), over
  `tidal.hal.transfer`'s senders and receivers.
- `sends`: the trainer's queued sends (`transport.overlap`).
- `liveness`: the trainer's pings of its actors and transfer timeouts.
- `faults`: Ray's errors as one line naming the actor and the cause.

Ray itself is imported only inside functions that need it: importing this package does
not load Ray. `tools/ray_run.py` is the glue `tidal run` needs on top.
"""
