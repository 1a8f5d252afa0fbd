"""A run's temporary credentials (worker passwords, CURVE secret keys) outlive no launcher (issue 35): its
watcher removes the folder when the launcher dies by SIGKILL, and the next run sweeps a folder whose
launcher is gone."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from procs import alive, descendants
from psarch.ps.key_watch import PREFIX, KeyFolder, sweep
from test_lifecycle import ENV, TINY, assert_all_gone, training
from timing import scaled

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc (Linux)")


def _key_folders(tmp: Path) -> list[Path]:
    return sorted(tmp.glob(f"{PREFIX}*"))


def test_sigkill_of_the_launcher_removes_the_run_credentials(tmp_path):
    tmp = tmp_path / "tmp"   # the launcher's temporary directory: its key folder is the only one there
    tmp.mkdir()
    (tmp_path / "tiny.toml").write_text(TINY)
    proc = subprocess.Popen([sys.executable, "-m", "psarch.cli", "run", "tiny.toml", "--out", "out", "--quiet",
                             "--set", "backend.kind=ps", "--set", "backend.world_size=2", "--set", "backend.mode=async"],
                            cwd=tmp_path, env=dict(ENV, TMPDIR=str(tmp)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    kids = training(tmp_path, proc, ranks=2)
    folders = _key_folders(tmp)
    assert len(folders) == 1 and (folders[0] / "worker1.password").is_file(), folders
    proc.kill()   # SIGKILL: nothing in the launcher runs
    proc.communicate(timeout=scaled(30))
    deadline = time.monotonic() + scaled(60)
    while folders[0].exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not folders[0].exists(), "the run's credentials outlived its launcher"
    assert_all_gone(kids)


def test_a_finished_run_leaves_no_folder_and_no_watcher(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    keys = KeyFolder()
    watcher = keys.watcher.pid
    assert Path(keys.path).is_dir() and Path(keys.path).name.startswith(f"{PREFIX}{os.getpid()}-")
    keys.remove()
    assert not Path(keys.path).exists() and not alive(watcher) and watcher not in descendants(os.getpid())


def test_the_next_run_sweeps_folders_whose_launcher_is_gone(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    dead, live = tmp_path / f"{PREFIX}{gone}-abc", tmp_path / f"{PREFIX}{os.getpid()}-abc"
    other = tmp_path / f"{PREFIX}k3jx9ab"   # an older name, no pid: not known to be gone
    for d in (dead, live, other):
        d.mkdir()
        (d / "worker0.password").write_text("secret")
    assert sweep(tmp_path) == [dead]
    assert not dead.exists() and live.is_dir() and other.is_dir()
