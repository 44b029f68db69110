"""scripts/moe_model.py (issue 36): the schedule against ferry's measured bytes, the timing
against a case worked by hand, and the validation within its 20%. Run by ctest (moe_model)
or directly: python3 tests/bench/moe_model_test.py."""

import io
import json
import math
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import moe_model as m  # noqa: E402


class Schedule(unittest.TestCase):
    def test_row_and_counts_format_follow_plan_cc(self):
        # RowFormat::of at the decode shape: header 96 (8 + 16 -> 24, + 32 places, + 4 hit
        # base, + 32 weights = 92 -> 96), payload 7168, 56 fp8 scales 224: `ferry bench moe`
        # reports 3818880 bytes = 510 rows of 7488 at EP2.
        self.assertEqual(m.row_bytes(m.Shape()), 7488)
        self.assertEqual(m.counts_bytes(m.Shape(), 8), 192)  # (4 + 8 + 32) words -> 176 -> 192

    def test_bytes_per_call_match_ferry_bench_moe(self):
        # Measured bytes per call, all ranks (H100 2026-12-06; the routing is random, so the
        # dispatch bytes match the expectation to within a row or two per rank).
        for world, per_node, dispatch, combine in [(2, 1, 3818880, 29360128),
                                                    (4, 2, 13770432, 58720256),
                                                    (8, 2, 40547520, 117440512)]:
            sch = m.schedule(m.Shape(), world, per_node)
            self.assertLess(abs(sch.dispatch_bytes_all / dispatch - 1), 0.01, world)
            self.assertAlmostEqual(sch.combine_bytes_all, combine, delta=1)

    def test_parts_of_a_small_case(self):
        # 4 tokens, top-2 of 4 experts, bf16 rows of 544 B, 2 ranks: a token reaches a rank
        # with p = 1 - C(2,2)/C(4,2) = 5/6; rows ~ Binomial(4, 5/6): P = (1, 20, 150, 500,
        # 625) / 1296 for 0..4 rows.
        s = m.Shape(tokens=4, hidden=256, topk=2, experts=4, dtype="bf16", private_slots=2,
                    proxy_chunk=1024)
        sch = m.schedule(s, 2, 1)
        self.assertEqual(sch.row_bytes, 544)
        priv, over = sch.part("private"), sch.part("overflow")
        self.assertAlmostEqual(priv.bytes, 2570 / 1296 * 544)  # E[min(rows, 2)] rows
        self.assertAlmostEqual(over.bytes, 1750 / 1296 * 544)  # E[max(rows - 2, 0)]
        self.assertAlmostEqual(priv.data_writes, (20 * 1 + 1275 * 2) / 1296)  # 1088 B: 2 writes
        self.assertAlmostEqual(over.data_writes, (500 * 1 + 625 * 2) / 1296)
        comb = sch.part("combine")
        self.assertEqual((comb.bytes, comb.data_writes, comb.record_writes), (2048, 2, 1))


class Timing(unittest.TestCase):
    def test_small_case_by_hand(self):
        s = m.Shape(tokens=4, hidden=256, topk=2, experts=4, dtype="bf16", private_slots=2,
                    proxy_chunk=1024)
        p = m.ProxiedParams(nic_gbps=1, nics=1, latency_us=10, write_us=1, publish_us=2,
                            notice_us=5, pcie_store_gbps=1, pcie_read_gbps=1, pcie_sum_gbps=1,
                            plan_us=6, dispatch_us=0, expert_us=3, combine_us=0)
        r = m.model_proxied(s, 2, 1, p)
        # 1 GB/s = 1000 B/us. Counts (64 B, 2 writes) ready at 6 + 2: posted 8-10, in at 20,
        # seen at 25. Private rows (2570/1296 * 544 B) stored by 7.08, posted from 10 (the proxy
        # is busy until then) for 1 + 2570/1296 writes. Overflow rows stored at 25 + 0.73,
        # ready 27.73, posted for 1 + 1750/1296 writes, in at +10, seen at +5, then read.
        b_over = 1750 / 1296 * 544
        over_ready = 25 + b_over / 1000 + 2
        rows_in = over_ready + (1 + 1750 / 1296) + 10 + 5
        dispatch = rows_in + (4 * 5 / 6) * 544 / 1000
        self.assertAlmostEqual(r["dispatch"], dispatch, places=6)
        # Combine: 4 hits * 512 B = 2048 B in 2 pieces of 1024 and a record (3 writes).
        c0 = dispatch + 3
        post_start = c0 + 1.024 + 2  # the first piece stored, published
        wire_end = post_start + 1 + 2.048  # the wire starts after the first post
        layer = wire_end + 10 + 5 + 1.024  # in, seen, the last piece read
        self.assertAlmostEqual(r["layer"], layer, places=6)
        self.assertAlmostEqual(r["combine"], layer - c0, places=6)
        self.assertTrue(math.isclose(r["layer"], 71.99421, rel_tol=1e-6), r["layer"])

    def test_cpu_backend_small_case_by_hand(self):
        s = m.Shape(tokens=4, hidden=256, topk=2, experts=4, dtype="bf16", private_slots=2)
        p = m.CpuParams(cores=2, send1_us=100, recv1_us=50, expert1_us=30, csend1_us=80,
                        reduce1_us=60, write_us=1, net_gbps=1, latency_us=10)
        r = m.model_cpu(s, 2, 1, p)
        # 10/3 rows per rank; rank 1 alone packs and copies 4 rows in 100 us, so packing
        # 20/3 rows and copying 10/3 takes 125. Two ranks on two cores: per rank 125 + 50 +
        # 3 writes + its copy of 10/3 rows of 544 B and a 64 B counts message at 1000 B/us
        # (each rank's engine copies on a core of its own); two latencies (counts, rows).
        dispatch = (125 + 50 + 3 + (10 / 3 * 544 + 64) / 1000) + 20
        # combine_send stages every hit (40 of 80) and copies the same-node half (20): 60; the
        # sum 60; one write; its 4 hits of 512 B over the fabric; one latency.
        combine = (60 + 60 + 1 + 2048 / 1000) + 10
        self.assertAlmostEqual(r["dispatch"], dispatch, places=6)
        self.assertAlmostEqual(r["combine"], combine, places=6)
        self.assertAlmostEqual(r["layer"], dispatch + 30 + combine, places=6)
        # On one core the two ranks' work, their copies included, runs one after the other.
        one = m.model_cpu(s, 2, 1, m.dataclasses.replace(p, cores=1))
        self.assertAlmostEqual(one["dispatch"], 2 * (dispatch - 20) + 20, places=6)
        self.assertAlmostEqual(one["combine"], 2 * (combine - 10) + 10, places=6)

    def test_validation_stays_within_twenty_percent(self):
        worst = m.validate_proxied(io.StringIO())
        self.assertLess(worst, 0.2)

    def test_h200_run_proxied_within_twenty_percent(self):
        # The committed run of scripts/moe_validate_device.sh (one H200, 16 cores): the proxied
        # path over shm and tcp at EP2/4/8, decode and prefill, 12 layers.
        got = m.load_measured([m.H200_RUNS])
        self.assertEqual(got.cores, 16)
        self.assertEqual(sorted(got.proxied), ["shm", "tcp"])
        for fab, runs in got.proxied.items():
            self.assertEqual(len(runs), 6, fab)
            self.assertLess(m.validate_proxied(io.StringIO(), runs, fab), 0.2, fab)
        self.assertEqual(len(got.cpu), 12)  # printed beside the model; it misses (docs/MOE.md)

    def test_measured_files_feed_the_same_comparison(self):
        # What scripts/moe_validate_device.sh writes: `bench xfer` and `bench moe` JSON and a
        # host.json; the model must read the inputs from them and set it beside the runs.
        shape = {"hidden": 7168, "topk": 8, "experts": 256, "dtype": "fp8_e4m3",
                 "combine": "per-hit"}

        def moe(backend, provider, n, r, tokens, phases, **extra):
            return dict(shape, backend=backend, provider=provider, ranks=n, ranks_per_node=r,
                        tokens=tokens, phases={k: {"p50_us": v} for k, v in phases.items()},
                        **extra)

        one = dict(zip(("dispatch_send", "dispatch_recv", "dispatch", "combine_send",
                        "combine_recv", "combine", "layer"), m.CPU_ONE_RANK[128]))
        files = {
            "host.json": {"cores": 2, "gpus": 1},
            "xfer_tcp.json": {"benchmark": "xfer", "provider": "tcp;ofi_rxm",
                              "latency_us": {"p50": 7.9},
                              "rows": [{"kind": "write", "size_bytes": 4194304,
                                        "engine_cpu_us_per_op": 873.23},
                                       {"kind": "small write", "size_bytes": 64,
                                        "engine_cpu_us_per_op": 1.92}]},
            "cpu_one_t128.json": moe("cpu", "tcp;ofi_rxm", 1, 1, 128, one),
            "cpu_tcp_ep4_t128.json": moe("cpu", "tcp;ofi_rxm", 4, 2, 128, {
                "dispatch": 14285.9, "combine": 62800.4, "layer": 131933.8}),
            "cuda_tcp_ep8_t128.json": moe("cuda", "tcp;ofi_rxm", 8, 2, 128, {
                "dispatch": 2390.7, "combine": 4825.8, "layer": 7362.2},
                floor_write_us=6008.2, mapped_layer_us=335.2),
        }
        with tempfile.TemporaryDirectory() as d:
            for name, j in files.items():
                with open(os.path.join(d, name), "w") as f:
                    json.dump(j, f)
            got = m.load_measured([d])
            out = io.StringIO()
            worst = m.validate_measured(out, got)
        self.assertEqual(got.cores, 2)
        self.assertEqual(got.proxied, {"tcp": [m.H100_TCP[2]]})
        self.assertEqual(got.cpu, [("tcp", 4, 2, 128, 14285.9, 62800.4, 131933.8)])
        self.assertEqual(got.cpu_one_rank, {128: m.CPU_ONE_RANK[128]})
        for a, b in zip(got.cpu_net["tcp"], m.CPU_NET["tcp"]):
            self.assertAlmostEqual(a, b)
        # The same predictions as the script's own tables give for these runs.
        want = max(abs(m.validate_proxied(io.StringIO(), [m.H100_TCP[2]])),
                   abs(m.model_cpu(m.Shape(), 4, 2, m.cpu_params("tcp", 128))["layer"]
                       / 131933.8 - 1))
        self.assertAlmostEqual(worst, want)
        self.assertIn("over tcp", out.getvalue())
        self.assertIn("(2 cores)", out.getvalue())

    def test_measured_refuses_a_run_it_cannot_model(self):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "x.json"), "w") as f:
                json.dump({"backend": "cuda", "provider": "tcp", "ranks": 2, "ranks_per_node": 1,
                           "tokens": 128, "hidden": 7168, "topk": 8, "experts": 256,
                           "dtype": "fp8_e4m3", "combine": "per-hit", "phases": {}}, f)
            with self.assertRaisesRegex(SystemExit, "needs --floor"):
                m.load_measured([d])

    def test_cli_prints_a_projection(self):
        out = io.StringIO()
        sys.stdout, saved = out, sys.stdout
        try:
            m.main(["--ranks", "16"])
        finally:
            sys.stdout = saved
        self.assertIn("projection (not a measurement), EP16", out.getvalue())


if __name__ == "__main__":
    unittest.main()
