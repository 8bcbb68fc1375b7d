"""`python -m benchmarks.server` at tiny size against the live server, so the benchmark cannot rot."""

from __future__ import annotations

import json

from benchmarks.server import main


def test_benchmark_server_reports_every_figure(server, tmp_path, capsys):
    out = tmp_path / "server.json"
    assert main(["--url", server.base_url, "--streams", "3", "--tokens", "5", "--prompt", "6",
                 "--rounds", "2", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert (rep["streams"], rep["tokens"], rep["prompt"]) == (3, 5, 6) and len(rep["rounds"]) == 2
    for r in rep["rounds"]:
        assert r["tokens"] == 15                       # ignore_eos: every stream gets all 5 tokens
        assert r["tok_s"] == r["tokens"] / r["wall_s"] > 0
        assert 0 < r["ttft_ms_p50"] < 1000 * r["wall_s"] and r["tpot_ms_p50"] > 0
        assert r["client_cpu_us_per_token"] > 0
    assert rep["best_tok_s"] == max(r["tok_s"] for r in rep["rounds"])
    assert not any("llama" in key for key in rep)    # the peer ratio is benchmarks.peer's, measured in its run
    printed = capsys.readouterr().out
    assert f"best {rep['best_tok_s']:.1f} tok/s" in printed and "client CPU" in printed
    assert "python -m benchmarks.peer" in printed
