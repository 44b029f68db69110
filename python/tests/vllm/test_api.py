"""FerryConnector against the installed vLLM's connector interface (KVConnectorBase_V1): every
abstract method implemented, every method ferry overrides still in the base class with the same
parameters, so that a vLLM upgrade that changes the interface fails here, loudly, rather than in
a serving engine. And the layouts it reads off vLLM's KV tensors. Runs where vLLM is installed
(build/vllm-venv: scripts/vllm_venv.sh); skipped elsewhere."""

from __future__ import annotations

import inspect

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/vllm_venv.sh)")
torch = pytest.importorskip("torch")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: E402

import ferry.kv as fkv  # noqa: E402
import ferry.vllm  # noqa: E402
from ferry.vllm import FerryConnector  # noqa: E402
from ferry.vllm.connector import FerryConfigError, FerryOptions, layout_of  # noqa: E402
from ferry.vllm.connector import transfer_id_of, transfer_key  # noqa: E402

PINNED_VLLM = "0.32.0"


def test_the_pinned_vllm_is_installed():
    assert vllm.__version__.split("+")[0] == PINNED_VLLM, (
        f"vLLM {vllm.__version__} is installed, the connector is written against {PINNED_VLLM} "
        "(requirements/vllm-nodeps.txt): check its interface and update both")


def test_no_abstract_method_is_left():
    assert not getattr(FerryConnector, "__abstractmethods__", frozenset()), (
        f"vLLM's KVConnectorBase_V1 has abstract methods FerryConnector lacks: "
        f"{sorted(FerryConnector.__abstractmethods__)}")
    assert issubclass(FerryConnector, KVConnectorBase_V1)


def _params(fn):
    sig = inspect.signature(fn)
    return [(p.name, p.kind) for p in sig.parameters.values()]


def test_every_override_matches_the_base_signature():
    own = {name: fn for name, fn in vars(FerryConnector).items()
           if not name.startswith("_") and callable(getattr(FerryConnector, name))}
    assert own, "FerryConnector defines no methods?"
    missing, differ = [], []
    for name in sorted(own):
        base = getattr(KVConnectorBase_V1, name, None)
        if base is None:
            missing.append(name)
            continue
        mine = getattr(FerryConnector, name)
        if _params(mine) != _params(base):
            differ.append(f"{name}{inspect.signature(mine)} vs vLLM's {name}"
                          f"{inspect.signature(base)}")
    assert not missing, f"vLLM's KVConnectorBase_V1 no longer has {missing}: vLLM never calls them"
    assert not differ, "signatures differ from vLLM's:\n" + "\n".join(differ)


def test_the_hooks_the_flow_needs_are_overridden():
    # The push and pull flows rest on these; each must be ferry's, not the base's default
    # (bind_connector_metadata: the step's transfers start there, before the forward).
    for name in ("register_kv_caches", "bind_connector_metadata", "start_load_kv",
                 "get_transfer_results",
                 "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                 "update_connector_output", "request_finished", "has_pending_push_work",
                 "get_block_ids_with_load_errors", "shutdown"):
        assert name in vars(FerryConnector), f"FerryConnector does not override {name}"


def test_vllm_finds_the_class_by_module_path():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    cfg = KVTransferConfig(kv_connector="FerryConnector", kv_connector_module_path="ferry.vllm",
                           kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(cfg) is ferry.vllm.FerryConnector


def test_extra_config_defaults_and_mistakes():
    o = FerryOptions.from_extra({})
    assert (o.mode, o.provider, o.host) == ("push", "tcp", "127.0.0.1")
    with pytest.raises(FerryConfigError, match="unknown kv_connector_extra_config keys"):
        FerryOptions.from_extra({"prot": 1})
    with pytest.raises(FerryConfigError, match="not a TCP port"):
        FerryOptions.from_extra({"port": 70000})
    with pytest.raises(FerryConfigError, match='neither "push" nor "pull"'):
        FerryOptions.from_extra({"mode": "teleport"})
    assert FerryOptions.from_extra({"mode": "pull", "lease": 12}).lease == 12.0
    with pytest.raises(FerryConfigError, match="rails must be at least 1, got 0"):
        FerryOptions.from_extra({"rails": 0})
    o = FerryOptions.from_extra({"rails": 2, "rail_selection": "all"})
    assert (o.rails, o.rail_selection) == (2, "all")
    assert o.layerwise is True
    assert FerryOptions.from_extra({"layerwise": False}).layerwise is False
    assert FerryOptions.from_extra({"layerwise": "false"}).layerwise is False
    with pytest.raises(FerryConfigError, match="layerwise must be true or false, got 'yes'"):
        FerryOptions.from_extra({"layerwise": "yes"})
    assert o.cma_writes is False
    assert FerryOptions.from_extra({"cma_writes": True}).cma_writes is True
    with pytest.raises(FerryConfigError, match="cma_writes must be true or false, got 2"):
        FerryOptions.from_extra({"cma_writes": 2})


def test_pull_params_a_decode_request_carries_are_checked():
    # What prefill's answer hands decode in pull mode (through the client): each mistake is
    # refused with its name before any read; the engine then fails the load.
    from ferry.vllm.connector import _pull_fields

    good = {"remote_block_ids": [3, 4], "remote_num_tokens": 64, "ferry_capability": "ab" * 16,
            "ferry_expires": 5.0}
    blocks, cap, expires = _pull_fields(good, 64)
    assert (blocks, cap, expires) == ([3, 4], bytes([0xab]) * 16, 5.0)
    # Prefill's block size may differ from decode's: any count of its blocks up to one a token
    # (ferry checks the count against prefill's layout when it plans the reads).
    assert _pull_fields(dict(good, remote_block_ids=[7]), 64)[0] == [7]
    for bad, what in (({"remote_block_ids": []}, "1 to 64 block ids"),
                      ({"remote_block_ids": list(range(65))}, "1 to 64 block ids"),
                      ({"remote_block_ids": [3, -1]}, "1 to 64 block ids"),
                      ({"remote_block_ids": "3,4"}, "1 to 64 block ids"),
                      ({"remote_num_tokens": 48}, "not this engine's 64"),
                      ({"ferry_capability": "ab" * 15}, "32 hex digits"),
                      ({"ferry_capability": "zz" * 16}, "32 hex digits")):
        with pytest.raises(ValueError, match=what):
            _pull_fields(dict(good, **bad), 64)


def test_transfer_ids_are_explicit_integers():
    assert transfer_id_of(None) is None
    assert transfer_id_of({"do_remote_prefill": True}) is None
    assert transfer_id_of({"ferry_transfer_id": 7}) == 7
    for bad in (0, -1, 1 << 63, "7", 1.5, True):
        with pytest.raises(FerryConfigError, match="ferry_transfer_id"):
            transfer_id_of({"ferry_transfer_id": bad})


def test_layouts_read_off_vllm_tensors():
    B, N, H, D = 6, 32, 2, 64
    cpu = [torch.zeros(B, H, N, 2 * D, dtype=torch.bfloat16) for _ in range(3)]
    layout, pool = layout_of(cpu, num_blocks=B, block_size=N, num_kv_heads=H, head_dim=D)
    assert (layout.placement, layout.order, layout.regions) == ("head-joint", "HND", "per-layer")
    assert (layout.num_layers, layout.num_blocks, layout.block_size) == (3, B, N)
    assert layout.region_bytes == cpu[0].numel() * 2
    flash = [torch.zeros(2, B, N, H, D, dtype=torch.float16) for _ in range(2)]
    layout, _ = layout_of(flash, num_blocks=B, block_size=N, num_kv_heads=H, head_dim=D)
    assert (layout.placement, layout.order) == ("separate", "NHD")
    with pytest.raises(FerryConfigError, match=r"shape \(6, 2, 32, 64\)"):
        layout_of([torch.zeros(B, H, N, D)], num_blocks=B, block_size=N, num_kv_heads=H,
                  head_dim=D)
    strided = [torch.zeros(B, N, H, 2 * D).permute(0, 2, 1, 3)]
    with pytest.raises(FerryConfigError, match="not contiguous"):
        layout_of(strided, num_blocks=B, block_size=N, num_kv_heads=H, head_dim=D)


def test_cpu_pages_are_what_vllms_kernel_writes():
    """The placement the connector gives vLLM's CPU pages is how vLLM's CPU attention writes
    them (vLLM 0.32, float16 on an x86 machine without AMX-FP16: ISA "vec"): each head's K page
    dimension-major, [head_dim][block_size], then its V rows [block_size][head_dim]. A vLLM that
    packs the pages otherwise fails here, not with wrong tokens after a transfer."""
    from ferry.vllm.connector import cpu_page_placement

    ops = pytest.importorskip("vllm._custom_ops")
    H, D = 2, 64
    for bs in (32, 64):
        placement = cpu_page_placement(torch.float16, bs, D)
        if placement != "head-joint-kt":
            pytest.skip(f"vLLM's CPU attention here is not its vec kernel ({placement})")
        page = torch.zeros(3, H, bs, 2 * D, dtype=torch.float16)
        k_cache, v_cache = page.view(3, H, 2 * bs, D).chunk(2, dim=2)
        n = 2 * bs + 5
        key = torch.randn(n, H, D).half()
        value = torch.randn(n, H, D).half()
        ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache,
                                       torch.arange(n, dtype=torch.int64), "vec")
        flat = page.view(3, H, 2 * bs * D)
        for t in (0, 1, bs - 1, bs, n - 1):
            b, slot = divmod(t, bs)
            for h in range(H):
                k = flat[b, h, slot:bs * D:bs]  # dims block_size elements apart
                v = flat[b, h, bs * D + slot * D:bs * D + (slot + 1) * D]
                assert torch.equal(k, key[t, h]), f"block size {bs}: K of token {t}, head {h}"
                assert torch.equal(v, value[t, h]), f"block size {bs}: V of token {t}, head {h}"


def test_layouts_ferry_cannot_map_are_named_with_both_sides():
    from ferry.vllm.connector import mismatch

    def lay(**kw):
        d = dict(num_layers=2, num_kv_heads=2, head_dim=64, elem_size=2, block_size=32,
                 num_blocks=8, placement="head-joint-kt", order="HND", regions="per-layer")
        d.update(kw)
        return fkv.KvLayout(**d)

    own = lay()
    # Mapped: other block sizes, TP 2 into TP 1 (one head each), other placements.
    assert mismatch(lay(block_size=64), 0, 1, own, 1, 0, 1) == ""
    assert mismatch(lay(num_kv_heads=1), 1, 2, own, 1, 1, 2) == ""
    assert mismatch(lay(placement="separate", order="NHD"), 0, 1, own, 1, 0, 1) == ""
    assert mismatch(lay(placement="head-joint"), 0, 1, lay(placement="head-joint"), 1, 0,
                    1) == ""
    for peer, rank, tp, what in (
            (lay(num_kv_heads=1), 0, 2, "serves TP rank 0 of 2, the request's remote_tp_size "
                                        "names rank 0 of 1"),
            (lay(placement="head-joint", block_size=64), 0, 1,
             "head-joint of block size 64, this engine's head-joint-kt of block size 32")):
        assert what in mismatch(peer, rank, tp, own, 1, 0, 1)
    assert "head-joint-kt of block size 64, this engine's head-joint of block size 32" in \
        mismatch(lay(block_size=64), 0, 1, lay(placement="head-joint"), 1, 0, 1)


def test_transfer_keys_bind_the_prompt():
    """Both sides move a request's KV under a key of its transfer id and its prompt: the same
    pair gives the same key, another prompt or id another one, always in [1, 2**63)."""
    k = transfer_key(5, [1, 2, 3])
    assert k == transfer_key(5, [1, 2, 3])
    assert len({k, transfer_key(5, [1, 2, 4]), transfer_key(6, [1, 2, 3]),
                transfer_key(5, [12, 3]), transfer_key(5, [])}) == 5
    assert all(0 < transfer_key(t, [t]) < 1 << 63 for t in range(1, 200))
