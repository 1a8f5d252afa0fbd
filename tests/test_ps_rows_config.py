"""What backend.embeddings = "rows" with backend.kind = "ps" refuses before any process starts, in one line."""
from __future__ import annotations

import pytest

from psarch.config import ConfigError, from_dict

DLRM = {"workload": {"model": "dlrm", "data": "clicks"},
        "backend": {"kind": "ps", "world_size": 2, "embeddings": "rows"}}


def _cfg(**sections):
    data = {k: dict(v) for k, v in DLRM.items()}
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return from_dict(data)


@pytest.mark.parametrize("sections, match", [
    ({"train": {"precision": "bf16"}}, "train.precision = \"bf16\": rows move and are updated in fp32 only"),
    ({"train": {"precision": "fp16"}}, "no loss scaling of pushed rows"),
    ({"backend": {"mode": "async", "staleness_compensation": "dc"}}, "staleness_compensation = \"dc\""),
    ({"train": {"optimizer": "sgd", "momentum": 0.9}}, "train.momentum = 0.9: row-wise SGD has no momentum"),
    ({"backend": {"server_addresses": ["tcp://10.0.0.5:5555"]}}, "`psarch server` does not hold rows"),
])
def test_refused_with_one_line(sections, match):
    with pytest.raises(ConfigError, match=match) as e:
        _cfg(**sections)
    assert str(e.value).startswith("backend.embeddings = \"rows\" with ") and "\n" not in str(e.value)


def test_rows_need_the_dlrm_model():   # every backend's rule, psarch/config/rules.py
    with pytest.raises(ConfigError, match="backend.embeddings = \"rows\": needs the built-in workload.model"):
        _cfg(workload={"model": "mlp", "data": "markov"})


@pytest.mark.parametrize("mode", ["sync", "async", "ssp", "geo"])
def test_every_mode_is_accepted_in_fp32(mode):
    assert _cfg(backend={"mode": mode}).backend.embeddings == "rows"


def test_checkpoints_are_accepted():   # the servers write their row shards (tests/test_ps_rows_checkpoint.py)
    assert _cfg(train={"checkpoint_every": 5}).train.checkpoint_every == 5
