"""Mistakes a Python user makes: each one an exception whose type and message name it."""

from __future__ import annotations

import time

import numpy as np
import pytest

import ferry
from conftest import PROVIDERS, torch_or_skip
from peer import POISON, PeerProcess


@pytest.fixture(scope="module")
def engine():
    e = ferry.TransferEngine("tcp", op_timeout=2.0, idle_spin_us=50)
    yield e
    e.close()


def test_random_bytes_as_descriptor(rng):
    blob = rng.randbytes(rng.randint(1, 200))
    with pytest.raises(ferry.Error, match="descriptor"):
        ferry.RemoteRegion.from_bytes(blob)


def test_truncated_descriptor(engine):
    desc = engine.register(bytearray(4096)).descriptor
    for cut in (1, len(desc) // 2, len(desc) - 1):
        with pytest.raises(ferry.ProtocolError, match="bad region descriptor.*truncated"):
            ferry.RemoteRegion.from_bytes(desc[:cut])


def test_descriptor_of_the_wrong_type(engine):
    src = engine.register(bytearray(64))
    with pytest.raises(ferry.InvalidArgument, match="dst must be a RemoteRegion"):
        engine.write(0, src, 0, "not a descriptor", 0, 8)


def test_bad_address(engine, rng):
    with pytest.raises(ferry.Error, match="bad engine address"):
        engine.connect(rng.randbytes(40))


def test_non_contiguous_array(engine):
    a = np.zeros((64, 64), dtype=np.float32)[:, ::2]
    with pytest.raises(ferry.InvalidArgument, match="non-contiguous ndarray"):
        engine.register(a)


def test_non_contiguous_tensor(engine):
    torch = torch_or_skip()
    t = torch.zeros(32, 16, dtype=torch.float16).t()
    with pytest.raises(ferry.InvalidArgument, match=r"non-contiguous tensor.*t\.contiguous\(\)"):
        engine.register(t)


def test_read_only_buffers(engine):
    with pytest.raises(ferry.InvalidArgument, match="read-only bytes"):
        engine.register(b"constant")
    a = np.zeros(128, dtype=np.uint8)
    a.flags.writeable = False
    with pytest.raises(ferry.InvalidArgument, match="read-only ndarray"):
        engine.register(a)
    # Allowed as a source only: it has no descriptor and nothing is read into it.
    r = engine.register(a, read_only=True)
    with pytest.raises(ferry.InvalidArgument, match="read-only region has no descriptor"):
        r.descriptor
    other = engine.register(bytearray(128))
    with pytest.raises(ferry.InvalidArgument, match="read into a read-only region"):
        engine.read(0, r, 0, other.descriptor, 0, 8)


def test_not_a_buffer(engine):
    with pytest.raises(ferry.InvalidArgument, match="cannot register a dict"):
        engine.register({})
    with pytest.raises(ferry.InvalidArgument, match=r"\(ptr, nbytes, device\) tuple"):
        engine.register((1, 2))
    with pytest.raises(ferry.InvalidArgument, match="cannot register 0 bytes"):
        engine.register(bytearray())


def test_wrong_dtype_for_pages(engine):
    src = engine.register(bytearray(1 << 16))
    dst = engine.register(bytearray(1 << 16)).descriptor
    with pytest.raises(ferry.InvalidArgument, match="src_pages: .*must be integers.*float"):
        engine.paged_write(0, src, np.array([0.0, 1.0]), 4096, dst, [0, 1], 4096, 4096)
    torch = torch_or_skip()
    with pytest.raises(ferry.InvalidArgument, match="dst_pages: .*integers.*torch.float32"):
        engine.paged_write(0, src, [0, 1], 4096, dst, torch.tensor([0.0, 1.0]), 4096, 4096)
    with pytest.raises(ferry.InvalidArgument, match="dst_pages: .*in \\[0"):
        engine.paged_write(0, src, [0], 4096, dst, [-1], 4096, 4096)


@pytest.mark.parametrize("remote", [False, True], ids=["descriptor", "RemoteRegion"])
def test_negative_offset_and_bad_imm(engine, remote):
    # With a RemoteRegion, write() hands its arguments to the binding unchecked and checks them
    # only when the binding refuses one: the error must name the argument all the same.
    src = engine.register(bytearray(64))
    dst = ferry.RemoteRegion.from_bytes(src.descriptor) if remote else src.descriptor
    with pytest.raises(ferry.InvalidArgument, match="peer must be in"):
        engine.write(1 << 40, src, 0, dst, 0, 8)
    with pytest.raises(ferry.InvalidArgument, match="src_offset must be in"):
        engine.write(0, src, -1, dst, 0, 8)
    with pytest.raises(ferry.InvalidArgument, match="imm must be in"):
        engine.write(0, src, 0, dst, 0, 8, imm=1 << 32)
    with pytest.raises(ferry.InvalidArgument, match="nbytes must be an integer"):
        engine.write(0, src, 0, dst, 0, 8.5)


def test_unknown_peer(engine):
    src = engine.register(bytearray(64))
    with pytest.raises(ferry.Error, match="peer"):
        engine.write(12345, src, 0, src.descriptor, 0, 8).wait(5.0)


def test_cuda_memory_without_gpu(engine):
    if ferry.gpu_device_count() > 0:
        pytest.skip("a GPU is visible: GPU registration is tested in test_gpu.py")
    with pytest.raises(ferry.Error, match="(?i)gpu|cuda"):
        engine.register((0x10000, 4096, "cuda:0"))


@pytest.mark.parametrize("provider", PROVIDERS)
def test_region_too_small(provider, rng):
    child = PeerProcess(provider)
    try:
        with ferry.TransferEngine(provider, same_host=True, op_timeout=2.0) as e:
            peer = e.connect(child.address)
            desc = child.call("alloc", "small", "numpy", 4096, POISON)
            src = e.register(np.zeros(8192, dtype=np.uint8))
            off = rng.randint(1, 4096)
            with pytest.raises(ferry.OutOfRange, match="overrun the remote region of 4096 bytes"):
                e.write(peer, src, 0, desc, off, 4097 - off).wait(5.0)
            with pytest.raises(ferry.OutOfRange, match="local|source|region"):
                e.write(peer, src, 8000, desc, 0, 1000).wait(5.0)
            with pytest.raises(ferry.OutOfRange):
                e.read(peer, src, 0, desc, 4000, 200).wait(5.0)
            # Nothing reached the peer.
            assert child.call("get", "small") == bytes([POISON]) * 4096
    finally:
        child.close()


@pytest.mark.parametrize("provider", PROVIDERS)
def test_dead_peer_fails_within_op_timeout(provider):
    child = PeerProcess(provider)
    op_timeout = 2.0
    try:
        with ferry.TransferEngine(provider, same_host=True, op_timeout=op_timeout) as e:
            peer = e.connect(child.address)
            desc = child.call("alloc", "victim", "numpy", 1 << 20, POISON)
            src = e.register(np.ones(1 << 20, dtype=np.uint8))
            e.write(peer, src, 0, desc, 0, 4096).wait(5.0)  # alive: works
            child.kill()
            start = time.monotonic()
            with pytest.raises(ferry.Error) as info:
                for _ in range(50):  # a write may still be accepted right after the kill
                    e.write(peer, src, 0, desc, 0, 1 << 20, imm=1).wait(op_timeout + 3.0)
            elapsed = time.monotonic() - start
            print(f"{provider}: dead peer reported after {elapsed:.2f} s: "
                  f"{type(info.value).__name__}: {info.value}")
            assert elapsed < op_timeout + 3.0
            assert not isinstance(info.value, ferry.InvalidArgument), str(info.value)
    finally:
        child.close()


def test_wait_imm_timeout_names_the_immediate(engine):
    start = time.monotonic()
    with pytest.raises(ferry.TimeoutError, match="immediate 0x77"):
        engine.wait_imm(0x77, 1, timeout=0.2)
    assert time.monotonic() - start < 2.0
    with pytest.raises(TimeoutError):  # the builtin catches it too
        engine.expect_imm(0x78, 1, timeout=5.0).wait(0.1)


def test_bad_wait_spin_us():
    for bad in (-1, -0.5, float("nan"), float("inf"), 2e6):
        with pytest.raises(ferry.InvalidArgument,
                           match=r"wait_spin_us must be a number of microseconds in \[0, 1000000\]"):
            ferry.TransferEngine("tcp", wait_spin_us=bad)
    for bad in ("50", [50], True):
        with pytest.raises(ferry.InvalidArgument,
                           match="wait_spin_us must be a number of microseconds or None"):
            ferry.TransferEngine("tcp", wait_spin_us=bad)


def test_wait_spin_us_default_follows_the_cpus():
    import os

    with ferry.TransferEngine("tcp") as e:
        assert e.wait_spin_us == (50.0 if len(os.sched_getaffinity(0)) >= 8 else 0.0)
    with ferry.TransferEngine("tcp", wait_spin_us=0) as e:
        assert e.wait_spin_us == 0.0


def test_fast_write_refuses_other_types(engine):
    # The extension's write takes exact types only and says so; TransferEngine.write then
    # checks and names the argument (test_negative_offset_and_bad_imm).
    src = engine.register(bytearray(64))
    dst = ferry.RemoteRegion.from_bytes(src.descriptor)
    with pytest.raises(TypeError, match="takes ints, a Region, a RemoteRegion"):
        engine._engine.write(0, src, 0, dst.to_bytes(), 0, 8, None)
    with pytest.raises(TypeError, match="takes ints"):
        engine._engine.write(0, src, 0, dst)
    with pytest.raises(ferry.InvalidArgument, match="src must be a Region"):
        engine.write(0, dst, 0, dst, 0, 8)


def test_closed_engine():
    e = ferry.TransferEngine("tcp")
    src = e.register(bytearray(64))
    dst = ferry.RemoteRegion.from_bytes(src.descriptor)
    e.close()
    with pytest.raises(ferry.Cancelled, match="engine is closed"):
        e.write(0, src, 0, dst, 0, 8, imm=1)  # the fast path's error, translated
    with pytest.raises(ferry.Cancelled, match="engine is closed"):
        e.address


@pytest.mark.parametrize("cls, says", [
    (ferry.Region, "TransferEngine.register"),
    (ferry.Op, "every transfer call of a TransferEngine"),
    (ferry.ImmExpectation, "TransferEngine.expect_imm"),
    (ferry.RemoteRegion, "RemoteRegion.from_bytes"),
    (ferry.kv.KvEvent, "KvConnector.poll()"),
    (ferry.kv.HandshakeInfo, "HandshakeInfo.from_bytes"),
])
def test_objects_handed_out_by_calls_say_where_they_come_from(cls, says):
    # Constructed directly, pybind11 alone said "No constructor defined!".
    for args, kwargs in [((), {}), ((1, 2), {}), ((), {"nbytes": 4})]:
        with pytest.raises(TypeError) as e:
            cls(*args, **kwargs)
        assert "cannot be created directly" in str(e.value)
        assert says in str(e.value)
        assert "No constructor" not in str(e.value)


@pytest.mark.parametrize("name", ["nosuch", "verbs;no_such_util"])
def test_unknown_provider_lists_the_available_ones(name):
    """A provider that is not here: the error listed none ("provider 'nosuch' is not available
    here: No data available"); now the ones that are, by the names TransferEngine takes."""
    with pytest.raises(ferry.Unavailable) as e:
        ferry.TransferEngine(name)
    msg = str(e.value)
    assert "; available here: " in msg and msg.endswith(" (or auto)"), msg
    listed = msg.split("; available here: ", 1)[1][:-len(" (or auto)")].split(", ")
    for present in PROVIDERS:  # the test machine's providers (tcp, shm)
        assert present in listed, msg
    assert len(listed) == len(set(listed)), msg
