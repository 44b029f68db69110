"""ferry.kv between two processes over tcp and shm: push (both arrival orders, through the
handshake side channel) and pull with per-layer torch tensors on each side, different block
sizes and region splits on the two sides, every KV byte of the decode pool checked (the written
ones and the poisoned rest); cancel; a prefill process killed mid-transfer; and the mistakes a
Python user makes, each an exception naming the problem."""

from __future__ import annotations

import logging
import time

import pytest

from conftest import PROVIDERS
from kv_worker import KvPeer, KvSide

torch = pytest.importorskip("torch", reason="ferry.kv's tests use torch tensor pools")

import ferry  # noqa: E402
import ferry.kv as fkv  # noqa: E402

SECRET = b"ferry-test-deployment-secret-32b"

# Small model shape: 4 layers, 2 KV heads of 16 int16 elements. Prefill uses 16-token blocks,
# decode 8-token ones; 100 tokens fill neither side's last block.
LAYERS, HEADS, HEAD_DIM = 4, 2, 16
PREFILL = dict(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, elem_size=2,
               block_size=16, num_blocks=24)
DECODE = dict(PREFILL, block_size=8, num_blocks=40)
TOKENS = 100

# (prefill split, decode split): vLLM per-layer tensors against SGLang K/V buffers, one tensor
# against per-layer tensors, and vLLM 0.32's CPU pages (placement "head-joint") both ways.
SPLITS = [("per-layer", "per-layer-kv"), ("one", "per-layer"), ("vllm-cpu", "per-layer-kv"),
          ("per-layer", "vllm-cpu")]


@pytest.fixture(scope="module", params=PROVIDERS)
def provider(request):
    return request.param


@pytest.fixture(scope="module")
def prefill_proc():
    peer = KvPeer()
    yield peer
    peer.close()


def blocks_for(rng, num_blocks, block_size, tokens):
    """Scattered block ids, as a long-running engine's pool hands them out."""
    return rng.sample(range(num_blocks), -(-tokens // block_size))


def open_pair(provider, prefill_proc, splits, rng, *, lease=10.0, decode_kw=DECODE,
              pull_keys="offer"):
    """(decode KvSide here, prefill address, prefill blocks, prefill's logical KV)."""
    psplit, dsplit = splits
    addr = prefill_proc.call("open", provider, PREFILL, psplit,
                             {"lease": lease, "pull_keys": pull_keys})
    seed = rng.randrange(1 << 31)
    prefill_proc.call("fill_random", seed)
    decode = KvSide(provider, decode_kw, dsplit, lease=lease)
    pblocks = blocks_for(rng, PREFILL["num_blocks"], PREFILL["block_size"], TOKENS)
    logical = torch.from_numpy(prefill_proc.call("gather", pblocks, TOKENS))
    return decode, addr, pblocks, logical


def assert_landed(decode, dblocks, logical, first_token=0):
    expected = decode.expected_after(logical, dblocks, TOKENS, first_token)
    problem = decode.check_pool(expected)
    assert problem == "", problem


# Decode's block size against prefill's 16: another (8) and the same, each with its own split.
PAIRINGS = {"decode-8": (DECODE, SPLITS[0]),
            "decode-16": (dict(DECODE, block_size=16, num_blocks=24), SPLITS[1])}


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("pairing", sorted(PAIRINGS))
@pytest.mark.parametrize("hits", ["none", "some", "all-but-one"])
def test_partial_transfer_after_prefix_hits(provider, prefill_proc, rng, mode, pairing, hits):
    """Decode's prefix cache holds the first k of its blocks (vLLM's local hits): only tokens
    [k * block_size, 100) move, into the blocks decode allocated for them (its block list
    starts there), from prefill's blocks of the whole prompt. k = 0, an odd k (the range
    starts inside one of prefill's 16-token blocks when decode's are 8) and all but the last
    block. The whole decode pool is checked: the range in its blocks, poison everywhere else
    (the prefix blocks included). Named by string (push) and bytes (pull) ids, as vLLM names
    requests."""
    decode_kw, splits = PAIRINGS[pairing]
    bs = decode_kw["block_size"]
    nblocks = -(-TOKENS // bs)
    k = {"none": 0, "some": nblocks // 2 | 1, "all-but-one": nblocks - 1}[hits]
    first = k * bs
    decode, addr, pblocks, logical = open_pair(provider, prefill_proc, splits, rng,
                                               decode_kw=decode_kw)
    try:
        rid = f"cmpl-{rng.randrange(1 << 63):x}-0"
        tid = rid if mode == "push" else rid.encode()
        dblocks = rng.sample(range(decode_kw["num_blocks"]), nblocks - k)
        if mode == "push":
            decode.call("register_push", tid, 1, [addr], dblocks, TOKENS, first_token=first)
            prefill_proc.call("call", "prefill_progress", tid, pblocks, 48)
            prefill_proc.call("call", "prefill_done", tid, pblocks, TOKENS)
        else:
            params = prefill_proc.call("call", "offer_pull", tid, pblocks, TOKENS)
            decode.call("pull", tid, [params], dblocks, TOKENS, first_token=first)
        ok, code, msg, nbytes, _ = decode.next_event("recv", tid, 30)
        assert ok, f"{code}: {msg}"
        assert nbytes == LAYERS * 2 * (TOKENS - first) * HEADS * HEAD_DIM * 2
        sent = prefill_proc.call("next_event", "send", tid, 30)
        assert sent[0], sent
        assert_landed(decode, dblocks, logical, first)
        assert decode.stats()["active_recv"] == 0
        assert decode.conn.open_names == 0
    finally:
        decode.close()


def test_whole_prompt_held_moves_nothing(provider, prefill_proc, rng):
    """Every token is in decode's prefix cache: register_push with first_token == num_tokens
    and no block moves nothing, ends at once on both sides and frees prefill's blocks."""
    decode, addr, pblocks, _ = open_pair(provider, prefill_proc, SPLITS[0], rng)
    try:
        tid = f"req-{rng.randrange(1 << 63):x}"
        decode.call("register_push", tid, 0, [addr], [], TOKENS, first_token=TOKENS)
        prefill_proc.call("call", "prefill_done", tid, pblocks, TOKENS)
        ok, code, msg, nbytes, writes = decode.next_event("recv", tid, 30)
        assert ok and nbytes == 0 and writes == 0, f"{code}: {msg}"
        assert prefill_proc.call("next_event", "send", tid, 30)[0]
        assert decode.all_poison()
        assert prefill_proc.call("stats")["active_send"] == 0
    finally:
        decode.close()


@pytest.mark.parametrize("splits", SPLITS, ids=lambda s: f"{s[0]}-to-{s[1]}")
def test_push_registration_first(provider, prefill_proc, rng, splits):
    decode, _, pblocks, logical = open_pair(provider, prefill_proc, splits, rng)
    try:
        # Decode learns prefill's address through the side channel, as a deployment does.
        port = prefill_proc.call("serve_handshake", SECRET)
        info = fkv.fetch_handshake("127.0.0.1", port, decode.layout, SECRET)
        assert info.layout.block_size == PREFILL["block_size"]
        assert len(info.pool) == info.layout.region_count
        dblocks = blocks_for(rng, DECODE["num_blocks"], DECODE["block_size"], TOKENS)
        tid = rng.randrange(1 << 63)
        decode.call("announce", tid, 1, [info.address])
        prefill_proc.call("call", "prefill_scheduled", tid)
        ok, code, msg, _, _ = decode.next_event("scheduled", tid, 20)
        assert ok, msg
        decode.call("register_push", tid, 1, [info.address], dblocks, TOKENS)
        # A chunk first, the rest at done: both segments must land.
        prefill_proc.call("call", "prefill_progress", tid, pblocks, 48)
        prefill_proc.call("call", "prefill_done", tid, pblocks, TOKENS)
        ok, code, msg, nbytes, _ = decode.next_event("recv", tid, 30)
        assert ok, f"{code}: {msg}"
        assert nbytes == LAYERS * 2 * TOKENS * HEADS * HEAD_DIM * 2
        sent = prefill_proc.call("next_event", "send", tid, 30)
        assert sent[0], sent
        assert_landed(decode, dblocks, logical)
        assert decode.stats()["active_recv"] == 0
    finally:
        decode.close()


@pytest.mark.parametrize("splits", SPLITS[:1], ids=lambda s: f"{s[0]}-to-{s[1]}")
def test_push_prefill_done_first(provider, prefill_proc, rng, splits):
    decode, addr, pblocks, logical = open_pair(provider, prefill_proc, splits, rng)
    try:
        tid = rng.randrange(1 << 63)
        prefill_proc.call("call", "prefill_done", tid, pblocks, TOKENS)
        dblocks = blocks_for(rng, DECODE["num_blocks"], DECODE["block_size"], TOKENS)
        decode.call("register_push", tid, 1, [addr], dblocks, TOKENS)
        ok, code, msg, _, _ = decode.next_event("recv", tid, 30)
        assert ok, f"{code}: {msg}"
        assert prefill_proc.call("next_event", "send", tid, 30)[0]
        assert_landed(decode, dblocks, logical)
    finally:
        decode.close()


@pytest.mark.parametrize("splits", SPLITS, ids=lambda s: f"{s[0]}-to-{s[1]}")
def test_pull(provider, prefill_proc, rng, splits):
    decode, _, pblocks, logical = open_pair(provider, prefill_proc, splits, rng)
    try:
        tid = rng.randrange(1 << 63)
        params = prefill_proc.call("call", "offer_pull", tid, pblocks, TOKENS)
        assert isinstance(params, bytes)
        dblocks = blocks_for(rng, DECODE["num_blocks"], DECODE["block_size"], TOKENS)
        decode.call("pull", tid, [params], dblocks, TOKENS)
        ok, code, msg, _, reads = decode.next_event("recv", tid, 30)
        assert ok, f"{code}: {msg}"
        assert reads > 0
        # DONE frees prefill's blocks.
        assert prefill_proc.call("next_event", "send", tid, 30)[0]
        assert prefill_proc.call("stats")["active_send"] == 0
        assert_landed(decode, dblocks, logical)
    finally:
        decode.close()


def test_pull_with_parameters_built_by_decode(provider, prefill_proc, rng):
    """vLLM's prefill answers a request before its worker, which holds the connector, can offer
    the blocks: decode builds what pull() takes from prefill's handshake and the block ids and
    capability the request carried (ferry.kv.pull_params), and prefill offers the blocks under
    that capability. The KV lands, decode's DONE frees prefill's blocks; a DONE under another
    capability frees nothing (the lease does)."""
    import os

    # Prefill hands out the pool's keys (KvConfig(pull_keys="pool")), as vLLM's connector does.
    decode, _, pblocks, logical = open_pair(provider, prefill_proc, SPLITS[2], rng, lease=2.0,
                                            pull_keys="pool")
    try:
        port = prefill_proc.call("serve_handshake", SECRET)
        info = fkv.fetch_handshake("127.0.0.1", port, decode.layout, SECRET)
        tid, cap = rng.randrange(1, 1 << 63), os.urandom(16)
        prefill_proc.call("offer_pull_under", tid, pblocks, TOKENS, cap)
        params = fkv.pull_params(info, tid, pblocks, TOKENS, cap, 2.0)
        dblocks = blocks_for(rng, DECODE["num_blocks"], DECODE["block_size"], TOKENS)
        decode.call("pull", tid, [params], dblocks, TOKENS)
        ok, code, msg, _, _ = decode.next_event("recv", tid, 30)
        assert ok, f"{code}: {msg}"
        assert prefill_proc.call("next_event", "send", tid, 30)[0]
        assert_landed(decode, dblocks, logical)

        # Another capability: decode reads (one-sided), but its DONE does not end the offer.
        tid2 = tid ^ 1
        prefill_proc.call("offer_pull_under", tid2, pblocks, TOKENS, os.urandom(16))
        stale0 = prefill_proc.call("stats")["messages_stale"]
        forged = fkv.pull_params(info, tid2, pblocks, TOKENS, os.urandom(16), 2.0)
        decode.call("pull", tid2, [forged], dblocks, TOKENS)
        assert decode.next_event("recv", tid2, 30)[0]
        ok, code, msg, _, _ = prefill_proc.call("next_event", "send", tid2, 30)
        assert not ok and code == "timeout", f"{code}: {msg}"
        assert prefill_proc.call("stats")["messages_stale"] > stale0
    finally:
        decode.close()


def test_a_read_under_the_pools_key_from_the_handshake_is_refused(provider, prefill_proc, rng):
    """The pool's own key is in the handshake, which any decode holds. Under per-offer keys (the
    default) prefill registers its pool without peer reads: parameters built from the handshake
    read nothing and fail naming why, while the offer's own parameters deliver every byte. On
    shm with cross-memory attach the reader copies with process_vm_readv and nothing checks a
    key (docs/SERVING.md, "Known limits"): there the read is not refused, as documented."""
    import os

    decode, _, pblocks, logical = open_pair(provider, prefill_proc, SPLITS[0], rng)
    try:
        port = prefill_proc.call("serve_handshake", SECRET)
        info = fkv.fetch_handshake("127.0.0.1", port, decode.layout, SECRET)
        tid = rng.randrange(1, 1 << 63)
        params = prefill_proc.call("call", "offer_pull", tid, pblocks, TOKENS)
        dblocks = blocks_for(rng, DECODE["num_blocks"], DECODE["block_size"], TOKENS)
        decode.call("pull", tid, [params], dblocks, TOKENS)
        ok, code, msg, _, _ = decode.next_event("recv", tid, 30)
        assert ok, f"{code}: {msg}"
        assert_landed(decode, dblocks, logical)  # every byte, the rest still poisoned
        assert prefill_proc.call("next_event", "send", tid, 30)[0]

        forged = fkv.pull_params(info, tid ^ 1, pblocks, TOKENS, os.urandom(16), 2.0)
        decode.call("pull", tid ^ 1, [forged], dblocks, TOKENS)
        ok, code, msg, _, _ = decode.next_event("recv", tid ^ 1, 60)
        if provider == "tcp" or os.environ.get("FI_SHM_DISABLE_CMA") == "1":
            assert not ok, "a read under the pool's key from the handshake succeeded"
            assert "under the pool's own keys" in msg, msg
            assert_landed(decode, dblocks, logical)  # nothing else landed
        else:
            assert ok, f"shm refused a read under the pool's key (update SERVING.md): {msg}"
    finally:
        decode.close()


def handshake_params(prefill_proc, decode, rng, pblocks, tokens, lease=20.0):
    """Decode builds a pull's parameters from prefill's handshake under a fresh transfer id and
    capability, as vLLM's does: (handshake info, transfer id, capability, parameters)."""
    import os

    port = prefill_proc.call("serve_handshake", SECRET)
    info = fkv.fetch_handshake("127.0.0.1", port, decode.layout, SECRET)
    tid, cap = rng.randrange(1, 1 << 63), os.urandom(16)
    return info, tid, cap, fkv.pull_params(info, tid, pblocks, tokens, cap, lease)


def offer_live(prefill_proc, decode, rng, pblocks, tokens, lease=20.0):
    """handshake_params, and prefill offers `pblocks` under that capability."""
    info, tid, cap, params = handshake_params(prefill_proc, decode, rng, pblocks, tokens, lease)
    prefill_proc.call("offer_pull_under", tid, pblocks, tokens, cap)
    return info, tid, cap, params


def test_a_pull_asking_for_an_offer_that_ended_is_refused_and_lands_nothing(
        provider, prefill_proc, rng):
    """vLLM's decode builds its parameters from the handshake and what the request carried
    (kv_transfer_params), so a captured request can be replayed after its offer ended, when
    prefill's blocks hold another request's KV (issue 30). Asking prefill for the live offer
    (live_offer_wait) reads under the offer's own keys; once the offer ended the ask is refused
    at once, naming why, on every provider (shm's cross-memory attach included: nothing is
    read), and nothing lands. A wrong capability is refused too."""
    import os

    decode, _, pblocks, logical = open_pair(provider, prefill_proc, SPLITS[0], rng, lease=20.0)
    try:
        info, tid, cap, params = offer_live(prefill_proc, decode, rng, pblocks, TOKENS)
        dblocks = blocks_for(rng, DECODE["num_blocks"], DECODE["block_size"], TOKENS)
        decode.call("pull", tid, [params], dblocks, TOKENS, live_offer_wait=5.0)
        ok, code, msg, _, _ = decode.next_event("recv", tid, 30)
        assert ok, f"{code}: {msg}"
        assert_landed(decode, dblocks, logical)
        assert prefill_proc.call("next_event", "send", tid, 30)[0]

        # The same parameters replayed: the offer ended, its blocks are prefill's again.
        others = [b for b in range(DECODE["num_blocks"]) if b not in dblocks]
        again = others[:len(dblocks)]
        t0 = time.monotonic()
        decode.call("pull", tid, [params], again, TOKENS, live_offer_wait=5.0)
        ok, code, msg, _, _ = decode.next_event("recv", tid, 30)
        assert not ok, "a replayed pull read an offer that had ended"
        assert "has ended" in msg, f"{code}: {msg}"
        assert time.monotonic() - t0 < 4.0, "refused only at the ask's wait, not at once"
        assert_landed(decode, dblocks, logical)  # the replay's blocks are still poisoned

        # A live offer asked with another capability: refused, nothing read.
        tid2, cap2 = tid ^ 1, os.urandom(16)
        prefill_proc.call("offer_pull_under", tid2, pblocks, TOKENS, cap2)
        forged = fkv.pull_params(info, tid2, pblocks, TOKENS, os.urandom(16), 20.0)
        decode.call("pull", tid2, [forged], again, TOKENS, live_offer_wait=5.0)
        ok, code, msg, _, _ = decode.next_event("recv", tid2, 30)
        assert not ok and "capability" in msg, f"{code}: {msg}"
        assert_landed(decode, dblocks, logical)
        prefill_proc.call("call", "abort_send", tid2, "test over")
        assert not prefill_proc.call("next_event", "send", tid2, 30)[0]
        assert decode.call("stats")["active_recv"] == 0
    finally:
        decode.close()


def test_a_pull_whose_asked_offer_differs_ends_that_offer_at_once(provider, prefill_proc, rng):
    """A request naming other blocks than the live offer holds (altered kv_transfer_params):
    decode refuses to read, naming it, and tells prefill (DONE not ok), so prefill's blocks are
    free at once instead of at the end of its lease (20 s here)."""
    import os

    decode, _, pblocks, logical = open_pair(provider, prefill_proc, SPLITS[0], rng, lease=20.0)
    try:
        port = prefill_proc.call("serve_handshake", SECRET)
        info = fkv.fetch_handshake("127.0.0.1", port, decode.layout, SECRET)
        tid, cap = rng.randrange(1, 1 << 63), os.urandom(16)
        prefill_proc.call("offer_pull_under", tid, pblocks, TOKENS, cap)
        altered = list(reversed(pblocks))
        params = fkv.pull_params(info, tid, altered, TOKENS, cap, 20.0)
        dblocks = blocks_for(rng, DECODE["num_blocks"], DECODE["block_size"], TOKENS)
        t0 = time.monotonic()
        decode.call("pull", tid, [params], dblocks, TOKENS, live_offer_wait=5.0)
        ok, code, msg, _, _ = decode.next_event("recv", tid, 30)
        assert not ok and "not the one the request named" in msg, f"{code}: {msg}"
        ok, code, msg, _, _ = prefill_proc.call("next_event", "send", tid, 30)
        assert not ok, "prefill's offer ended as read"
        assert time.monotonic() - t0 < 10, "the offer was held to its lease"
        assert prefill_proc.call("stats")["active_send"] == 0
        assert decode.all_poison(), "a pull that refused to read wrote into its blocks"
    finally:
        decode.close()


def test_a_pull_asking_before_the_offer_is_made_reads_under_the_offers_keys(
        provider, prefill_proc, rng):
    """vLLM's decode may ask before prefill's worker offered (a step after prefill answered):
    the ask waits (bounded) for the offer, then reads under its own keys; with no offer at all
    the pull fails at the ask's wait, naming it, and nothing lands."""
    import os

    decode, _, pblocks, logical = open_pair(provider, prefill_proc, SPLITS[0], rng, lease=20.0)
    try:
        info, tid, cap, params = handshake_params(prefill_proc, decode, rng, pblocks, TOKENS)
        dblocks = blocks_for(rng, DECODE["num_blocks"], DECODE["block_size"], TOKENS)
        decode.call("pull", tid, [params], dblocks, TOKENS, live_offer_wait=10.0)
        time.sleep(0.5)  # the ask reached prefill, which has no offer yet
        prefill_proc.call("offer_pull_under", tid, pblocks, TOKENS, cap)
        ok, code, msg, _, _ = decode.next_event("recv", tid, 30)
        assert ok, f"{code}: {msg}"
        assert_landed(decode, dblocks, logical)
        ok, code, msg, _, _ = prefill_proc.call("next_event", "send", tid, 30)
        assert ok, f"{code}: {msg}"

        never = fkv.pull_params(info, tid ^ 1, pblocks, TOKENS, os.urandom(16), 20.0)
        others = [b for b in range(DECODE["num_blocks"]) if b not in dblocks][:len(dblocks)]
        decode.call("pull", tid ^ 1, [never], others, TOKENS, live_offer_wait=1.0)
        ok, code, msg, _, _ = decode.next_event("recv", tid ^ 1, 30)
        assert not ok and "no offer" in msg, f"{code}: {msg}"
        assert_landed(decode, dblocks, logical)
        assert prefill_proc.call("stats")["active_send"] == 0
    finally:
        decode.close()


def test_a_pull_asking_for_an_offer_of_many_windows_gets_its_answer_in_parts(
        provider, prefill_proc, rng):
    """A scattered request in vLLM's per-layer pool: the offer has one window per run of its
    blocks per region (here 32 layers x K/V x 40 runs), whose parameters do not fit one
    control message (64 KiB). Prefill answers the ask in parts, decode collects them all and
    reads every byte (before: refused, "do not fit a message")."""
    layers, tokens = 32, 640
    pkw = dict(PREFILL, num_layers=layers, num_blocks=96)
    dkw = dict(DECODE, num_layers=layers, num_blocks=100)
    prefill_proc.call("open", provider, pkw, "per-layer", {"lease": 20.0, "pull_keys": "offer"})
    prefill_proc.call("fill_random", rng.randrange(1 << 31))
    decode = KvSide(provider, dkw, "per-layer-kv", lease=20.0)
    try:
        # Even block ids only: no two of the request's blocks are adjacent, each is a run.
        pblocks = rng.sample(range(0, pkw["num_blocks"], 2), -(-tokens // pkw["block_size"]))
        logical = torch.from_numpy(prefill_proc.call("gather", pblocks, tokens))
        _, tid, _, params = offer_live(prefill_proc, decode, rng, pblocks, tokens)
        dblocks = blocks_for(rng, dkw["num_blocks"], dkw["block_size"], tokens)
        assert decode.all_poison()
        decode.call("pull", tid, [params], dblocks, tokens, live_offer_wait=5.0)
        ok, code, msg, nbytes, _ = decode.next_event("recv", tid, 60)
        assert ok, f"{code}: {msg}"
        assert nbytes == layers * 2 * tokens * HEADS * HEAD_DIM * 2
        problem = decode.check_pool(decode.expected_after(logical, dblocks, tokens))
        assert problem == "", problem
        ok, code, msg, _, _ = prefill_proc.call("next_event", "send", tid, 30)
        assert ok, f"{code}: {msg}"
        assert decode.call("stats")["active_recv"] == 0
    finally:
        decode.close()


def test_pull_read_before_the_offer_is_made(provider, prefill_proc, rng):
    """vLLM's decode may read, and send DONE, before prefill's worker offered the blocks (a
    step after prefill answered). The early DONE is kept and frees the blocks when the offer
    comes, not at the end of prefill's lease (before: held the whole lease, then a timeout)."""
    decode, _, pblocks, logical = open_pair(provider, prefill_proc, SPLITS[0], rng, lease=20.0,
                                            pull_keys="pool")
    try:
        _, tid, cap, params = handshake_params(prefill_proc, decode, rng, pblocks, TOKENS)
        dblocks = blocks_for(rng, DECODE["num_blocks"], DECODE["block_size"], TOKENS)
        decode.call("pull", tid, [params], dblocks, TOKENS)
        ok, code, msg, _, _ = decode.next_event("recv", tid, 30)
        assert ok, f"{code}: {msg}"
        assert_landed(decode, dblocks, logical)
        time.sleep(0.5)  # the DONE reached prefill, which has no offer yet
        t0 = time.monotonic()
        prefill_proc.call("offer_pull_under", tid, pblocks, TOKENS, cap)
        ok, code, msg, _, _ = prefill_proc.call("next_event", "send", tid, 30)
        assert ok, f"{code}: {msg}"
        assert time.monotonic() - t0 < 10, "released by the lease, not by the early DONE"
        assert prefill_proc.call("stats")["active_send"] == 0
    finally:
        decode.close()


def test_pull_params_mistakes(engine):
    conn = fkv.KvConnector(engine, fkv.KvLayout(**DECODE, regions="one"),
                           torch.zeros(fkv.KvLayout(**DECODE, regions="one").region_bytes // 2,
                                       dtype=torch.int16))
    try:
        info = conn.handshake_info()
        with pytest.raises(ferry.InvalidArgument, match="16 bytes, got 15"):
            fkv.pull_params(info, 1, [0], 8, b"x" * 15, 1.0)
        with pytest.raises(ferry.InvalidType, match="HandshakeInfo"):
            fkv.pull_params(b"info", 1, [0], 8, b"x" * 16, 1.0)
        with pytest.raises(ferry.InvalidArgument, match="16 zero bytes"):
            conn.offer_pull(5, [0], 8, capability=bytes(16))
        assert conn.stats()["active_send"] == 0
    finally:
        conn.close()


def test_cancel_before_prefill_done(provider, prefill_proc, rng):
    decode, addr, pblocks, _ = open_pair(provider, prefill_proc, SPLITS[0], rng)
    try:
        tid = rng.randrange(1 << 63)
        dblocks = blocks_for(rng, DECODE["num_blocks"], DECODE["block_size"], TOKENS)
        decode.call("register_push", tid, 1, [addr], dblocks, TOKENS)
        decode.call("cancel", tid)
        ok, code, msg, _, _ = decode.next_event("recv", tid, 20)
        assert not ok and code == "cancelled", f"{code}: {msg}"
        # Prefill finishes after the cancel: nothing is written, its blocks come back.
        prefill_proc.call("call", "prefill_done", tid, pblocks, TOKENS)
        ok, code, msg, _, writes = prefill_proc.call("next_event", "send", tid, 20)
        assert code == "cancelled" and writes == 0, f"{code}: {msg}, {writes} writes"
        assert decode.all_poison(), "a write landed after the cancel"
        assert decode.stats()["active_recv"] == 0
        assert prefill_proc.call("stats")["active_send"] == 0
    finally:
        decode.close()


def test_prefill_failed(provider, prefill_proc, rng):
    """Prefill reports that it cannot produce the KV: decode's receive fails carrying the
    reason, nothing lands, both sides hold nothing."""
    decode, addr, pblocks, _ = open_pair(provider, prefill_proc, SPLITS[1], rng)
    try:
        tid = rng.randrange(1 << 63)
        dblocks = blocks_for(rng, DECODE["num_blocks"], DECODE["block_size"], TOKENS)
        decode.call("register_push", tid, 1, [addr], dblocks, TOKENS)
        prefill_proc.call("call", "prefill_failed", tid, "the model ran out of memory")
        ok, code, msg, _, _ = decode.next_event("recv", tid, 20)
        assert not ok and "the model ran out of memory" in msg, f"{code}: {msg}"
        assert decode.all_poison(), "a write landed for a failed prefill"
        assert decode.stats()["active_recv"] == 0
        assert prefill_proc.call("stats")["active_send"] == 0
    finally:
        decode.close()


def test_prefill_killed_mid_transfer(provider, rng):
    """Prefill dies after its first chunk: decode's receive ends in an error within the lease,
    and decode holds no transfer (its blocks are all free)."""
    lease = 3.0
    victim = KvPeer()
    try:
        decode, addr, pblocks, _ = open_pair(provider, victim, SPLITS[0], rng, lease=lease)
        try:
            tid = rng.randrange(1 << 63)
            dblocks = blocks_for(rng, DECODE["num_blocks"], DECODE["block_size"], TOKENS)
            decode.call("register_push", tid, 1, [addr], dblocks, TOKENS)
            victim.call("call", "prefill_progress", tid, pblocks, 48)
            decode.next_event("progress", tid, 20)  # the first chunk is in
            victim.kill()
            t0 = time.monotonic()
            ok, code, msg, _, _ = decode.next_event("recv", tid, lease + 10)
            took = time.monotonic() - t0
            print(f"decode's receive ended after {took:.2f} s: {code}: {msg}")
            assert not ok, "a transfer whose producer died reported success"
            assert took <= lease + 2, f"the error came {took:.1f} s after the kill"
            assert decode.stats()["active_recv"] == 0
        finally:
            decode.close()
    finally:
        victim.close()


def test_close_after_a_peer_died_logs_nothing_about_ended_transfers(provider, rng, caplog):
    """Prefill dies with three transfers registered: each ends by its lease (one warning each,
    through logging), then decode's close() logs nothing. It printed a line per ended transfer
    ("sending CANCEL to peer 0 failed: cancelled: the transfer engine was shut down"; 17 in the
    issue)."""
    caplog.set_level(logging.INFO)
    lease = 1.5
    victim = KvPeer()
    try:
        decode, addr, pblocks, _ = open_pair(provider, victim, SPLITS[0], rng, lease=lease)
        try:
            tids = [rng.randrange(1 << 63) for _ in range(3)]
            free = rng.sample(range(DECODE["num_blocks"]), DECODE["num_blocks"])
            need = -(-TOKENS // DECODE["block_size"])
            for i, tid in enumerate(tids):
                decode.call("register_push", tid, 1, [addr], free[i * need:(i + 1) * need],
                            TOKENS)
            victim.call("call", "prefill_progress", tids[0], pblocks, 48)
            decode.next_event("progress", tids[0], 20)
            victim.kill()
            for tid in tids:
                ok, code, msg, _, _ = decode.next_event("recv", tid, lease + 10)
                assert not ok, f"transfer {tid:#x} ended {code}: {msg}"
            ferry._log.flush()
            expired = [r for r in caplog.records if r.name == "ferry.kv"
                       and "within the 1500 ms lease" in r.getMessage()]
            assert len(expired) == 3, [r.getMessage() for r in caplog.records]
            time.sleep(0.5)  # what the dead peer's connection does next, before close()
            ferry._log.flush()
        finally:
            caplog.clear()
            decode.close()
            ferry._log.flush()
        at_close = [f"{r.name} {r.levelname}: {r.getMessage()}" for r in caplog.records
                    if r.name.startswith("ferry")]
        assert at_close == [], "close() logged:\n" + "\n".join(at_close)
    finally:
        victim.close()


# Mistakes a Python user makes ------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    e = ferry.TransferEngine("tcp", same_host=True, op_timeout=2.0)
    yield e
    e.close()


def layout(regions="per-layer", **kw):
    return fkv.KvLayout(**dict(PREFILL, **kw), regions=regions)


def per_layer_pool(dtype=None, blocks=PREFILL["num_blocks"]):
    return [torch.zeros((2, blocks, 16, HEADS, HEAD_DIM), dtype=dtype or torch.bfloat16)
            for _ in range(LAYERS)]


def test_wrong_dtype(engine):
    with pytest.raises(ferry.InvalidArgument, match="wrong dtype.*elem_size=2"):
        fkv.KvConnector(engine, layout(), per_layer_pool(torch.float32))


def test_non_contiguous(engine):
    pool = per_layer_pool()
    pool[2] = pool[2].transpose(3, 4)
    with pytest.raises(ferry.InvalidArgument, match=r"pool\[2\]: a non-contiguous"):
        fkv.KvConnector(engine, layout(), pool)


def test_axes_in_another_order_are_refused(engine):
    """A per-layer tensor with its last two axes swapped has the right bytes for an NHD layout
    but holds its KV in another order: refused, naming the axis; an HND layout wants heads
    before the token axis."""
    pool = per_layer_pool()
    pool[1] = torch.zeros((2, PREFILL["num_blocks"], 16, HEAD_DIM, HEADS), dtype=torch.bfloat16)
    with pytest.raises(ferry.InvalidArgument,
                       match=r"pool\[1\]: shape \(2, 24, 16, 16, 2\) does not match the layout: "
                             r"axis 4 \(axis -1\) is 2, the layout's head_dim is 16"):
        fkv.KvConnector(engine, layout(), pool)
    with pytest.raises(ferry.InvalidArgument, match=r"axis 3 \(axis -2\) is 2, the layout's "
                                                    r"block_size is 16 \(HND"):
        fkv.KvConnector(engine, layout(order="HND"), per_layer_pool())
    hnd = [torch.zeros((2, PREFILL["num_blocks"], HEADS, 16, HEAD_DIM), dtype=torch.bfloat16)
           for _ in range(LAYERS)]
    fkv.KvConnector(engine, layout(order="HND"), hnd).close()
    assert engine.stats()["regions_registered"] == 0


def test_head_joint_pools_in_vllm_cpu_shape_are_accepted(engine):
    """vLLM 0.32's CPU KV cache, [blocks, heads, block_size, 2 * head_dim] per layer, and the
    same bytes as [blocks, heads, 2, block_size, head_dim], fit a head-joint layout; a tensor
    with the token and head axes swapped is refused."""
    lay = layout(placement="head-joint", order="HND")
    nb = PREFILL["num_blocks"]
    for shape in ((nb, HEADS, 16, 2 * HEAD_DIM), (nb, HEADS, 2, 16, HEAD_DIM)):
        fkv.KvConnector(engine, lay, [torch.zeros(shape, dtype=torch.bfloat16)
                                      for _ in range(LAYERS)]).close()
    swapped = [torch.zeros((nb, 16, HEADS, 2 * HEAD_DIM), dtype=torch.bfloat16)
               for _ in range(LAYERS)]
    with pytest.raises(ferry.InvalidArgument, match=r"pool\[0\]: shape \(24, 16, 2, 32\) does "
                                                    r"not match the head-joint layout"):
        fkv.KvConnector(engine, lay, swapped)
    assert engine.stats()["regions_registered"] == 0


def test_elem_size_must_be_an_element_size():
    with pytest.raises(ferry.InvalidArgument, match="elem_size 3 is not the size of an element"):
        fkv.KvLayout(**dict(PREFILL, elem_size=3))


def test_region_too_small(engine):
    with pytest.raises(ferry.InvalidArgument, match=r"pool\[0\]: region too small"):
        fkv.KvConnector(engine, layout(), per_layer_pool(blocks=PREFILL["num_blocks"] - 1))


def test_pool_split_differs_from_layout(engine):
    with pytest.raises(ferry.InvalidArgument, match="split 'per-layer'.*regions='one'"):
        fkv.KvConnector(engine, layout("one"), per_layer_pool())


def test_bad_layout():
    with pytest.raises(ferry.InvalidArgument, match="region split"):
        fkv.KvLayout(**PREFILL, regions="per-head")


def test_bad_descriptors(engine):
    with fkv.KvConnector(engine, layout(), per_layer_pool()) as conn:
        with pytest.raises(ferry.Error, match=r"bad engine address in prefill_ranks\[0\]"):
            conn.register_push(1, 1, [b"not an address"], [0, 1], 20)
        with pytest.raises(ferry.Error, match=r"bad pull parameters in params\[0\]"):
            conn.pull(2, [b"\x00" * 40], [0, 1], 20)
        with pytest.raises(ferry.InvalidArgument, match="blocks"):
            conn.prefill_done(3, [0, -1], 20)
        # Nothing was left behind by the refused calls.
        assert conn.stats()["active_recv"] == 0 and conn.stats()["active_send"] == 0


def test_dead_peer_handshake(engine):
    with fkv.KvConnector(engine, layout(), per_layer_pool()) as conn:
        server = fkv.HandshakeServer(conn, SECRET)
        port = server.port
        with pytest.raises(ferry.PermissionDenied):
            fkv.fetch_handshake("127.0.0.1", port, conn.layout, b"another-secret-of-32-bytes-long")
        server.close()
        # Nobody listens any more: the error names the endpoint.
        with pytest.raises(ferry.Error, match=f"127.0.0.1:{port}"):
            fkv.fetch_handshake("127.0.0.1", port, conn.layout, SECRET, timeout=2.0)


def test_incompatible_layout_names_both_layouts_and_the_field(engine):
    """A caller whose layout differs from the server's: the error named only the caller's hash.
    Now both layouts and the field that differs, with its two values."""
    with fkv.KvConnector(engine, layout(), per_layer_pool()) as conn:
        with fkv.HandshakeServer(conn, SECRET) as server:
            mine = layout(head_dim=HEAD_DIM * 2)
            with pytest.raises(ferry.InvalidArgument) as e:
                fkv.fetch_handshake("127.0.0.1", server.port, mine, SECRET)
    msg = str(e.value)
    assert f"head_dim differs ({HEAD_DIM} at the peer, {HEAD_DIM * 2} here)" in msg, msg
    assert f"head_dim={HEAD_DIM} " in msg and f"head_dim={HEAD_DIM * 2} " in msg, msg
    assert "num_layers" not in msg and "elem_size" not in msg, msg


def test_closed_connector(engine):
    conn = fkv.KvConnector(engine, layout(), per_layer_pool())
    conn.close()
    with pytest.raises(ferry.Cancelled, match="KV connector is closed"):
        conn.cancel(1)


def test_cancel_and_abort_of_unknown_ids_are_no_ops(engine):
    """vLLM's abort path reports requests the connector never saw (aborted before any KV was
    registered or offered): cancel() and abort_send() of an id with no transfer here return
    None, queue no event and change no counter, however often; the id stays free, and the same
    calls on a live transfer do end it."""
    with fkv.KvConnector(engine, layout(), per_layer_pool()) as conn:
        before = conn.stats()
        for _ in range(2):
            assert conn.cancel(0x77) is None
            assert conn.abort_send(0x78, "client left") is None
        assert conn.wait(0.3) is False and conn.poll() == []
        assert conn.stats() == before
        # 0x78 was never taken: an offer of it is accepted, and abort_send withdraws it.
        conn.offer_pull(0x78, [0, 1], 20)
        conn.abort_send(0x78, "client left")
        assert conn.wait(5.0)
        events = conn.poll()
        assert [(ev.kind, ev.transfer_id, ev.ok) for ev in events] == [("send", 0x78, False)]
        assert "client left" in events[0].message
        assert conn.stats()["active_send"] == 0


def test_unpolled_events_are_bounded_and_the_overflow_is_reported(engine):
    """Events a caller does not poll grew without a cap. Now at most KvConfig.max_events wait;
    the next poll() hands those over and ends with one "overflow" event counting the others,
    and the queue takes events again afterwards."""
    with pytest.raises(ferry.InvalidArgument, match="max_events must be at least 1"):
        fkv.KvConnector(engine, layout(), per_layer_pool(), fkv.KvConfig(max_events=0))
    with fkv.KvConnector(engine, layout(), per_layer_pool(),
                         fkv.KvConfig(max_events=8)) as conn:
        def end_transfers(ids):
            for tid in ids:  # each ends in one "send" event at once
                conn.offer_pull(tid, [2 * (tid % 12), 2 * (tid % 12) + 1], 20)
                conn.abort_send(tid, "client left")

        end_transfers(range(1, 21))
        deadline = time.monotonic() + 10
        while conn.stats()["transfers_failed"] < 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # the last events are queued just after the count
        events = conn.poll()
        assert [ev.kind for ev in events] == ["send"] * 8 + ["overflow"], events
        assert [ev.transfer_id for ev in events[:8]] == list(range(1, 9))
        overflow = events[-1]
        assert overflow.dropped == 12 and not overflow.ok
        assert overflow.code == "resource exhausted"
        assert "12 events were dropped" in overflow.message
        assert "max_events" in overflow.message
        with pytest.raises(ferry.ResourceExhausted, match="12 events were dropped"):
            overflow.raise_if_error()
        end_transfers([21])
        assert conn.wait(5.0)
        assert [(ev.kind, ev.transfer_id) for ev in conn.poll()] == [("send", 21)]


def test_refused_config_leaves_nothing(engine):
    """A connector ferry refuses (a TP rank outside the TP size) leaves no region registered
    and no message handler behind: the same engine and tensors serve the next one."""
    pool = per_layer_pool()
    with pytest.raises(ferry.InvalidArgument, match="TP rank 2 is outside TP size 2"):
        fkv.KvConnector(engine, layout(), pool, fkv.KvConfig(tp_rank=2, tp_size=2))
    with pytest.raises(ferry.InvalidArgument, match="lease must be a finite number"):
        fkv.KvConnector(engine, layout(), pool, fkv.KvConfig(lease=float("nan")))
    with fkv.KvConnector(engine, layout(), pool) as conn:
        assert len(conn.handshake_info().pool) == LAYERS


def test_transfer_names(engine):
    """vLLM names requests by strings: a connector takes them (and bytes) as transfer ids, its
    events carry the name back, and it keeps a name only while the transfer is open on it; a
    refused call keeps none. The 64-bit id is transfer_key(name), FNV-1a of the UTF-8 bytes,
    the same on every host and build (ferry serve's)."""
    assert fkv.transfer_key("a") == 0xAF63DC4C8601EC8C
    assert fkv.transfer_key(b"a") == fkv.transfer_key("a")
    with pytest.raises(ferry.InvalidType, match="str or bytes"):
        fkv.transfer_key(7)
    with fkv.KvConnector(engine, layout(), per_layer_pool()) as conn:
        name = "cmpl-4f1c-0"
        conn.offer_pull(name, [0, 1], 20)
        assert conn.open_names == 1
        conn.abort_send(name, "client left")
        assert conn.wait(5.0)
        (ev,) = conn.poll()
        assert (ev.kind, ev.request_id, ev.transfer_id) == ("send", name,
                                                            fkv.transfer_key(name))
        assert repr(name) in repr(ev)
        assert conn.open_names == 0
        # Refused calls keep no name.
        with pytest.raises(ferry.Error, match=r"bad engine address"):
            conn.register_push("req-2", 1, [b"not an address"], [0, 1], 20)
        with pytest.raises(ferry.InvalidArgument, match="listed twice"):
            conn.prefill_done(b"req-3", [4, 4], 20)
        conn.cancel("never-seen")
        assert conn.open_names == 0 and conn.poll() == []
        with pytest.raises(ferry.InvalidType, match="transfer_id must be an int, a str or bytes"):
            conn.cancel(1.5)
        # An int id is its own 64-bit id, as before.
        conn.offer_pull(0x79, [2, 3], 20)
        conn.abort_send(0x79, "client left")
        assert conn.wait(5.0)
        (ev,) = conn.poll()
        assert ev.request_id == ev.transfer_id == 0x79 and conn.open_names == 0


def test_partial_range_mistakes(engine):
    """first_token past num_tokens, or too few blocks for the range, is refused naming it."""
    with fkv.KvConnector(engine, layout(), per_layer_pool()) as conn:
        addr = engine.address
        with pytest.raises(ferry.InvalidArgument, match="first_token 30 is past"):
            conn.register_push("r", 1, [addr], [0], 20, first_token=30)
        with pytest.raises(ferry.InvalidArgument,
                           match=r"tokens \[20, 40\) need 2 blocks of 16 .*token 16\), 1 given"):
            conn.register_push("r", 1, [addr], [0], 40, first_token=20)
        assert conn.open_names == 0


def test_an_engine_that_lost_its_rail_says_so_and_its_connector_takes_no_new_transfer():
    """TransferEngine.health names a wedged rail (here held inside one call by the test hook
    until the real watchdog declares it, at least 5 s); a KvConnector on that engine refuses
    a new transfer at once, naming why, instead of letting it wait for its lease."""
    engine = ferry.TransferEngine("tcp", op_timeout=1.0)
    try:
        conn = fkv.KvConnector(engine, layout(), per_layer_pool())
        assert engine.health is None
        t0 = time.monotonic()
        engine._engine._wedge_rail_for_test(0, 30.0)
        assert "stuck inside one provider call" in (engine.health or ""), engine.health
        assert time.monotonic() - t0 < 25
        with pytest.raises(ferry.Unavailable, match="can take no new transfer.*stuck inside"):
            conn.register_push(7, 1, [engine.address], [0, 1], 20)
        conn.close()
    finally:
        engine.close()
