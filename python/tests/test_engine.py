"""Engine operations between two processes over tcp and shm: bytes checked end to end, every
destination poisoned first so that a byte written where it should not be is seen."""

from __future__ import annotations

import time

import numpy as np
import pytest

import ferry
from conftest import torch_or_skip
from peer import POISON

KINDS = ["numpy", "torch"]


def local_buffer(kind, nbytes, rng=None, fill=None):
    """A local source (random bytes) or destination (filled) of the given kind."""
    if rng is not None:
        data = np.frombuffer(rng.randbytes(nbytes), dtype=np.uint8).copy()
    else:
        data = np.full(nbytes, fill, dtype=np.uint8)
    if kind == "numpy":
        return data, data
    torch = torch_or_skip()
    t = torch.from_numpy(data.view(np.int32).copy())
    return t, t.numpy().view(np.uint8)


def expected_after(nbytes, writes):
    """The destination's bytes after `writes` [(dst_offset, bytes)] landed on poison."""
    out = np.full(nbytes, POISON, dtype=np.uint8)
    for off, data in writes:
        out[off:off + len(data)] = np.frombuffer(data, dtype=np.uint8)
    return out


def check_bytes(got, want):
    got = np.frombuffer(got, dtype=np.uint8)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (f"{bad.size} bytes differ, first at {bad[0]}: got {got[bad[0]]:#x}, "
                           f"want {want[bad[0]]:#x}")


@pytest.mark.parametrize("kind", KINDS)
def test_write_random_sizes(pair, rng, kind):
    engine, peer, child = pair
    dst_size = 1 << 18
    src, src_bytes = local_buffer(kind, dst_size, rng=rng)
    region = engine.register(src)
    dst = ferry.RemoteRegion.from_bytes(child.call("alloc", f"w-{kind}", kind, dst_size, POISON))
    # A local completion frees the source; the bytes are known to be at the target once it
    # counted the writes' immediates, so every write carries one.
    imm = rng.randrange(1 << 32)
    writes, cursor, arrivals = [], 0, 0
    while cursor < dst_size - 64:
        n = rng.randint(1, min(40000, dst_size - cursor))
        so = rng.randrange(0, dst_size - n + 1)
        gap = rng.randint(0, 64)
        if cursor + gap + n > dst_size:
            break
        op = engine.write(peer, region, so, dst, cursor + gap, n, imm=imm)
        op.wait(10.0)
        assert op.done()
        arrivals += op.imm_writes
        writes.append((cursor + gap, src_bytes[so:so + n].tobytes()))
        cursor += gap + n
    child.call("wait_imm", imm, arrivals, 10.0)
    check_bytes(child.call("get", f"w-{kind}"), expected_after(dst_size, writes))


def test_write_with_immediate_counted(pair, rng):
    engine, peer, child = pair
    size = 1 << 20
    src, src_bytes = local_buffer("numpy", size, rng=rng)
    region = engine.register(src)
    desc = child.call("alloc", "imm", "numpy", size, POISON)
    imm = rng.randrange(1 << 32)
    ops = [engine.write(peer, region, i * (size // 8), desc, i * (size // 8), size // 8, imm=imm)
           for i in range(8)]
    for op in ops:
        op.wait(10.0)
    count = sum(op.imm_writes for op in ops)
    assert count >= 8
    child.call("wait_imm", imm, count, 10.0)  # every counted write arrived ...
    check_bytes(child.call("get", "imm"), src_bytes)
    with pytest.raises(RuntimeError, match="TimeoutError"):  # ... and no more than those
        child.call("wait_imm", imm, 1, 0.2)


def test_expectation_polled_at_the_target(pair, rng):
    engine, peer, child = pair
    dst = np.full(4096, POISON, dtype=np.uint8)
    region = engine.register(dst)
    child.call("alloc", "exp-src", "numpy", 4096, 7)
    imm = 0x5EED
    expectation = engine.expect_imm(imm, 2, timeout=10.0)
    assert not expectation.done()
    child.call("write", "parent", "exp-src", 0, region.descriptor, 0, 1024, imm)
    assert not expectation.done() or engine.imm_available(imm) == 0
    child.call("write", "parent", "exp-src", 0, region.descriptor, 2048, 1024, imm)
    expectation.wait(10.0)
    assert expectation.done()
    want = np.full(4096, POISON, dtype=np.uint8)
    want[0:1024] = 7
    want[2048:3072] = 7
    check_bytes(dst.tobytes(), want)


@pytest.mark.parametrize("pages_as", ["list", "numpy", "torch"])
def test_paged_write(pair, rng, pages_as):
    engine, peer, child = pair
    page, src_stride, dst_stride = 4096 + 64, 4096 + 256, 4096 + 64 * 3
    n_src, n_dst = 48, 64
    src, src_bytes = local_buffer("numpy", n_src * src_stride, rng=rng)
    region = engine.register(src)
    dst_size = n_dst * dst_stride
    desc = child.call("alloc", f"paged-{pages_as}", "numpy", dst_size, POISON)
    count = rng.randint(1, n_src)
    src_pages = rng.sample(range(n_src), count)
    dst_pages = rng.sample(range(n_dst), count)
    if pages_as == "numpy":
        sp, dp = np.array(src_pages, dtype=np.int64), np.array(dst_pages, dtype=np.uint32)
    elif pages_as == "torch":
        torch = torch_or_skip()
        sp, dp = torch.tensor(src_pages, dtype=torch.int32), torch.tensor(dst_pages)
    else:
        sp, dp = src_pages, dst_pages
    op = engine.paged_write(peer, region, sp, src_stride, desc, dp, dst_stride, page, imm=3)
    op.wait(10.0)
    child.call("wait_imm", 3, op.imm_writes, 10.0)
    writes = [(d * dst_stride, src_bytes[s * src_stride:s * src_stride + page].tobytes())
              for s, d in zip(src_pages, dst_pages)]
    check_bytes(child.call("get", f"paged-{pages_as}"), expected_after(dst_size, writes))


@pytest.mark.parametrize("kind", KINDS)
def test_write_runs(pair, rng, kind):
    engine, peer, child = pair
    size = 1 << 17
    src, src_bytes = local_buffer(kind, size, rng=rng)
    region = engine.register(src)
    desc = child.call("alloc", f"runs-{kind}", kind, size, POISON)
    runs, cursor = [], 0
    while True:
        n = rng.randint(1, 9000)
        cursor += rng.randint(0, 300)
        if cursor + n > size:
            break
        runs.append((rng.randrange(0, size - n + 1), cursor, n))
        cursor += n
    imm = 11
    op = engine.write_runs(peer, region, desc, runs, imm=imm)
    op.wait(10.0)
    # up to rma_iovs runs (none long enough to be split) to each operation and immediate (on
    # tcp only while the operation stays within 16 KiB)
    assert -(-len(runs) // engine.rma_iovs) <= op.imm_writes <= len(runs), \
        (op.imm_writes, len(runs))
    child.call("wait_imm", imm, op.imm_writes, 10.0)
    writes = [(d, src_bytes[s:s + n].tobytes()) for s, d, n in runs]
    check_bytes(child.call("get", f"runs-{kind}"), expected_after(size, writes))


@pytest.mark.parametrize("kind", KINDS)
def test_read(pair, rng, kind):
    engine, peer, child = pair
    size = 1 << 18
    remote = rng.randbytes(size)
    dst, dst_bytes = local_buffer(kind, size, fill=POISON)  # first: skips where torch is not
    desc = child.call("alloc", f"read-{kind}", kind, size, 0)
    child.call("set", f"read-{kind}", remote)
    region = engine.register(dst)
    n = rng.randint(1, size // 2)
    so, do = rng.randrange(0, size - n + 1), rng.randrange(0, size - n + 1)
    engine.read(peer, region, do, desc, so, n).wait(10.0)
    # (local, remote, length): the offsets in the order of the regions, as read() takes them.
    runs = [(0, size - 100, 50), (size - 10, size - 40, 10)]
    runs = [r for r in runs if r[0] + r[2] <= do or r[0] >= do + n]
    engine.read_runs(peer, region, desc, runs).wait(10.0)
    writes = [(do, remote[so:so + n])] + [(d, remote[s:s + ln]) for d, s, ln in runs]
    check_bytes(dst_bytes.tobytes(), expected_after(size, writes))


def test_descriptor_pickles_and_round_trips(pair):
    import pickle

    engine, peer, child = pair
    desc = child.call("alloc", "pickle", "numpy", 4096, POISON)
    remote = ferry.RemoteRegion.from_bytes(desc)
    again = pickle.loads(pickle.dumps(remote))
    assert again.to_bytes() == desc and again.length == 4096
    src = np.arange(4096, dtype=np.uint8)
    op = engine.write(peer, engine.register(src), 0, again, 0, 4096, imm=21)
    op.wait(10.0)
    child.call("wait_imm", 21, op.imm_writes, 10.0)
    check_bytes(child.call("get", "pickle"), src)


def test_spinning_waits(pair, rng):
    # wait_spin_us: Op.wait, wait_imm and ImmExpectation.wait poll before they sleep. The bytes
    # land as with sleeping waits, and a wait that times out still ends at its timeout.
    engine, _, child = pair
    with ferry.TransferEngine(engine.provider, same_host=True, op_timeout=5.0,
                              wait_spin_us=200) as e:
        assert e.wait_spin_us == 200
        peer = e.connect(child.address)
        child.call("connect", "spinner", e.address)
        size = 1 << 16
        src = np.frombuffer(rng.randbytes(size), dtype=np.uint8).copy()
        desc = child.call("alloc", "spin-dst", "numpy", size, POISON)
        n = rng.randint(1, size)
        # numpy integers and descriptor bytes: the checked path converts them.
        op = e.write(peer, e.register(src), np.uint64(0), desc, np.int64(size - n), n, imm=31)
        op.wait(10.0)
        child.call("wait_imm", 31, op.imm_writes, 10.0)
        check_bytes(child.call("get", "spin-dst"), expected_after(size, [(size - n, src[:n])]))

        dst = np.full(size, POISON, dtype=np.uint8)
        region = e.register(dst)
        child.call("alloc", "spin-src", "numpy", size, 9)
        expectation = e.expect_imm(32, 1, timeout=10.0)
        child.call("write", "spinner", "spin-src", 0, region.descriptor, 0, 100, 32)
        expectation.wait(10.0)
        child.call("write", "spinner", "spin-src", 0, region.descriptor, 200, 100, 33)
        e.wait_imm(33, 1, 10.0)
        check_bytes(dst.tobytes(), expected_after(size, [(0, bytes([9]) * 100),
                                                        (200, bytes([9]) * 100)]))

    with ferry.TransferEngine("tcp", wait_spin_us=1e6) as e:
        start = time.monotonic()
        with pytest.raises(ferry.TimeoutError, match="immediate 0x34"):
            e.wait_imm(0x34, 1, timeout=0.2)
        assert time.monotonic() - start < 0.9, "a spin of 1 s must end at the 0.2 s timeout"


def _us_per_call(fn, calls=300, rounds=5):
    """Best of `rounds` batches: the cost of one call on a quiet moment of a loaded machine."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def test_wait_with_timeout_zero_costs_a_poll():
    """wait(timeout=0) polls once: it took 80 us (KvConnector.wait) and 157 us
    (ImmExpectation.wait, raising its TimeoutError) on the 2-core dev VM, the kernel's timer
    slack of a condition-variable wait whose time is already up, where poll() takes 0.1 us and
    done() 0.05 us. Now 0.6 us and 4 us (the exception)."""
    import ferry.kv as fkv

    lay = fkv.KvLayout(num_layers=2, num_kv_heads=2, head_dim=16, elem_size=2, block_size=16,
                       num_blocks=8)
    with ferry.TransferEngine("tcp", same_host=True) as e:
        with fkv.KvConnector(e, lay, np.zeros(lay.region_bytes // 2, dtype=np.int16)) as c:
            assert c.wait(0) is False
            kv_wait = _us_per_call(lambda: c.wait(0))
        x = e.expect_imm(6, 1, 30)

        def imm_wait():
            with pytest.raises(ferry.TimeoutError):
                x.wait(0)

        imm = _us_per_call(imm_wait, calls=100)
    print(f"KvConnector.wait(0) {kv_wait:.2f} us, ImmExpectation.wait(0) {imm:.2f} us")
    assert kv_wait < 30, f"KvConnector.wait(0) took {kv_wait:.1f} us a call"
    assert imm < 50, f"ImmExpectation.wait(0) took {imm:.1f} us a call"


def test_cma_writes_copy_same_host_writes_and_count_them():
    # Two shm engines of this process with cma_writes: write and write_runs into the other's
    # poisoned region go by process_vm_writev (stats' cma_bytes, nothing through shm), the
    # bytes are there when the immediate is counted; without cma_writes on the target's side
    # its regions offer nothing and the bytes go through shm.
    rng = np.random.default_rng(37)
    size = 1 << 20
    src = rng.integers(0, 256, size, dtype=np.uint8)
    for target_cma in (True, False):
        with ferry.TransferEngine("shm", same_host=True, cma_writes=True) as a, \
                ferry.TransferEngine("shm", same_host=True, cma_writes=target_cma) as b:
            dst = np.full(size, POISON, dtype=np.uint8)
            rs, rd = a.register(src), b.register(dst)
            peer = a.connect(b.address)
            desc = ferry.RemoteRegion.from_bytes(rd.descriptor)
            runs = [(0, 100, 64), (4096, 8192, 4096), (70000, 200000, 65536)]
            a.write(peer, rs, 1000, desc, 500000, 300000, imm=7).wait(10.0)
            op = a.write_runs(peer, rs, desc, runs, imm=7)
            op.wait(10.0)
            b.wait_imm(7, 1 + op.imm_writes, 10.0)
            writes = [(500000, src[1000:301000].tobytes())]
            writes += [(d, src[s:s + n].tobytes()) for s, d, n in runs]
            check_bytes(dst, expected_after(size, writes))
            copied = 300000 + sum(n for _, _, n in runs)
            st = a.stats()
            if target_cma:
                assert st["cma_bytes"] == copied and st["bytes_posted"] == 0
                assert op.imm_writes == 1
            else:
                assert st["cma_bytes"] == 0 and st["bytes_posted"] == copied


def test_cma_writes_stop_at_the_targets_fence():
    # The target's fence stands in for shm's key check: a descriptor with a larger length than
    # the target registered writes nothing past the region (OutOfRange, named), and once the
    # target closed its region the old descriptor writes nothing at all (NotFound), the memory
    # keeping what it held.
    size = 1 << 20
    src = np.full(size + 65536, 0x11, dtype=np.uint8)
    with ferry.TransferEngine("shm", same_host=True, cma_writes=True) as a, \
            ferry.TransferEngine("shm", same_host=True, cma_writes=True) as b:
        dst = np.full(size + 65536, POISON, dtype=np.uint8)
        rs, rd = a.register(src), b.register(dst[:size])
        peer = a.connect(b.address)
        desc = ferry.RemoteRegion.from_bytes(rd.descriptor)
        a.write(peer, rs, 0, desc, 0, 65536).wait(10.0)
        assert a.stats()["cma_bytes"] == 65536
        assert (dst[:65536] == 0x11).all()
        dst[:65536] = POISON
        # The descriptor's length field (after magic u32, version u16, engine_id and base u64).
        raw = bytearray(rd.descriptor)
        assert int.from_bytes(raw[22:30], "little") == size
        raw[22:30] = (size + 65536).to_bytes(8, "little")
        longer = ferry.RemoteRegion.from_bytes(bytes(raw))
        assert longer.length == size + 65536
        with pytest.raises(ferry.OutOfRange, match="outside the region"):
            a.write(peer, rs, 0, longer, size - 8192, 16384).wait(10.0)
        rd.close()
        with pytest.raises(ferry.NotFound, match="deregistered the region"):
            a.write(peer, rs, 0, desc, 0, 65536).wait(10.0)
        assert a.stats()["cma_bytes"] == 65536
        check_bytes(dst, np.full(size + 65536, POISON, dtype=np.uint8))


@pytest.mark.parametrize("provider", ["shm", "tcp"])
def test_rma_iovs_joins_runs_into_fewer_operations(provider):
    # The same random page lists with rma_iovs 1, 2 and 4 (the default): every page lands in
    # the poisoned destination where its id says; single pages with a strided destination
    # (no two adjacent) make ceil(pages / rma_iovs) operations, each one immediate, and a
    # read_runs of 64 B runs reads every run (joined on tcp, one read a run on shm).
    rng = np.random.default_rng(4242)
    page, pages = 4096, 96
    src = rng.integers(0, 256, page * pages, dtype=np.uint8)
    sp = rng.permutation(pages)[:61].astype(np.uint32)
    dp = rng.permutation(pages)[:61].astype(np.uint32)
    for iovs in (1, 2, 4):
        with ferry.TransferEngine(provider, same_host=True, rma_iovs=iovs) as a, \
                ferry.TransferEngine(provider, same_host=True) as b:
            assert a.rma_iovs == iovs and b.rma_iovs == 4
            dst = np.full(2 * page * pages, POISON, dtype=np.uint8)
            rs, rd = a.register(src), b.register(dst)
            peer = a.connect(b.address)
            desc = ferry.RemoteRegion.from_bytes(rd.descriptor)
            op = a.paged_write(peer, rs, sp, page, desc, dp, 2 * page, page, imm=9)
            op.wait(10.0)
            assert op.imm_writes == (len(sp) + iovs - 1) // iovs, (iovs, op.imm_writes)
            b.wait_imm(9, op.imm_writes, 10.0)
            writes = [(int(d) * 2 * page, src[int(s) * page:(int(s) + 1) * page].tobytes())
                      for s, d in zip(sp, dp)]
            check_bytes(dst, expected_after(dst.size, writes))
            back = np.full(64 * len(sp), POISON, dtype=np.uint8)
            rb = a.register(back)
            runs = [(64 * i, int(d) * 2 * page + 64, 64) for i, d in enumerate(dp)]
            before = a.stats()["ops_posted"]
            a.read_runs(peer, rb, desc, runs).wait(10.0)
            # shm copies a one-run read from the initiator (its fast RMA): reads are not joined
            reads = len(runs) if provider == "shm" else (len(runs) + iovs - 1) // iovs
            assert a.stats()["ops_posted"] - before == reads, (iovs, reads)
            want = b"".join(src[int(s) * page + 64:int(s) * page + 128].tobytes() for s in sp)
            check_bytes(back, np.frombuffer(want, dtype=np.uint8))
    # tcp joins runs only while the operation stays within 16 KiB: 8 KiB pages two at a time;
    # shm joins writes with an immediate whatever their size.
    with ferry.TransferEngine(provider, same_host=True) as a, \
            ferry.TransferEngine(provider, same_host=True) as b:
        big = 2 * page
        src8 = rng.integers(0, 256, big * 16, dtype=np.uint8)
        dst8 = np.full(2 * big * 16, POISON, dtype=np.uint8)
        rs, rd = a.register(src8), b.register(dst8)
        peer = a.connect(b.address)
        desc = ferry.RemoteRegion.from_bytes(rd.descriptor)
        pages8 = list(range(0, 16, 2)) + list(range(1, 16, 2))  # no two adjacent in a row
        op = a.paged_write(peer, rs, pages8, big, desc, pages8, 2 * big, big, imm=5)
        op.wait(10.0)
        per_op = 2 if provider == "tcp" else 4
        assert op.imm_writes == -(-len(pages8) // per_op), op.imm_writes
        b.wait_imm(5, op.imm_writes, 10.0)
        writes = [(p * 2 * big, src8[p * big:(p + 1) * big].tobytes()) for p in pages8]
        check_bytes(dst8, expected_after(dst8.size, writes))
    with pytest.raises(ferry.InvalidArgument, match=r"rma_iovs must be in \[1, 65536\], got 0"):
        ferry.TransferEngine("tcp", rma_iovs=0)
