"""`python3 -m ferry.bench_xfer` beside `ferry bench xfer` (issue 33): every Python-vs-C++ figure
is a named yardstick that both tools measure the same way (size, provider, operation, window),
in the same run, printed side by side with the ratio. Before, Python's 64 B latency, waited
for in wait_imm, was set against C++'s 8 B one in the workers' callbacks, and its 4 KiB rate
of one write() per write against C++'s batches of 32 to a raw endpoint, while `ferry bench
xfer` printed two 4 KiB rates 4-5x apart."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ferry

YARDSTICKS = ["latency_64B", "rate_4KiB_write", "rate_4KiB_runs32"]


def _ferry_binary() -> str:
    """build/ferry, beside the build tree's python package (build/python/ferry)."""
    p = Path(ferry.__file__).resolve().parents[2] / "ferry"
    if not (p.is_file() and os.access(p, os.X_OK)):
        pytest.skip(f"no ferry binary beside the python package ({p.name} not built)")
    return str(p)


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))


def test_cpp_bench_prints_the_yardsticks_by_name(tmp_path):
    out = tmp_path / "cpp.json"
    r = subprocess.run([_ferry_binary(), "bench", "xfer", "--provider", "tcp",
                        "--yardsticks-only", "--seconds", "0.05", "--latency-iters", "50",
                        "--wait-spin-us", "0", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    j = json.loads(out.read_text())
    assert sorted(j["yardsticks"]) == sorted(YARDSTICKS), j["yardsticks"]
    assert j["latency_us"]["size_bytes"] == 64
    # waited as Python waits: each side's thread in wait_imm, with Python's spin
    assert "each side in wait_imm (spin 0 us)" in j["yardsticks"]["latency_64B"]["what"]
    assert j["yardsticks"]["latency_64B"]["value"] == j["latency_us"]["waited_p50"]
    assert "one write() per write, 64 in flight" in j["yardsticks"]["rate_4KiB_write"]["what"]
    assert "write_runs of 32" in j["yardsticks"]["rate_4KiB_runs32"]["what"]
    for name in YARDSTICKS:
        y = j["yardsticks"][name]
        assert y["value"] > 0 and y["raw"] > 0, (name, y)
        line = next((s for s in r.stdout.splitlines() if s.strip().startswith(name)), None)
        assert line is not None and y["what"] in line, (name, r.stdout)
    # yardsticks only: no bandwidth rows, no rate section
    assert j["rows"] == []


def test_python_bench_divides_each_figure_by_the_same_cpp_operation(tmp_path):
    out = tmp_path / "py.json"
    r = subprocess.run([sys.executable, "-m", "ferry.bench_xfer", "--provider", "tcp",
                        "--ferry", _ferry_binary(), "--seconds", "0.05", "--iters", "50",
                        "--repeat", "1", "--json", str(out)],
                       env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    j = json.loads(out.read_text())
    assert sorted(j["yardsticks"]) == sorted(YARDSTICKS), j["yardsticks"]
    for name in YARDSTICKS:
        y = j["yardsticks"][name]
        assert y["python"] > 0 and y["cpp"] > 0, (name, y)
        assert y["what"] == j["cpp"][name]["what"], (name, y["what"], j["cpp"][name]["what"])
        line = next((s for s in r.stdout.splitlines() if s.startswith(name)), None)
        assert line is not None, (name, r.stdout)
        assert y["what"] in line and f"{y['python']:.1f}" in line and f"{y['cpp']:.1f}" in line
        if name.startswith("latency"):
            assert line.rstrip().endswith(f"{y['python_minus_cpp_us']:+.1f} us"), line
        else:
            assert line.rstrip().endswith(f"{y['python_over_cpp']:.2f}x"), line
