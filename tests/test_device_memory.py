"""cluster.device_mem_gbps: a custom device's (or this core's) memory bandwidth, which prices memory-bound work (top-k's
selection) in the prediction and in the pacing, as a profile's data-sheet bandwidth does; refused where it has no
meaning (a profile has its own, measured compute prices nothing)."""
from __future__ import annotations

import math

import pytest

from collective.compression_theory import TOPK_PASSES
from collective.theory import ddp_bucket_shapes

from psarch.cluster.device import MEMORY_GBPS, rates
from psarch.config import ConfigError, from_dict
from psarch.theory import simulated_step

GPT = {"gpt": {"n_layer": 1, "n_embd": 16, "n_head": 2}}


def _cfg(cluster: dict, compression: str = "topk"):
    return from_dict({"backend": {"kind": "ddp", "world_size": 2}, "workload": GPT,
                      "train": {"compression": compression, "global_batch": 4}, "cluster": cluster})


def _step(cfg) -> float:
    """The simulated step of 1e6 parameters, 10 ms of compute, on 1 Gbit/s links."""
    return float(simulated_step(cfg, 1e6, 0.01, 0.0075, 0.0).step_s)


def test_a_custom_devices_memory_bandwidth_is_its_rate():
    custom = {"device_tflops": 1e-3, "mfu": 0.5}
    assert rates(_cfg(custom)) == (pytest.approx(0.5e9), 0.0)                 # not known: unpriced
    assert rates(_cfg({**custom, "device_mem_gbps": 2.0})) == (pytest.approx(0.5e9), 2e9)
    assert rates(_cfg({"device": "cpu-core", "device_tflops": 1e-3, "device_mem_gbps": 3.0}))[1] == 3e9
    assert rates(_cfg({"device": "h100"}))[1] == MEMORY_GBPS["h100"] * 1e9   # a profile's own


def test_top_k_selection_is_priced_at_the_given_bandwidth():
    """The same top-k config simulated on a custom device without and with a memory bandwidth: the step grows by
    the selection's bytes (TOPK_PASSES over every bucket, fp32) over it."""
    custom = {"device_tflops": 1e-3, "mfu": 0.5}
    custom = {**custom, "emulate": True, "link_mbps": 1000.0, "dilation": 1.0}
    steps = [_step(_cfg({**custom, **extra})) for extra in ({}, {"device_mem_gbps": 10.0}, {"device_mem_gbps": 1.0})]
    selection = sum(TOPK_PASSES) * 4 * sum(math.prod(s) for b in ddp_bucket_shapes(_cfg(custom)) for s in b)
    assert steps[1] - steps[0] == pytest.approx(selection / 10e9, rel=1e-6)
    assert steps[2] - steps[0] == pytest.approx(selection / 1e9, rel=1e-6)
    fp16 = [_step(_cfg({**custom, **extra}, "fp16")) for extra in ({}, {"device_mem_gbps": 1.0})]
    assert fp16[0] == fp16[1]                       # a cast is priced at nothing here, with or without a bandwidth


@pytest.mark.parametrize("cluster, says", [({"device": "h100", "device_mem_gbps": 100.0}, "data sheet"),
                                           ({"device": "cpu-measured", "device_mem_gbps": 100.0}, "modelled device")])
def test_device_mem_gbps_is_refused_where_it_means_nothing(cluster, says):
    with pytest.raises(ConfigError, match=f"cluster.device_mem_gbps = 100: .*{says}"):
        _cfg(cluster)
