"""Shared fixtures: one peer process and one local engine per provider, reused by a module's
tests so that the whole run stays within about a minute on a 2-core machine."""

from __future__ import annotations

import os
import random
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import ferry  # noqa: E402
from peer import PeerProcess  # noqa: E402

PROVIDERS = ["tcp", "shm"]


@pytest.fixture(scope="module", params=PROVIDERS)
def pair(request):
    """(local engine, its peer id for the child, the child process), connected both ways."""
    provider = request.param
    child = PeerProcess(provider)
    engine = ferry.TransferEngine(provider, same_host=True, op_timeout=5.0, idle_spin_us=50)
    peer = engine.connect(child.address)
    child.call("connect", "parent", engine.address)
    yield engine, peer, child
    child.close()
    engine.close()


@pytest.fixture
def rng(request):
    """A seeded random.Random; the seed is printed so that a failure can be replayed
    (FERRY_TEST_SEED=<seed>)."""
    seed = int(os.environ.get("FERRY_TEST_SEED", random.randrange(1 << 31)))
    print(f"{request.node.name}: seed {seed}")
    return random.Random(seed)


def torch_or_skip():
    """torch, or a skip naming why not: of the test, or of the whole module when called at its
    top (test_moe.py), where pytest otherwise fails the collection on an interpreter without
    torch (a venv of a python3 that has none)."""
    try:
        import torch  # noqa: F401
    except ImportError as e:
        pytest.skip(f"torch not importable: {e}", allow_module_level=True)
    return torch
