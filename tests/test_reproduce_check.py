"""experiments/reproduce/check.py compares the machine-independent cells of two compare reports: a committed report
agrees with itself, and a changed byte count, memory figure or synchronous loss is found, while an asynchronous
run's loss and any time are not compared."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "experiments"
spec = importlib.util.spec_from_file_location("reproduce_check", ROOT / "reproduce" / "check.py")
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)
COMMITTED = ROOT / "architectures" / "results" / "report.md"


def test_a_committed_report_agrees_with_itself_in_every_machine_independent_cell():
    same, total = check.compare(COMMITTED, COMMITTED)
    rows = check.table(COMMITTED)
    assert same == total and len(rows) == 9
    assert total == 9 * 3 + 7          # 3 byte/memory columns for every run, the loss of the 7 synchronous ones


def test_a_changed_cell_is_found_and_times_and_async_losses_are_not_compared(tmp_path, capsys):
    text = COMMITTED.read_text()
    rows = check.table(COMMITTED)
    sent = next(c for c in rows["ps-modesync"] if c.startswith("sent/worker/step"))
    changed = text.replace(rows["ps-modesync"][sent], "431.09 KiB \\| 431.00 KiB", 1)
    changed = changed.replace(rows["zero-stage3"]["step time (ms)"], "1.00", 1)
    changed = changed.replace(rows["ps-modeasync"]["final loss"], "9.9999", 1)
    (tmp_path / "report.md").write_text(changed)
    same, total = check.compare(COMMITTED, tmp_path / "report.md")
    assert total - same == 1
    assert "DIFFERS  ps-modesync" in capsys.readouterr().out
