"""`psarch report NAME SWEEP` stops in one line, naming the folder, where it is no folder or holds no run the
table is made of, and writes nothing there."""
from __future__ import annotations

import pytest

from psarch.cli import main


@pytest.mark.parametrize("name, missing", [("cluster", "no run of an emulated cluster"),
                                           ("crossover", "no run of an emulated cluster"),
                                           ("stragglers", "no finished run with an entropy floor")])
def test_a_report_names_the_folder_it_cannot_use(tmp_path, name, missing):
    with pytest.raises(SystemExit, match=f"{tmp_path / 'nowhere'}: not a folder"):
        main(["report", name, str(tmp_path / "nowhere")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match=missing):
        main(["report", name, str(tmp_path / "empty")])
    assert not list((tmp_path / "empty").iterdir())
