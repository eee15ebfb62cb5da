import json

import pytest

from foresight.runtime import atomic


def test_a_write_that_fails_midway_leaves_the_old_file_and_no_leftover(tmp_path):
    f = tmp_path / "sub" / "meta.json"
    atomic.write_json(f, {"v": 1})

    def torn(tmp):
        with open(tmp, "w") as h:
            h.write('{"v": 2, "trunc')
        raise KeyboardInterrupt  # killed halfway through the write

    with pytest.raises(KeyboardInterrupt):
        atomic.replace(f, torn)
    assert json.loads(f.read_text()) == {"v": 1}
    assert sorted(p.name for p in f.parent.iterdir()) == ["meta.json"]
    atomic.write_text(f, "new")
    assert f.read_text() == "new" and sorted(p.name for p in f.parent.iterdir()) == ["meta.json"]
