"""bench/gpu_decode.py's logic on the CPU (``--dry-run``: tiny models, the graph stand-in), so the device call that
runs it (bench/gpu.sh) spends its minutes on figures, not on the script's mistakes."""

from __future__ import annotations

import json

from bench import gpu_decode


def test_the_dry_run_writes_its_rows(tmp_path, capsys):
    assert gpu_decode.main(["--dry-run", "--sections", "decode,launches", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "gpu_decode.json").read_text())
    assert summary["failures"] == []
    decode = [r for r in summary["rows"] if r["section"] == "decode"]
    assert [r["dtype"] for r in decode] == ["bfloat16", "float32"]
    assert all(r["same_tokens"] and r["replays"] > 0 and not r["graphs_off"] for r in decode)
    assert all(r["unfused_tps"] > 0 and r["fused_speedup"] > 0 for r in decode)  # (the CPU's eager path: native)
    launches = {(r["step"], r["path"]): r for r in summary["rows"] if r["section"] == "launches"}
    assert launches[("plain", "eager")]["in_graph"] == 0 < launches[("plain", "graphs")]["in_graph"]
    assert launches[("plain", "eager_unfused")]["in_graph"] == 0
    assert "gpu_decode summary" in capsys.readouterr().out


def test_a_section_past_the_deadline_is_skipped(tmp_path):
    assert gpu_decode.main(["--dry-run", "--sections", "speedup", "--deadline-s", "0", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "gpu_decode.json").read_text())["rows"] == [{"section": "speedup", "skipped": True}]
