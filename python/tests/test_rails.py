"""The rail settings and per-rail counters from Python: two tcp rails of one process stand in
for two EFA devices of the p5en fixture (tests/fabric/topology), and rail_stats() shows which
NIC sent a write and which received it (docs/ARCHITECTURE.md, "Rails and topology")."""

from __future__ import annotations

import os

import numpy as np
import pytest

import ferry

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "fabric", "topology",
                       "p5en.xml")
# Rail 0 stands for rdmap20s0, rail 1 for rdmap21s0 (GPU 0's switch on a p5en).
TWO_NICS = "efa rdmap20s0 0000:14:00.0\nefa rdmap21s0 0000:15:00.0\n"


def rails_engine(selection):
    return ferry.TransferEngine("tcp", rails=2, rail_selection=selection, topology_xml=FIXTURE,
                                rail_nics=TWO_NICS)


def test_listed_nics_send_and_receive_and_are_counted_per_rail():
    # The sender's region is on rdmap21s0 (rail 1) only, the receiver's on rdmap20s0 (rail 0)
    # only: the write leaves on the sender's rail 1 and lands on the receiver's rail 0, the
    # NICs each side's descriptor names; no rail index is near both, so it is counted.
    n = 1 << 16
    with rails_engine("rdmap21s0") as a, rails_engine("rdmap20s0") as b:
        src = np.arange(n, dtype=np.uint8)
        dst = np.zeros(n, dtype=np.uint8)
        src_region, dst_region = a.register(src), b.register(dst)
        peer = a.connect(b.address)
        a.write(peer, src_region, 0, dst_region.descriptor, 0, n, imm=7).wait(20.0)
        b.wait_imm(7, 1, timeout=20.0)
        assert np.array_equal(src, dst)
        sent = a.rail_stats()
        assert [r["bytes_posted"] for r in sent] == [0, n]
        assert [r["imm_arrivals"] for r in b.rail_stats()] == [1, 0]
        assert a.stats()["rail_fallbacks"] == 1
        assert b.stats()["rail_fallbacks"] == 0


def test_a_bad_rail_selection_names_the_argument():
    with pytest.raises(ferry.NotFound, match="rail_selection: .*'rdmap99s0', which is not here"):
        rails_engine("rdmap99s0")
    with pytest.raises(ferry.InvalidArgument, match="rail_selection"):
        rails_engine("rdmap20s0,,rdmap21s0")
    with pytest.raises(ferry.InvalidArgument, match="rail_nics"):
        ferry.TransferEngine("tcp", rails=2, rail_nics="efa rdmap20s0 zz\n")
