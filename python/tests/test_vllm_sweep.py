"""scripts/vllm_sweep.py without vLLM: its flags, its plan (the same prompts and arrivals for
every mode of a point), its statistics, the output check and the tables it writes. The sweep
itself starts vLLM engines for many minutes and is not run here (docs/BENCHMARKS.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import xml.etree.ElementTree as ET

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.fixture(scope="module")
def vs():
    spec = importlib.util.spec_from_file_location(
        "vllm_sweep", os.path.join(ROOT, "scripts", "vllm_sweep.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_defaults_are_the_issues_sweep(vs):
    a = vs.parse_args([])
    assert a.qps == [1, 2, 4, 8] and a.inputs == [1024, 4096, 8192] and a.output == 64
    assert {m for phase in a.phases for m in phase} == set(vs.MODES)
    q = vs.parse_args(["--quick"])
    assert q.inputs == [1024] and len(q.qps) == 2 and q.max_requests <= 8


@pytest.mark.parametrize("argv, says", [
    (["--phases", "ferry-push,nixl-pul"], "unknown mode(s) nixl-pul"),
    (["--phases", "ferry-push,ferry-push"], "a mode twice"),
    (["--qps", "1,zero"], "not a comma-separated list"),
    (["--qps", "0"], "positive"),
    (["--inputs", "16384"], "exceeds the tiny model's 16384 positions"),
    (["--min-requests", "5", "--max-requests", "4"], "--min-requests <= --max-requests"),
])
def test_bad_flags_are_refused_naming_the_problem(vs, capsys, argv, says):
    with pytest.raises(SystemExit):
        vs.parse_args(argv)
    assert says in capsys.readouterr().err


def test_every_mode_of_a_point_gets_the_same_requests(vs):
    a = vs.parse_args(["--qps", "1,8", "--inputs", "1024,4096", "--duration", "4",
                       "--min-requests", "4", "--max-requests", "16"])
    plan = vs.point_plan(a)
    assert [(p[0], p[1], p[2]) for p in plan] == [(1024, 1, 4), (1024, 8, 16), (4096, 1, 4),
                                                  (4096, 8, 16)]
    # A point's seed does not depend on the other points: --quick's 1024-token points send
    # the full sweep's prompts.
    quick = {(p[0], p[1]): p[3] for p in vs.point_plan(vs.parse_args(["--quick"]))}
    full = {(p[0], p[1]): p[3] for p in vs.point_plan(vs.parse_args([]))}
    assert quick[(1024, 8.0)] == full[(1024, 8.0)]
    offsets = vs.arrivals(8.0, 2000, random.Random(1))
    assert offsets[0] == 0 and all(b >= a for a, b in zip(offsets, offsets[1:]))
    assert abs(offsets[-1] / 1999 - 1 / 8.0) < 0.02  # mean gap 1/QPS
    # Modes rotate from point to point, so none always runs first.
    assert [vs.rotated(["a", "b", "c"], k)[0] for k in range(3)] == ["a", "b", "c"]


def test_statistics(vs):
    assert vs.percentile(range(1, 101), 50) == pytest.approx(50.5)
    assert vs.percentile(range(1, 101), 99) == pytest.approx(99.01)
    assert vs.percentile([], 50) is None
    s = vs.summarize_samples([{"ttft_s": 0.1, "tpot_s": 0.01}, {"ttft_s": 0.3, "tpot_s": 0.03},
                              {"error": "HTTP 500", "tokens": None}])
    assert s["n"] == 3 and s["failed"] == 1
    assert s["ttft_p50_ms"] == pytest.approx(200) and s["tpot_p50_ms"] == pytest.approx(20)


def _runs():
    def run(phase, mode, tokens, ttft):
        return {"phase": phase, "mode": mode, "input": 1024, "qps": 8.0, "wall_s": 1.0,
                "decode_local_tokens": None if mode == "baseline" else 1.0,
                "decode_transferred_tokens": None if mode == "baseline" else 1023.0,
                "samples": [{"ttft_s": ttft, "tpot_s": 0.02, "tokens": tokens}]}
    return [run("A", "baseline", [1, 2, 3], 0.1), run("A", "ferry-push", [1, 2, 3], 0.2),
            run("A", "nixl-push", [1, 2, 3], 0.4), run("B", "ferry-push", [1, 2, 3], 0.2),
            run("B", "nixl-pull", [1, 2, 3], 0.5)]


def test_outputs_are_checked_against_the_baseline(vs):
    runs = _runs()
    assert vs.check_outputs(runs) == []
    runs[4]["samples"][0]["tokens"] = [1, 2, 4]
    problems = vs.check_outputs(runs)
    assert len(problems) == 1 and "phase B nixl-pull" in problems[0] \
        and "from baseline's from token 2" in problems[0]


def test_tables_plot_and_from_json(vs, tmp_path):
    runs = _runs()
    rows = vs.summarize(runs)
    text = vs.markdown(rows, [])
    # ferry push's TTFT over NixlPushConnector's (phase A) and NixlConnector's (phase B).
    assert "ferry push / NixlPushConnector TTFT, TPOT" in text and "| 0.50, 1.00 |" in text
    assert "ferry push / NixlConnector TTFT, TPOT" in text and "| 0.40, 1.00 |" in text
    assert "identical across modes" in text
    ET.fromstring(vs.svg(rows, "t"))  # well-formed
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"summary": rows, "mismatches": ["x"], "runs": runs}))
    md = tmp_path / "r.md"
    assert vs.main(["--from-json", str(path), "--markdown", str(md)]) == 1  # a mismatch
    assert "1 mismatches: x" in md.read_text()
