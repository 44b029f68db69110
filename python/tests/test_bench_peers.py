"""python3 -m ferry.bench_peers: every adapter that runs here moves the bytes it is asked to
(and nothing else), and bad flags are refused with a message naming the flag.

The peers (NIXL, Mooncake) are tested where they are installed (build/peers-venv, made by
scripts/peers_venv.sh); elsewhere their tests are skipped with the reason."""

from __future__ import annotations

import time

import numpy as np
import pytest

from ferry import bench_peers as bp

POISON = 0xA5


def _config_or_skip(config: str) -> str:
    if config in bp.CUDA_CONFIGS:
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip(f"{config}: no CUDA device here (scripts/gpu_check.sh runs it)")
    lib = bp.CONFIGS[config][0]
    if lib != "ferry":
        why = bp.peer_status(lib)
        if why:
            pytest.skip(why)
    return config


@pytest.fixture(scope="module", params=["ferry-tcp", "ferry-shm", "ferry-shm-cma",
                                        "ferry-shm-cma-wait", "ferry-shm-rails4",
                                        "ferry-tcp-rails4", "nixl-ucx-sm", "nixl-ucx-tcp",
                                        "mooncake-tcp", "ferry-cuda", "nixl-ucx-cuda"])
def pair(request):
    p = bp.Pair(_config_or_skip(request.param))
    yield p
    p.close()


def _runs(rng: np.random.Generator, nbytes: int, n: int, length: int, align: int):
    """n disjoint runs of `length` bytes at random `align`-aligned offsets on both sides."""
    slots = nbytes // max(length, align)
    src = rng.choice(slots, n, replace=False).astype(np.uint64) * np.uint64(max(length, align))
    dst = rng.choice(slots, n, replace=False).astype(np.uint64) * np.uint64(max(length, align))
    return src, dst, np.full(n, length, dtype=np.uint64)


@pytest.mark.parametrize("block_bytes,n,length", [(0, 1, 100000), (0, 37, 4096),
                                                  (0, 200, 64), (4096, 300, 4096)])
def test_bytes_arrive_intact_and_nothing_else_changes(pair, block_bytes, n, length):
    nbytes = 4 << 20
    pair.setup(nbytes, block_bytes)
    rng = np.random.default_rng(n * 7 + length)
    src, dst, lengths = _runs(rng, nbytes, n, length, block_bytes or 64)
    before = np.frombuffer(pair.call(1, "read", 0, nbytes), dtype=np.uint8).copy()
    if block_bytes:  # the KV shape's call: block numbers
        bb = np.uint64(block_bytes)
        pair.call(0, "write_runs", src // bb, dst // bb, None, block_bytes)
    else:
        pair.call(0, "write_runs", src, dst, lengths)
    source = np.frombuffer(pair.call(0, "read", 0, nbytes), dtype=np.uint8)
    expected = before.copy()
    for s, d in zip(src.tolist(), dst.tolist()):
        expected[d:d + length] = source[s:s + length]
    # A completed ferry write is one the provider sent (tcp's writes of <= 64 B: injected);
    # its bytes are known to be at the target only once the target counts an immediate, which
    # these writes do not carry: they are given 10 s to land.
    deadline = time.monotonic() + 10
    while True:
        after = np.frombuffer(pair.call(1, "read", 0, nbytes), dtype=np.uint8)
        if np.array_equal(after, expected) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert np.array_equal(after, expected), f"{pair.config}: destination differs"
    # The source pattern differs from the poison, so a run that did not move shows.
    assert all(not np.all(source[s:s + length] == POISON) for s in src.tolist())


def _wait_stopped(pid: int, budget: float = 10.0) -> None:
    """Waits until every thread of `pid` is stopped (state T in /proc), at most `budget` s."""
    import os

    deadline = time.monotonic() + budget
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                continue
        if states and all(s in ("T", "t") for s in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within {budget} s")


@pytest.mark.parametrize("config", ["ferry-tcp", "ferry-shm"])
def test_ferry_transfer_ends_at_the_target_answer(config):
    """ferry's clock stops where Mooncake's does: at the target's confirmation, not at the
    initiator's local completion (on tcp, a small write completes once the provider took it).
    With the target process stopped, no ferry transfer completes; resumed, the bytes are there
    the moment the next one does."""
    import os
    import signal

    p = bp.Pair(config)
    try:
        p.setup(1 << 20)
        one = np.array([64], dtype=np.uint64)
        at = np.array([4096], dtype=np.uint64)
        os.kill(p.procs[1].pid, signal.SIGSTOP)
        try:
            # kill() returns before every thread of the target stopped: a rail worker still
            # running answered the write within the 1.5 s once (a CI run, shm).
            _wait_stopped(p.procs[1].pid)
            with pytest.raises(bp.PairError, match="TimeoutError"):
                p.call(0, "write_runs", np.zeros(1, dtype=np.uint64), at, one, 0, 1.5)
        finally:
            os.kill(p.procs[1].pid, signal.SIGCONT)
        time.sleep(0.5)  # the late answer to the timed-out transfer comes in
        p.close()
        p = bp.Pair(config)  # a fresh pair: that answer would end the next wait early
        p.setup(1 << 20)
        src, dst, lengths = _runs(np.random.default_rng(5), 1 << 20, 40, 64, 4096)
        source = np.frombuffer(p.call(0, "read", 0, 1 << 20), dtype=np.uint8)
        p.call(0, "write_runs", src, dst, lengths)
        after = np.frombuffer(p.call(1, "read", 0, 1 << 20), dtype=np.uint8)  # no grace
        for s, d in zip(src.tolist(), dst.tolist()):
            assert np.array_equal(after[d:d + 64], source[s:s + 64]), f"{config}: not landed"
    finally:
        p.close()


def test_answer_counts_refuses_slots_outside_its_box():
    import ferry

    with ferry.TransferEngine("tcp") as e:
        box = np.zeros(4, dtype=np.uint64)
        r = e.register(box)
        peer = e.connect(e.address)
        for slots in (0, 5):
            with pytest.raises(ferry.InvalidArgument, match=f"{slots} slots of 8 bytes do not "
                               "fit the 32-byte box"):
                e.answer_counts(1, 2, 3, peer, r, slots)
        r.close()


def test_each_pattern_measures(pair):
    """One quick measurement of every pattern gives finite, positive figures."""
    pair.setup(8 << 20)
    assert pair.call(0, "bw", 1 << 20, 3) > 0
    if pair.config not in bp.CUDA_CONFIGS:  # GPU buffers: bw and kv only
        pair.both(("arm", 64), ("arm", 64))
        us, _ = pair.both(("pingpong", 64, 30, True), ("pingpong", 64, 30, False))
        assert len(us) == 30 and min(us) > 0
        assert pair.call(0, "rate", 4096, 4, 0.05) > 0
    pair.setup(2 * 2 * 40 * 4096, 4096)
    prep, posted, xfer = pair.call(0, "kv", 2, 32, 40, 4096, 1)
    assert 0 < prep <= posted and xfer > 0


@pytest.mark.parametrize("argv,words", [
    (["--rounds", "0"], ["--rounds", "must be in [1, 1000]"]),
    (["--peers", "nixl,foo"], ["--peers", "unknown peer 'foo'", "nixl, mooncake, uccl"]),
    (["--transports", "rdma"], ["--transports", "unknown transport 'rdma'", "shm, tcp"]),
    (["--patterns", ""], ["--patterns", "(none given)"]),
    (["--sizes", "64q"], ["--sizes", "a size such as 64k or 16m"]),
    (["--sizes", "2048m"], ["--sizes", "[1 B, 1 GiB]"]),
    (["--seconds", "nan"], ["--seconds", "number of seconds"]),
    (["--iters", "5"], ["--iters", "must be in [20,"]),
    (["--kv-blocks", "32"], ["--kv-blocks", "unknown block size '32'"]),
    (["--json", "/nonexistent-folder/x.json"], ["--json", "does not exist"]),
    (["--from-json", "/nonexistent-folder/x.json"], ["--from-json", "no file"]),
])
def test_bad_flags_are_refused_with_their_name(capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        bp.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, err


def test_a_missing_peer_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(bp.PEERS, "nixl", ("no_such_module_ferry_test", "pip install nixl"))
    assert bp.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "nixl: not installed (pip install nixl; or bash scripts/peers_venv.sh" in out


def test_a_saved_report_prints_as_markdown(tmp_path, capsys):
    row = {"point": "write 64 KiB", "figure": "GB/s", "ferry": "ferry-tcp", "ferry_median": 2.0,
           "peer": "mooncake-tcp", "peer_median": 1.0, "ratio_median": 2.0, "ratio_q1": 1.5,
           "ratio_q3": 2.5}
    f = tmp_path / "r.json"
    f.write_text(__import__("json").dumps({"rows": [row], "skipped": {}, "rounds": 1}))
    assert bp.main(["--from-json", str(f), "--markdown"]) == 0
    assert "| write 64 KiB | GB/s | ferry-tcp | 2 | mooncake-tcp | 1 | 2.00x [1.50, 2.50] |" in (
        capsys.readouterr().out)
