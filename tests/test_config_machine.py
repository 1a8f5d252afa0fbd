"""Config against this machine (check_machine, resolve_factory): a device it lacks, a text file that is missing or
too short, a factory module in the working directory; each refusal one line.

Pure unit tests: no processes."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from psarch.config import ConfigError, check_machine, load_config, resolve_factory
from test_config import assert_names


def machine_error(overrides: list[str]) -> str:
    cfg = load_config(None, overrides)  # valid as a config: the machine is what lacks
    with pytest.raises(ConfigError) as info:
        check_machine(cfg)
    msg = str(info.value)
    assert msg and "\n" not in msg
    return msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a CPU-only machine")
def test_cuda_asked_for_on_a_cpu_machine():
    assert_names(machine_error(["backend.device=cuda"]), 'backend.device = "cuda"', "no CUDA device", '"cpu"')
    msg = machine_error(["backend.kind=ddp", "backend.world_size=2", "backend.dist_backend=nccl"])
    assert_names(msg, 'backend.dist_backend = "nccl"', "no CUDA device", '"gloo"')


def test_text_file_must_exist_and_hold_one_sequence(tmp_path):
    text = tmp_path / "t.txt"
    base = ["workload.data=text", f"workload.text.path={text}", "workload.seq_len=8"]
    assert_names(machine_error(base), f'workload.text.path = "{text}"', "no such file")
    text.write_bytes(b"")
    assert_names(machine_error(base), "has 0 bytes", "workload.seq_len = 8", "at least 9")
    text.write_bytes(b"12345678")
    assert_names(machine_error(base), "has 8 bytes", "at least 9")
    text.write_bytes(b"123456789")
    check_machine(load_config(None, base))  # one sequence and its target: enough
    check_machine(load_config(None, ["workload.data=text", "workload.text.path=nowhere.txt",
                                     "workload.factory=psarch.workload:build_workload"]))  # a factory replaces data


def test_factory_module_in_the_working_directory(tmp_path, monkeypatch):
    """As under `python -m`: the console script's sys.path[0] is its bin folder, not the working directory."""
    (tmp_path / "psarch_cwd_factory_mod.py").write_text("def make():\n    return 1\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    try:
        assert resolve_factory("psarch_cwd_factory_mod:make")() == 1
        assert str(tmp_path) in sys.path
    finally:
        sys.modules.pop("psarch_cwd_factory_mod", None)
