"""A run's temporary credentials outlive no launcher. The folder (`psarch-keys-<launcher pid>-*` in the temporary
directory) has a watcher: a small process that reads a pipe only the launcher holds and removes the folder when
it closes, which the kernel does when the launcher ends by any means, SIGKILL included. A folder whose launcher
died before its watcher started is swept by the next run that makes credentials (its launcher pid is gone).

    python -m psarch.ps.key_watch FOLDER     # the watcher; its stdin is the launcher's pipe
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

PREFIX = "psarch-keys-"


class KeyFolder:
    """A private folder (0700) for one run's credentials, and its watcher."""

    def __init__(self) -> None:
        sweep()
        self.path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")
        # its own session: a Ctrl-C for the launcher's process group must not end the watcher first
        self.watcher: subprocess.Popen | None = subprocess.Popen(
            [sys.executable, "-m", "psarch.ps.key_watch", self.path], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, start_new_session=True)

    def remove(self) -> None:
        """Remove the folder now, and let the watcher go."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self.watcher is not None:
            assert self.watcher.stdin is not None   # started with stdin=PIPE
            self.watcher.stdin.close()   # EOF: the watcher removes what is left (nothing) and leaves
            try:
                self.watcher.wait(10)
            except subprocess.TimeoutExpired:   # still starting on a loaded machine, with nothing left to remove
                self.watcher.kill()
                self.watcher.wait()
            self.watcher = None


def sweep(tmp: str | Path | None = None) -> list[Path]:
    """Remove this user's key folders whose launcher is gone; the folders removed."""
    removed = []
    for folder in Path(tmp or tempfile.gettempdir()).glob(f"{PREFIX}*"):
        pid = folder.name[len(PREFIX):].partition("-")[0]
        try:
            mine = folder.is_dir() and folder.stat().st_uid == os.getuid()
        except OSError:
            continue
        if mine and pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's process holds that pid
        return True
    return True


def main(folder: str) -> None:
    """Wait for the launcher's pipe to close, then remove its key folder."""
    from psarch.launch.lifecycle import leave
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not Path(folder).name.startswith(PREFIX):
        print(f"psarch key watcher: {folder!r} is not a psarch key folder", file=sys.stderr)
        leave(2)
    try:
        while sys.stdin.buffer.read(4096):
            pass
    except OSError:
        pass
    shutil.rmtree(folder, ignore_errors=True)
    leave(0)


if __name__ == "__main__":
    main(sys.argv[1])
