"""Engine writes between two processes: the target registers a poisoned numpy buffer and hands
its address and descriptor to the initiator, which writes into it with an immediate; the target
waits for the immediate and checks every byte.

    python3 examples/python/engine_write.py [tcp|shm]
"""

import multiprocessing as mp
import sys

import numpy as np

import ferry

SIZE = 1 << 20
IMM = 7


def pattern() -> np.ndarray:
    return (np.arange(SIZE, dtype=np.uint64) * 7 + 3).astype(np.uint8)


def initiator(provider: str, address: bytes, descriptor: bytes, done) -> None:
    with ferry.TransferEngine(provider, same_host=True) as engine:
        peer = engine.connect(address)
        src = engine.register(pattern())
        op = engine.write(peer, src, 0, descriptor, 0, SIZE, imm=IMM)
        op.wait(timeout=10.0)
        done.send(op.imm_writes)  # what the target counts


def main() -> int:
    provider = sys.argv[1] if len(sys.argv) > 1 else "tcp"
    ctx = mp.get_context("spawn")  # engines own threads: never fork a process that has one
    with ferry.TransferEngine(provider, same_host=True) as engine:
        dst = np.full(SIZE, 0xAB, dtype=np.uint8)
        region = engine.register(dst)
        ours, theirs = ctx.Pipe()
        child = ctx.Process(target=initiator,
                            args=(provider, engine.address, region.descriptor, theirs))
        child.start()
        if not ours.poll(30):
            print("engine_write: the initiator did not report", file=sys.stderr)
            child.kill()
            return 1
        writes = ours.recv()
        engine.wait_imm(IMM, writes, timeout=10.0)
        child.join(10)
        if not np.array_equal(dst, pattern()):
            bad = int(np.flatnonzero(dst != pattern())[0])
            print(f"engine_write: byte {bad} differs", file=sys.stderr)
            return 1
        print(f"engine_write.py: {SIZE} bytes over {engine.provider} between two processes, "
              f"{writes} writes with immediate {IMM} counted: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
