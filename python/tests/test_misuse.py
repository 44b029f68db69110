"""What a new user does by mistake with objects' lifetimes and with inputs that look right:
calls on closed objects, close() twice, Ctrl-C during a long wait, one tensor repeated for
every layer, numpy object arrays, option values that are truthy strings. Each must raise a
ferry.Error naming the argument or the object (or KeyboardInterrupt within a moment), never
return as if nothing happened, hang, crash, or leave a registration or a thread behind."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest

import ferry
import ferry.kv as fkv
from conftest import torch_or_skip


def _layout(**kw):
    args = dict(num_layers=3, num_kv_heads=2, head_dim=8, elem_size=2, block_size=4,
                num_blocks=8)
    args.update(kw)
    return fkv.KvLayout(**args)


def _run(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=timeout)


# --- closed objects ------------------------------------------------------------------------

def test_closed_kv_connector_every_call_raises():
    """poll() and wait() on a closed connector returned [] and False as if it were idle: an
    engine loop polling it never learnt that it was closed."""
    layout = _layout(regions="per-layer")
    engine = ferry.TransferEngine("tcp")
    pool = [np.zeros(layout.region_bytes // 2, dtype=np.int16) for _ in range(3)]
    with fkv.KvConnector(engine, layout, pool) as conn:
        assert conn.poll() == [] and conn.wait(0) is False
    conn.close()  # twice: nothing
    addr = [engine.address]
    calls = {
        "poll": lambda: conn.poll(),
        "wait": lambda: conn.wait(0.5),
        "announce": lambda: conn.announce(1, 0, addr),
        "register_push": lambda: conn.register_push(1, 0, addr, [0], 4),
        "cancel": lambda: conn.cancel(1),
        "prefill_scheduled": lambda: conn.prefill_scheduled(1),
        "prefill_progress": lambda: conn.prefill_progress(1, [0], 4),
        "prefill_done": lambda: conn.prefill_done(1, [0], 4),
        "prefill_failed": lambda: conn.prefill_failed(1, "x"),
        "abort_send": lambda: conn.abort_send(1, "x"),
        "offer_pull": lambda: conn.offer_pull(1, [0], 4),
        "handshake_info": lambda: conn.handshake_info(),
        "stats": lambda: conn.stats(),
    }
    for name, call in calls.items():
        t0 = time.monotonic()
        with pytest.raises(ferry.Cancelled, match=r"KV connector is closed"):
            call()
        assert time.monotonic() - t0 < 0.4, name  # wait(0.5) raises at once, not at its end
    assert engine.stats()["regions_registered"] == 0
    engine.close()


def test_kv_connector_close_ends_a_wait_on_another_thread():
    layout = _layout()
    engine = ferry.TransferEngine("tcp")
    conn = fkv.KvConnector(engine, layout, np.zeros(layout.region_bytes // 2, dtype=np.int16))
    got = []

    def waiter():
        t0 = time.monotonic()
        try:
            conn.wait(30.0)
            got.append("returned")
        except ferry.Cancelled as e:
            got.append(str(e))
        got.append(time.monotonic() - t0)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.2)
    conn.close()
    t.join(10)
    assert not t.is_alive()
    assert "KV connector is closed" in got[0] and got[1] < 5.0, got
    engine.close()


def test_region_as_a_context_manager():
    with ferry.TransferEngine("tcp") as e:
        with e.register(np.zeros(64, dtype=np.uint8)) as r:
            assert e.stats()["regions_registered"] == 1 and not r.closed
        assert r.closed and e.stats()["regions_registered"] == 0
        r.close()  # twice: nothing
        with pytest.raises(ferry.InvalidArgument, match=r"region is closed"):
            r.descriptor


def test_closed_engine_properties_raise():
    e = ferry.TransferEngine("tcp", wait_spin_us=5)
    assert e.wait_spin_us == 5
    e.close()
    with pytest.raises(ferry.Cancelled, match="engine is closed"):
        e.wait_spin_us
    assert repr(e) == "ferry.TransferEngine(closed)"


def _a2a(allgather):
    torch = torch_or_skip()
    import ferry.moe

    return torch, ferry.moe.AllToAll(8, 4, 1, 256, in_dtype=torch.bfloat16,
                                      num_experts_per_token=2, rank=0, world_size=1,
                                      allgather=allgather, provider="tcp")


def test_moe_all_to_all_close_twice_and_calls_after_close():
    """close() is collective (an all-gather): called twice it gathered again, a hang on a
    torch.distributed group whose other ranks closed once; dispatch, combine and synchronize
    after close() went on (synchronize on CPU returned)."""
    gathers = []

    def allgather(blob):
        gathers.append(blob)
        return [blob]

    torch, a = _a2a(allgather)
    with a:
        setup = len(gathers)
    a.close()
    a.destroy()
    assert len(gathers) == setup + 1  # one all-gather for the one real close
    E, H = 4, 256
    x = torch.ones(3, H, dtype=torch.bfloat16)
    idx = torch.zeros(3, 2, dtype=torch.int32)
    idx[:, 1] = 1
    w = torch.ones(3, 2)
    ox = torch.zeros(E, a.max_recv_tokens, H, dtype=torch.bfloat16)
    for call in (lambda: a.dispatch(torch.zeros(E, dtype=torch.int32), ox, None, x, None, idx, w),
                 lambda: a.combine(torch.zeros(3, H), idx, w, ox),
                 lambda: a.synchronize()):
        with pytest.raises(ferry.Cancelled, match=r"ferry.moe.AllToAll is closed"):
            call()


def test_moe_buffer_after_destroy():
    torch = torch_or_skip()
    import ferry.moe

    with ferry.moe.Buffer(low_latency_mode=True, rank=0, world_size=1, allgather=lambda b: [b],
                          provider="tcp") as buf:
        x = torch.ones(2, 128, dtype=torch.bfloat16)
        idx = torch.tensor([[0, 1], [1, -1]])
        recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, 4, 2, use_fp8=False)
    buf.destroy()  # twice: nothing
    with pytest.raises(ferry.Cancelled, match=r"ferry.moe.Buffer is closed"):
        buf.low_latency_dispatch(x, idx, 4, 2, use_fp8=False)
    with pytest.raises(ferry.Cancelled, match=r"ferry.moe.Buffer is closed"):
        buf.low_latency_combine(recv_x, idx, torch.ones(2, 2), handle)


# --- Ctrl-C --------------------------------------------------------------------------------

def test_ctrl_c_ends_long_waits_at_once_and_consumes_nothing():
    """The waits held the interpreter in C++ until their timeout: Ctrl-C during
    wait_imm(timeout=20) raised KeyboardInterrupt 20 s later."""
    code = (
        "import os, signal, threading, time, numpy as np, ferry, ferry.kv as fkv\n"
        "a = ferry.TransferEngine('tcp'); b = ferry.TransferEngine('tcp')\n"
        "peer = a.connect(b.address)\n"
        "l = fkv.KvLayout(2, 2, 8, 2, 4, 8)\n"
        "conn = fkv.KvConnector(b, l, np.zeros(l.region_bytes // 2, dtype=np.int16))\n"
        "waits = {'wait_imm': lambda: b.wait_imm(5, 1, timeout=20),\n"
        "         'ImmExpectation.wait': lambda: b.expect_imm(6, 1, 60).wait(timeout=20),\n"
        "         'KvConnector.wait': lambda: conn.wait(20)}\n"
        "for name, wait in waits.items():\n"
        "    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()\n"
        "    t0 = time.monotonic()\n"
        "    try:\n"
        "        wait()\n"
        "        print(name, 'returned')\n"
        "    except KeyboardInterrupt:\n"
        "        print(name, 'interrupted', round(time.monotonic() - t0, 2))\n"
        "a.signal(peer, 5).wait(5)\n"
        "b.wait_imm(5, 1, 5)\n"  # the interrupted wait did not take the arrival
        "print('left', b.imm_available(5))\n"
        "conn.close(); a.close(); b.close()\n")
    r = _run(code, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    lines = r.stdout.split("\n")
    for name, line in zip(("wait_imm", "ImmExpectation.wait", "KvConnector.wait"), lines):
        words = line.split()
        assert words[:2] == [name, "interrupted"], r.stdout
        assert float(words[2]) < 2.0, r.stdout
    assert "left 0" in r.stdout


# --- inputs that look right ----------------------------------------------------------------

def test_kv_pool_of_one_tensor_repeated_refused(rng):
    """[torch.zeros(...)] * num_layers is one tensor for every layer: layers overwrote each
    other's KV without a word. Overlapping views are refused too; disjoint views of one
    buffer are fine."""
    torch = torch_or_skip()
    layout = _layout(regions="per-layer")
    n = layout.region_bytes // 2
    engine = ferry.TransferEngine("tcp")
    t = torch.zeros(n, dtype=torch.int16)
    with pytest.raises(ferry.InvalidArgument, match=r"pool\[1\] is the same memory as pool\[0\]"
                                                     r".*\[t\] \* n repeats one tensor"):
        fkv.KvConnector(engine, layout, [t] * 3)
    i, j = sorted(rng.sample(range(3), 2))
    shift = rng.randrange(1, n)  # elements: the second view starts inside the first
    big = torch.zeros(2 * n, dtype=torch.int16)
    pool = [torch.zeros(n, dtype=torch.int16) for _ in range(3)]
    pool[i], pool[j] = big[:n], big[shift:shift + n]
    with pytest.raises(ferry.InvalidArgument, match=rf"pool\[{j}\] overlaps pool\[{i}\]"):
        fkv.KvConnector(engine, layout, pool)
    assert engine.stats()["regions_registered"] == 0
    flat = torch.zeros(3 * n, dtype=torch.int16)
    with fkv.KvConnector(engine, layout, [flat[k * n:(k + 1) * n] for k in range(3)]) as conn:
        assert len(conn.handshake_info().pool) == 3
    engine.close()


def test_python_object_buffers_and_sparse_tensors_refused():
    """A numpy array of dtype object registered fine: its bytes are PyObject pointers, which a
    peer's write turns into a crash. A sparse tensor raised torch's RuntimeError."""
    torch = torch_or_skip()
    engine = ferry.TransferEngine("tcp")
    objects = np.array([None, 1, "x"] * 4, dtype=object)
    with pytest.raises(ferry.InvalidArgument, match=r"of Python objects \(format 'O'\)"):
        engine.register(objects)
    with pytest.raises(ferry.InvalidArgument, match=r"of Python objects"):
        engine.register(np.zeros(4, dtype=[("a", "i4"), ("b", "O")]))
    with pytest.raises(ferry.InvalidArgument, match=r"layout torch.sparse_coo .*to_dense"):
        engine.register(torch.zeros(4, 4).to_sparse())
    layout = _layout(elem_size=8)
    with pytest.raises(ferry.InvalidArgument, match=r"pool\[0\]: an array of Python objects"):
        fkv.KvConnector(engine, layout, np.empty(layout.region_bytes // 8, dtype=object))
    assert engine.stats()["regions_registered"] == 0
    engine.close()


@pytest.mark.parametrize("name", ["same_host", "busy_poll", "fabric_gpu_memory", "gpu_ipc",
                                  "cma_writes"])
def test_engine_flags_refuse_truthy_strings(name):
    # bool("false") is True: same_host="false" turned same-host mode on.
    for bad in ("false", None, 2, 0.0):
        with pytest.raises(ferry.InvalidArgument, match=rf"{name} must be True or False, got"):
            ferry.TransferEngine("tcp", **{name: bad})


def test_register_read_only_refuses_truthy_strings():
    with ferry.TransferEngine("tcp") as e:
        with pytest.raises(ferry.InvalidArgument, match="read_only must be True or False"):
            e.register(bytearray(64), read_only="no")
        r = e.register(bytearray(64), read_only=np.bool_(False))
        assert r.read_only is False and e.stats()["regions_registered"] == 1


@pytest.mark.parametrize("kw,words", [
    (dict(max_write_size=0), "max_write_size must be > 0"),
    (dict(op_timeout=0), "op_timeout must be a number of seconds > 0"),
])
def test_engine_sizes_of_zero_refused(kw, words):
    """max_write_size=0 hung at the first write (pieces of 0 bytes for ever); op_timeout=0
    failed every operation before it was posted."""
    with pytest.raises(ferry.InvalidArgument, match=words):
        ferry.TransferEngine("tcp", **kw)


# --- help() --------------------------------------------------------------------------------

_PYBIND_SIGNATURE = re.compile(r"^\w+\(self: ferry\._ferry\.")


def _beyond_signature(text):
    """text without the signature line pybind11 puts first: empty where that is all."""
    lines = (text or "").splitlines()
    if lines and _PYBIND_SIGNATURE.match(lines[0]):
        lines = lines[1:]
    return "\n".join(lines).strip()


def _undocumented(module_name):
    """Public names of the module (its __all__), and their public methods and properties,
    whose help() text says nothing beyond a signature."""
    import importlib

    mod = importlib.import_module(module_name)
    missing = []
    for name in mod.__all__:
        obj = getattr(mod, name)
        if not callable(obj) or isinstance(obj, type) and issubclass(obj, BaseException):
            continue
        doc = inspect.getdoc(obj) or ""
        if not _beyond_signature(doc):
            missing.append(name)
        if not isinstance(obj, type):
            continue
        for attr, value in vars(obj).items():
            if attr.startswith("_") and attr != "__init__":
                continue
            if attr == "__init__" and not isinstance(value, types.FunctionType):
                continue  # pybind11 classes made by calls: __init__ says where they come from
            if attr == "__init__":  # every argument named, by it or by the class
                said = (value.__doc__ or "") + doc
                missing += [f"{name}({p})" for p in inspect.signature(value).parameters
                            if p not in ("self", "unsupported") and p not in said]
                continue
            if not _beyond_signature(inspect.getdoc(value)):
                missing.append(f"{name}.{attr}")
    return missing


@pytest.mark.parametrize("module_name", ["ferry", "ferry.kv", "ferry.moe"])
def test_help_documents_every_public_call(module_name):
    """help(ferry.TransferEngine.write) printed the comment line above the method, help(ferry.Op)
    bare pybind11 signatures: the docstrings were in the .pyi stubs only."""
    if module_name == "ferry.moe":
        torch_or_skip()
    assert _undocumented(module_name) == []


def test_kv_layout_whose_size_wraps_around_refused():
    """Sizes of 2**31 wrapped the 128-bit overflow check to 0: a pool of 0 bytes passed, and
    any tensor was large enough for it."""
    with pytest.raises(ferry.InvalidArgument, match="KV layout pool size overflows"):
        fkv.KvLayout(2**31, 2**31, 2**31, 2, 2**31, 2**31)
    for big in ("num_layers", "num_blocks", "num_kv_heads"):
        with pytest.raises(ferry.InvalidArgument, match="KV layout pool size overflows"):
            _layout(**{big: 2**32 - 1, "head_dim": 2**28})


def test_kv_block_lists_are_named_as_block_ids():
    """A bad block list was described as "page indices" (the engine's paged_write wording),
    and a float array as a value error."""
    layout = _layout()
    with ferry.TransferEngine("tcp") as engine:
        with fkv.KvConnector(engine, layout,
                             np.zeros(layout.region_bytes // 2, dtype=np.int16)) as conn:
            with pytest.raises(ferry.InvalidArgument, match=r"blocks: block ids must be "
                                                            r"one-dimensional, got shape \(1, 1\)"):
                conn.offer_pull(1, [[0]], 4)
            with pytest.raises(ferry.InvalidType, match=r"blocks: block ids must be integers, "
                                                        r"got dtype float64"):
                conn.prefill_done(1, np.array([0.0]), 4)


def test_kv_reasons_must_be_strings():
    layout = _layout()
    with ferry.TransferEngine("tcp") as engine:
        with fkv.KvConnector(engine, layout,
                             np.zeros(layout.region_bytes // 2, dtype=np.int16)) as conn:
            for call in (conn.prefill_failed, conn.abort_send):
                with pytest.raises(ferry.InvalidArgument, match="reason must be a string, got "
                                                                "NoneType"):
                    call(1, None)
            assert conn.poll() == []  # nothing reported for the refused calls


def test_moe_helpers_and_devices_refuse_non_tensors():
    """quantize_fp8 / dequantize_fp8 raised AttributeError for a numpy array or None, and
    IndexError for a 0-d tensor; device="gpu" leaked torch's RuntimeError, "cuda" on a torch
    without CUDA an AssertionError; do_send="no" was taken for True."""
    torch = torch_or_skip()
    import ferry.moe

    for bad in (np.zeros((2, 128)), None):
        with pytest.raises(ferry.InvalidArgument, match="x must be a torch.Tensor, got"):
            ferry.moe.quantize_fp8(bad)
    q, s = ferry.moe.quantize_fp8(torch.ones(2, 128, dtype=torch.bfloat16))
    for bad in (None, np.zeros((2, 1))):
        with pytest.raises(ferry.InvalidArgument, match="scales must be a floating-point"):
            ferry.moe.dequantize_fp8(q, bad)
    with pytest.raises(ferry.InvalidArgument, match="q must have at least one dimension"):
        ferry.moe.dequantize_fp8(q[0, 0], s[0, 0])
    # The expected shape was printed as a tuple of strings: "('*', '*')".
    with pytest.raises(ferry.InvalidArgument,
                       match=re.escape("x must have shape (*, *), got (256,)")):
        ferry.moe.quantize_fp8(torch.ones(256, dtype=torch.bfloat16))
    kw = dict(in_dtype=torch.bfloat16, num_experts_per_token=2, rank=0, world_size=1,
              allgather=lambda b: [b], provider="tcp")
    with pytest.raises(ferry.InvalidArgument, match="device must be 'cpu', 'cuda' or 'cuda:N', "
                                                    "got 'gpu'"):
        ferry.moe.AllToAll(8, 4, 1, 256, device="gpu", **kw)
    if not torch.cuda.is_available():
        with pytest.raises(ferry.Unavailable, match="this torch sees no CUDA device"):
            ferry.moe.AllToAll(8, 4, 1, 256, device="cuda", **kw)
    with ferry.moe.AllToAll(8, 4, 1, 256, **kw) as a:
        ox = torch.zeros(4, a.max_recv_tokens, 256, dtype=torch.bfloat16)
        with pytest.raises(ferry.InvalidArgument, match="do_send must be True or False, got 'no'"):
            a.dispatch(torch.zeros(4, dtype=torch.int32), ox, None,
                       torch.ones(1, 256, dtype=torch.bfloat16), None,
                       torch.tensor([[0, 1]], dtype=torch.int32), torch.ones(1, 2), do_send="no")


# --- the exception's type ------------------------------------------------------------------

def _wrong_types():
    """(what, call, the argument's name) for arguments of the wrong type, every layer."""
    torch = torch_or_skip()
    import ferry.moe

    e = ferry.TransferEngine("tcp")
    src = e.register(np.zeros(64, dtype=np.uint8))
    op = e.signal(e.connect(e.address), 1)
    layout = _layout()
    conn = fkv.KvConnector(e, layout, np.zeros(layout.region_bytes // 2, dtype=np.int16))
    a2a_kw = dict(in_dtype=torch.bfloat16, num_experts_per_token=2, rank=0, world_size=1,
                  allgather=lambda b: [b], provider="tcp")
    a2a = ferry.moe.AllToAll(8, 4, 1, 256, **a2a_kw)
    cases = [
        ("engine provider", lambda: ferry.TransferEngine(None), "provider"),
        ("engine rails", lambda: ferry.TransferEngine("tcp", rails="2"), "rails"),
        ("engine op_timeout", lambda: ferry.TransferEngine("tcp", op_timeout="5"), "op_timeout"),
        ("engine same_host", lambda: ferry.TransferEngine("tcp", same_host="no"), "same_host"),
        ("connect", lambda: e.connect("addr"), "address"),
        ("register", lambda: e.register(None), "NoneType"),
        ("register ptr", lambda: e.register((1.5, 8, None)), "ptr"),
        ("write peer", lambda: e.write(None, src, 0, src, 0, 8), "peer"),
        ("write src", lambda: e.write(0, np.zeros(8), 0, src, 0, 8), "src"),
        ("write dst", lambda: e.write(0, src, 0, 42, 0, 8), "dst"),
        ("write imm", lambda: e.write(0, src, 0, src, 0, 8, imm=1.0), "imm"),
        ("paged pages", lambda: e.paged_write(0, src, None, 8, src, [0], 8, 8), "src_pages"),
        ("runs", lambda: e.write_runs(0, src, src, "runs"), "runs"),
        ("wait_imm timeout", lambda: e.wait_imm(1, 1, None), "timeout"),
        ("Op.wait timeout", lambda: op.wait("1"), "timeout"),
        ("RemoteRegion", lambda: ferry.RemoteRegion.from_bytes(5), "descriptor"),
        ("KvLayout", lambda: fkv.KvLayout("2", 2, 8, 2, 4, 8), "num_layers"),
        ("KvConnector engine", lambda: fkv.KvConnector(None, layout, []), "engine"),
        ("KvConnector pool", lambda: fkv.KvConnector(e, layout, "pool"), "pool[0]"),
        ("announce", lambda: conn.announce(1, 0, None), "prefill_ranks"),
        ("wait", lambda: conn.wait(None), "timeout"),
        ("prefill_done blocks", lambda: conn.prefill_done(1, None, 4), "blocks"),
        ("fetch_handshake", lambda: fkv.fetch_handshake("127.0.0.1", 1, layout, "s"), "secret"),
        ("AllToAll", lambda: ferry.moe.AllToAll(8, "4", 1, 256, **a2a_kw), "num_experts"),
        ("dispatch", lambda: a2a.dispatch(np.zeros(4), None, None, None, None, None, None),
         "dp_x"),
        ("quantize_fp8", lambda: ferry.moe.quantize_fp8([1.0]), "x"),
    ]
    return cases, lambda: (a2a.close(), conn.close(), e.close())


def test_wrong_types_are_type_errors_naming_the_argument():
    """An argument of the wrong type raised ferry.InvalidArgument, a ValueError only: code
    catching TypeError (Python's convention for it) missed it. Now ferry.InvalidType, both."""
    cases, close = _wrong_types()
    try:
        for what, call, name in cases:
            with pytest.raises(TypeError) as info:
                call()
            assert isinstance(info.value, ferry.InvalidType), (what, info.value)
            assert isinstance(info.value, ferry.InvalidArgument), what
            assert name in str(info.value), (what, str(info.value))
            assert info.value.code == "invalid argument", what
    finally:
        close()


def test_ferry_errors_are_runtime_errors():
    assert issubclass(ferry.Error, RuntimeError)
    with ferry.TransferEngine("tcp") as e:
        with pytest.raises(RuntimeError, match="immediate 0x9"):
            e.wait_imm(9, 1, 0.05)
        with pytest.raises(ValueError, match=r"imm must be in \[0, 4294967295\], got -1"):
            e.wait_imm(-1, 1, 0.05)  # a value out of range stays a ValueError only
    assert not issubclass(ferry.InvalidArgument, TypeError)


def test_moe_buffer_arguments_of_the_wrong_type():
    """low_latency_dispatch raised AttributeError for a numpy x or None and a bare TypeError
    for num_max_dispatch_tokens_per_rank="4"; Buffer(rank="0", timeout="1") was taken."""
    torch = torch_or_skip()
    import ferry.moe

    kw = dict(world_size=1, allgather=lambda b: [b], provider="tcp")
    for bad, name in ((dict(rank="0"), "rank"), (dict(rank=0, ranks_per_node="1"),
                                                  "ranks_per_node"),
                      (dict(rank=0, timeout="1"), "timeout")):
        with pytest.raises(ferry.InvalidType, match=f"{name} must be "):
            ferry.moe.Buffer(**kw, **bad)
    with ferry.moe.Buffer(low_latency_mode=True, rank=0, **kw) as buf:
        x, idx = torch.ones(2, 128, dtype=torch.bfloat16), torch.tensor([[0, 1], [1, -1]])
        for args, name in (((np.zeros((2, 128)), idx, 4, 2), "x"), ((None, idx, 4, 2), "x"),
                           ((x, idx, "4", 2), "num_max_dispatch_tokens_per_rank"),
                           ((x, idx, 4, 2.0), "num_experts")):
            with pytest.raises(ferry.InvalidType, match=f"{name} must be "):
                buf.low_latency_dispatch(*args)


def test_ctrl_c_ends_op_wait_on_a_stalled_peer():
    """Op.wait on a write to a peer that stopped answering (SIGSTOP) held the interpreter until
    the wait's timeout; the op itself stays in flight and still completes afterwards."""
    code = (
        "import os, signal, sys, threading, time, numpy as np, ferry\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "from peer import PeerProcess\n"
        "if __name__ == '__main__':\n"
        "    child = PeerProcess('tcp', op_timeout=30.0)\n"
        "    n = 32 << 20\n"
        "    dst = child.call('alloc', 'd', 'numpy', n, 0)\n"
        "    e = ferry.TransferEngine('tcp', op_timeout=30.0)\n"
        "    peer = e.connect(child.address)\n"
        "    src = e.register(np.ones(n, dtype=np.uint8))\n"
        "    os.kill(child.proc.pid, signal.SIGSTOP)\n"
        "    op = e.write(peer, src, 0, dst, 0, n, imm=1)\n"
        "    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()\n"
        "    t0 = time.monotonic()\n"
        "    try:\n"
        "        op.wait(20)\n"
        "        print('returned', op.done())\n"
        "    except KeyboardInterrupt:\n"
        "        print('interrupted', round(time.monotonic() - t0, 2), op.done())\n"
        "    os.kill(child.proc.pid, signal.SIGCONT)\n"
        "    op.wait(30)\n"
        "    print('completed')\n"
        "    child.kill(); e.close()\n")
    r = _run(code, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    words = r.stdout.split()
    assert words[0] == "interrupted" and float(words[1]) < 2.0, r.stdout
    assert words[2] == "False" and words[3] == "completed", r.stdout


def test_small_things_print_and_read_as_a_user_expects():
    """dir(ferry) lists what the package offers, not numpy/os/sys; op_timeout=0 is refused in
    the seconds it was given in (it said "0 ms"); Region, RemoteRegion and Op print what they
    are, not a bare object."""
    listed = dir(ferry)
    assert "TransferEngine" in listed and "kv" in listed
    assert not {"np", "os", "sys", "numbers", "operator"} & set(listed)
    with pytest.raises(ferry.InvalidArgument, match=r"op_timeout must be a number of seconds > 0, "
                                                    r"got 0\b"):
        ferry.TransferEngine("tcp", op_timeout=0)
    with ferry.TransferEngine("tcp") as engine:
        region = engine.register(np.zeros(4096, dtype=np.uint8))
        assert re.fullmatch(r"ferry\.Region\(nbytes=4096, device=cpu, data_ptr=0x[0-9a-f]+\)",
                            repr(region)), repr(region)
        remote = ferry.RemoteRegion.from_bytes(region.descriptor)
        assert re.fullmatch(r"ferry\.RemoteRegion\(engine_id=0x[0-9a-f]+, length=4096, "
                            r"device=cpu\)", repr(remote)), repr(remote)
        peer = engine.connect(engine.address)
        op = engine.write(peer, region, 0, remote, 0, 8)
        op.wait(10.0)
        assert repr(op) == "ferry.Op(done=True, imm_writes=0)", repr(op)
        region.close()
        assert repr(region) == "ferry.Region(closed)"
