"""Which option applies to which backend, declared once by each backend's spec (its own options, and `reads`):
the check of explicit options (file and --set) and the sweep's dropping of options and duplicate points both
read it.

Pure unit tests: no processes."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from psarch import registry
from psarch.config import ConfigError, applies, field_of, from_dict, from_record, load_config, option_keys
from psarch.config.backend import Communicator, CoreBackendConfig, backend_fields
from psarch.launch.sweep import duplicates_note, expand, read_sweep


def error(path=None, overrides=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    msg = str(info.value)
    assert "\n" not in msg, msg
    return msg


def test_applies_by_kind_and_variant():
    def cfg(*ov):
        return load_config(None, ["backend.world_size=2", *ov])
    geo, sync, ddp = cfg("backend.kind=ps", "backend.mode=geo"), cfg("backend.kind=ps"), cfg("backend.kind=ddp")
    assert applies("backend.k_steps", geo) and not applies("backend.k_steps", sync)
    assert not applies("backend.k_steps", ddp) and not applies("backend.mode", ddp)
    assert applies("backend.comm", ddp) and not applies("backend.comm", sync)
    z3 = cfg("backend.kind=zero", "backend.stage=3")
    assert applies("backend.prefetch_bucket_size", z3) and not applies("backend.reduce_bucket_size", z3)
    assert applies("train.lr", ddp) and applies("backend.world_size", sync)   # fields without a declaration


def test_every_declaration_names_real_options_and_variants():
    for spec in registry.specs():
        for key, variants in option_keys(spec).items():
            field_of(key)   # a real option (ConfigError otherwise)
            if variants is not None:
                choices = field_of(f"backend.{spec.variant_key}").metadata["choices"]
                assert set(variants) <= set(choices), (spec.kind, key)


def test_a_backend_reads_only_its_own_class():
    """[backend] is the chosen backend's own frozen class: another backend's option is not there to read."""
    ddp = load_config(None, ["backend.kind=ddp", "backend.world_size=2"]).backend
    assert type(ddp) is registry.spec("ddp").options and ddp.comm == "ring"
    with pytest.raises(AttributeError):
        ddp.stage     # noqa: B018  (zero's)
    with pytest.raises(AttributeError):
        ddp.mode      # noqa: B018  (the PS's own; its servers' options are a group ddp includes: PSServers)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ddp.comm = "native"
    assert type(load_config(None).backend) is CoreBackendConfig   # single: the core's alone


def test_a_group_is_declared_once_and_included_by_name():
    comm = dataclasses.fields(Communicator)[0]
    readers = [s.kind for s in registry.specs() if s.options and comm in dataclasses.fields(s.options)]
    assert set(readers) == {"ddp", "zero", "pipeline", "tensor"}
    assert backend_fields()["comm"] is comm


def test_an_option_declared_twice_is_refused(monkeypatch):
    @dataclasses.dataclass(frozen=True)
    class Clash(CoreBackendConfig):
        stage: int = 1    # zero's name, declared again

    class ClashSpec(registry.BackendSpec):
        kind, trainer, options = "clash", "x:y", Clash

        def predict(self, cfg, phi):
            raise NotImplementedError
    registry.specs()   # the built-in ones first
    monkeypatch.setitem(registry._specs, "clash", ClashSpec())
    with pytest.raises(ValueError, match="backend.stage is declared twice"):
        backend_fields()


def test_a_config_refuses_another_backends_option_and_a_record_leaves_it_out():
    data = {"backend": {"kind": "ddp", "world_size": 2, "stage": 1}}
    with pytest.raises(ConfigError, match='backend.stage = 1: applies only to backend.kind = "zero"'):
        from_dict(data)
    assert not hasattr(from_record(data).backend, "stage")
    with pytest.raises(ConfigError, match='backend.stage = 4: allowed values are 1, 2, 3'):
        from_record({"backend": {"kind": "ddp", "stage": 4}})    # checked all the same


def test_an_explicit_option_the_backend_does_not_read_is_an_error():
    msg = error(None, ["backend.kind=ddp", "backend.world_size=2", "backend.mode=async"])
    assert 'backend.mode = "async"' in msg and 'backend.kind = "ps"' in msg and '"ddp"' in msg
    msg = error(None, ["backend.kind=ps", "backend.world_size=2", "backend.k_steps=8"])
    assert "backend.k_steps = 8" in msg and 'backend.mode = "geo"' in msg and '"sync"' in msg
    load_config(None, ["backend.kind=ps", "backend.world_size=2", "backend.mode=geo", "backend.k_steps=8"])


def test_a_base_file_may_set_options_for_other_backends_but_the_top_file_may_not(tmp_path):
    (tmp_path / "base.toml").write_text('[backend]\nworld_size = 2\nk_steps = 8\nstage = 3\n')
    (tmp_path / "ddp.toml").write_text('base = "base.toml"\n[backend]\nkind = "ddp"\n')
    assert load_config(tmp_path / "ddp.toml").backend.kind == "ddp"   # the base's k_steps and stage: defaults
    (tmp_path / "bad.toml").write_text('base = "base.toml"\n[backend]\nkind = "ddp"\nservers = 2\n')
    assert "backend.servers = 2" in error(tmp_path / "bad.toml")
    assert "backend.stage = 3" in error(tmp_path / "ddp.toml", ["backend.stage=3"])


SWEEP = """
name = "sw"
[backend]
kind = "ps"
world_size = 2
[sweep]
"backend.mode" = ["sync", "geo"]
"backend.k_steps" = [1, 4, 16]
"""


def test_sweep_runs_points_identical_once_inapplicable_options_go_once(tmp_path):
    (tmp_path / "sw.toml").write_text(SWEEP)
    points = expand(tmp_path / "sw.toml", read_sweep(tmp_path / "sw.toml"))
    assert [p.overrides for p in points] == [{"backend.mode": "sync"}] + [
        {"backend.mode": "geo", "backend.k_steps": k} for k in (1, 4, 16)]
    assert points[0].same_as == ["modesync-k_steps4", "modesync-k_steps16"]
    assert "modesync-k_steps4, modesync-k_steps16 = modesync" in duplicates_note(points)


def test_sweep_template_options_must_apply_to_some_point(tmp_path):
    # the file's options are a template for its points: k_steps is read by the geo point only
    (tmp_path / "ok.toml").write_text('[backend]\nkind = "ps"\nworld_size = 2\nk_steps = 8\n'
                                      '[sweep]\n"backend.mode" = ["sync", "geo"]\n')
    assert len(expand(tmp_path / "ok.toml", read_sweep(tmp_path / "ok.toml"))) == 2
    for text, key in (('[backend]\nkind = "ps"\nworld_size = 2\nstage = 2\n[sweep]\n"backend.mode" = ["sync"]\n',
                       "backend.stage"),
                      ('[backend]\nkind = "ps"\nworld_size = 2\n[sweep]\n"backend.comm" = ["ring", "native"]\n',
                       "backend.comm")):
        (tmp_path / "bad.toml").write_text(text)
        with pytest.raises(ConfigError, match=f"{key}: applies only to .*no point of this sweep"):
            expand(tmp_path / "bad.toml", read_sweep(tmp_path / "bad.toml"))
    with pytest.raises(ConfigError, match="backend.staleness_bound: applies only to"):   # --set counts too
        expand(tmp_path / "ok.toml", read_sweep(tmp_path / "ok.toml"), ["backend.staleness_bound=3"])


def test_shipped_experiments_keep_their_point_names():
    root = Path(__file__).parent.parent / "experiments" / "architectures"
    points = expand(root / "architectures.toml", read_sweep(root / "architectures.toml"))
    assert [p.name for p in points] == ["single-world_size1", "ddp-commring", "ddp-commnative", "zero-stage1",
                                        "zero-stage2", "zero-stage3", "ps-modesync", "ps-modeasync", "ps-modegeo"]


def test_keys_lists_allowed_values_and_where_each_option_applies(capsys):
    from psarch.cli import main

    assert main(["keys"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert '"sync" | "async" | "geo" | "ssp"' in lines["backend.mode"]
    assert "integer >= 1" in lines["backend.k_steps"] and 'backend.mode = "geo"' in lines["backend.k_steps"]
    assert "integer in [2, 65536]" in lines["workload.markov.vocab_size"] and "only" not in lines["train.lr"]
