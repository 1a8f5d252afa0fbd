"""What a new user meets first: switching the quickstart's backend from the command line, a factory next to a
config that names a built-in model, --quiet, a factory's own exception, a missing base file, keygen's output.
Single-process runs of a tiny regression; no rank is spawned."""
from __future__ import annotations

import re
import textwrap
from pathlib import Path

from psarch.cli import main
from psarch.config import load_config

QUICKSTART = Path(__file__).resolve().parent.parent / "experiments" / "quickstart.toml"
TINY = textwrap.dedent("""
    seed = 1
    [workload]
    factory = "factories:regression"
    [train]
    steps = 4
    global_batch = 4
    log_every = 2
""")


def test_set_backend_kind_on_the_quickstart_drops_what_the_new_backend_does_not_read():
    notes: list[str] = []
    cfg = load_config(QUICKSTART, ['backend.kind="ps"'], notes)
    assert cfg.backend.kind == "ps" and cfg.backend.world_size == 4
    assert notes == ['backend.comm = "ring" (set in quickstart.toml) is not read by this run: applies only to '
                     'backend.kind = "ddp", "zero", "pipeline", "tensor"; this run has backend.kind = "ps", backend.mode = "sync"; dropped']


def test_a_factory_over_a_built_in_model_says_the_model_is_not_read():
    notes: list[str] = []
    cfg = load_config(QUICKSTART, ['workload.factory="factories:regression"', 'workload.model="mlp"'], notes)
    assert cfg.workload.factory == "factories:regression" and cfg.workload.model == "gpt"   # dropped: its default
    assert notes == ['workload.model = "mlp" (--set), workload.data = "markov" (set in quickstart.toml) are not read '
                     'by this run: workload.factory = "factories:regression" replaces the built-in model and data; '
                     'dropped']


def test_quiet_hides_the_progress_lines_not_the_summary(tmp_path, capsys):
    (tmp_path / "tiny.toml").write_text(TINY)
    assert main(["run", str(tmp_path / "tiny.toml"), "--out", str(tmp_path / "loud")]) == 0
    loud = capsys.readouterr().out.splitlines()
    assert main(["run", str(tmp_path / "tiny.toml"), "--out", str(tmp_path / "quiet"), "--quiet"]) == 0
    quiet = capsys.readouterr().out.splitlines()
    progress = re.compile(r"^step\s+\d+/4 ")
    assert sum(map(bool, map(progress.match, loud))) == 2 and not any(map(progress.match, quiet))
    assert quiet[0].startswith("== tiny: single, N=1") and len(quiet) == len(loud) - 2   # the same summary


def test_a_factorys_exception_is_shown_with_its_type(tmp_path, capsys, monkeypatch):
    (tmp_path / "needy_factory.py").write_text("def make(cfg):\n    raise ValueError('needs a data file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "tiny.toml").write_text(TINY.replace("factories:regression", "needy_factory:make"))
    assert main(["run", str(tmp_path / "tiny.toml"), "--out", str(tmp_path / "r"), "--quiet"]) == 1
    assert capsys.readouterr().err.strip() == "psarch: run 'tiny' failed: ValueError: needs a data file"


def test_a_missing_base_file_is_named_as_the_base(tmp_path, capsys):
    (tmp_path / "top.toml").write_text('base = "shared.toml"\n' + TINY)
    assert main(["run", str(tmp_path / "top.toml"), "--quiet"]) == 2
    assert capsys.readouterr().err.strip() == (
        f'psarch: config error: base = "shared.toml" in "{tmp_path / "top.toml"}": no such file '
        f'"{tmp_path / "shared.toml"}" (a base is found relative to the file that names it)')


def test_keygen_says_what_it_wrote_on_stdout(tmp_path, capsys):
    assert main(["keygen", str(tmp_path / "k"), "--workers", "1"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.startswith(f"keys for 1 worker(s) and 1 server(s) in {tmp_path / 'k'}; set backend.keys")
