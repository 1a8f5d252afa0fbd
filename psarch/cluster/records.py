"""The cluster's records, declared once for their writers and readers: what a pacer adds to a step's record
(PacedFields), a virtual device's facts and summary.json's `virtual_device` (VirtualDeviceSummary), an emulated
node and the bytes its link carried (NodeReport), and summary.json's `cluster` (ClusterReport). Imports nothing
of psarch: psarch/records.py builds its records on these."""
from __future__ import annotations

from typing import NotRequired, Required, TypedDict


class PacedFields(TypedDict, total=False):
    """What a pacer adds to a step's record (its `fields()`): a straggler's sleep, or a virtual device's times."""

    slept_s: float               # a straggler's sleep this step (psarch/cluster/stragglers.py)
    modelled_s: float            # a virtual device's modelled compute this step, cluster time (psarch/cluster/pacing.py)
    overrun: bool                # its real compute overran the modelled time: the host set the step's time
    host_s: float                # this machine's real compute beside it (cluster time: wall / D)
    late_s: float                # by how much its forward and backward ended after their modelled ends
    work_s: float                # the backend's own work it paced this step (a compression's), cluster time


class DeviceFacts(TypedDict):
    """A virtual device's facts per worker-step (its pacer's facts()): FLOPs, nominal times (cluster time), D."""

    forward_flops: float
    backward_flops: float
    forward_s: float
    backward_s: float
    dilation: float
    paced: NotRequired[str]      # "by call": a device paced call by call (psarch/cluster/call_pacing.py)


class VirtualDeviceSummary(DeviceFacts):
    """summary.json's `virtual_device` (psarch/cluster/device.py's summary): the device, its facts, the median
    modelled compute of the slowest worker and the timed steps that overran."""

    device: str
    peak_tflops: float
    mfu: float
    compute_s: float | None
    overrun_steps: int
    counted_steps: int
    overrun_fraction: float
    overrun_of: str              # "steps" (lockstep) or "worker-steps"
    times: str
    warning: NotRequired[str | None]   # device.overrun_line's, set once the rest is known


class NodeReport(TypedDict, total=False):
    """One node of an emulated cluster (psarch/cluster/emulated.py's Node) and the bytes its link carried."""

    node: Required[str]          # its network namespace
    role: Required[str]          # "worker" or "server"
    rank: int                    # a worker's
    server: int                  # a server's index
    address: Required[str]
    link_mbps: Required[float]   # the rate its link was shaped to
    link_sent: int               # over the steps (counted_over), kernel counters
    link_received: int
    run_link_sent: int           # over the whole run
    run_link_received: int
    link_packets_sent: int       # over the steps (absent where counted_over is "run"): data and acknowledgements
    link_packets_received: int
    retransmitted_segments: int  # over the steps, by the node's TCP (Tcp RetransSegs)


class ClusterReport(TypedDict, total=False):
    """summary.json's `cluster` (a placement's report(); {} on loopback)."""

    emulated: bool
    alpha_s: float               # this host's, as measured
    dilation: float
    counted_over: str            # "steps", or "run" where a lost worker left no step window
    nodes: list[NodeReport]
    step_time: dict[str, float]  # theory.cluster_step's measured | predicted
    wall_s: float                # the run's wall clock, launch to its ranks' end (D's probes and start-up included)
