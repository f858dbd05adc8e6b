"""`longstraw bench cp --smoke`: C in {1, 2} as real gloo ranks; each rank holds its slice of the state."""

import json

from longstraw.cli import main


def test_bench_cp_smoke(tmp_path, capsys):
    out = tmp_path / "cp.json"
    assert main(["bench", "cp", "--smoke", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["cp"] for r in rows] == [1, 2] and len(rows[1]["ranks"]) == 2
    one, two = rows
    # 255 encoded positions in 8 capture chunks, split 4 + 4 chunks (128 + 127 positions)
    assert sum(r["prompt_state_bytes"] for r in two["ranks"]) == one["max_state_bytes"]
    assert two["max_state_bytes"] == one["max_state_bytes"] * 128 // 255
    assert all(r["peak_bytes"] > 0 and r["time_s"] > 0 for row in rows for r in row["ranks"])
    assert "C=2" in capsys.readouterr().out
