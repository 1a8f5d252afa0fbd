"""The launch path of `psarch run`: from a config file to finished run folders. `cli.py` is the command (one run,
or a sweep, `sweep.py`); `ranks.py` starts every rank (spawned on this machine, or one under torchrun,
`torchrun.py`), each given a `job.py` RankJob, and the services a backend declares; `runner.py` is one rank's
backend-agnostic step loop (data shard, timing, logging, its record), with `progress.py` its progress line;
`supervise.py` and `stalls.py` watch the spawned ranks until they end, `processes.py` starts every child (from a
forkserver that imported torch once), `lifecycle.py` makes children die with their launcher, and `spawn.py` runs a
function on N local ranks (tests, benchmarks); `outputs.py` writes the run folder
(config.json, metrics.jsonl, summary.json, model.pt, report.txt). Nothing is imported here.
"""
