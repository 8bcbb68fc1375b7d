"""Open-loop load generator, trace replay, virtual-time simulator driver and reports.

* `loadgen.workload`: work items, arrival processes (constant, Poisson), the design's length mix,
  JSONL traces.
* `loadgen.stats`: per-request records, percentiles, throughput, SLO attainment, goodput, reports.
* `loadgen.clients`: async REST+SSE and gRPC clients and the open-loop runner (localhost only).
* `loadgen.sim`: the real scheduler and engine loop over `SimExecutor` in virtual time.
* `loadgen.cli`: `genserve-loadgen run|sim` (also `python -m loadgen`).
* `loadgen.report`: `python -m loadgen.report --out docs/benchmarks/scheduler`, the scheduler comparison.
* `loadgen.calibrate`: `python -m loadgen.calibrate --out docs/benchmarks/scheduler`, the simulator fitted to
  this machine and checked against the live server.
* `loadgen.live_policies`: `python -m loadgen.live_policies --out docs/benchmarks/scheduler/live_policies`, the
  step policy's token caps alone ("caps") and its default (the caps plus the TPOT slack spent on
  prefill) on the live server in one run, with the simulator's error.
"""
