"""FerryConnector's scheduler half on its own: what it tells the workers, step by step, for push
prefill requests that vLLM computes in chunks (chunked prefill), preempts, or aborts after some
of their KV went out. The steps are built with the names of the installed vLLM's
SchedulerOutput fields (checked below against its dataclasses, so a rename fails here). The
end-to-end case, real engines with chunked prefill, is test_pd's
test_a_prompt_computed_in_chunks_is_written_chunk_by_chunk. Runs where vLLM is installed
(build/vllm-venv); skipped elsewhere."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/vllm_venv.sh)")

from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa
from vllm.v1.request import RequestStatus  # noqa: E402

from ferry.vllm.connector import (FerryOptions, LayerSpec, _Scheduler,  # noqa: E402
                                  transfer_key)

BLOCK = 16


def test_the_fields_read_are_vllms():
    fields = lambda cls: {f.name for f in dataclasses.fields(cls)}  # noqa: E731
    assert {"scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens",
            "preempted_req_ids"} <= fields(SchedulerOutput)
    assert {"req_id", "prompt_token_ids", "block_ids", "num_computed_tokens"} <= \
        fields(NewRequestData)
    assert {"req_ids", "resumed_req_ids", "new_block_ids", "num_computed_tokens"} <= \
        fields(CachedRequestData)


class Prefill:
    """One push prefill request's life in the scheduler half: vLLM's calls, step by step."""

    def __init__(self, sched, req_id, prompt, tid):
        self.sched, self.req_id, self.prompt, self.tid = sched, req_id, prompt, tid
        self.request = SimpleNamespace(
            request_id=req_id, prompt_token_ids=prompt, status=RequestStatus.RUNNING,
            kv_transfer_params={"do_remote_decode": True, "ferry_transfer_id": tid})
        self.key = transfer_key(tid, prompt)
        self.blocks = []
        self.computed = 0
        self.sent_once = False

    def step(self, count, block_pool, preempted=(), resumed=False):
        """vLLM schedules `count` more prompt tokens of it: returns the step's metadata."""
        end = self.computed + count
        need = -(-end // BLOCK)
        added = [block_pool.pop() for _ in range(need - len(self.blocks))]
        if not self.sent_once:
            self.sched.after_alloc(self.request, None, 0)
        new, cached = [], CachedRequestData.make_empty()
        if not self.sent_once or resumed:
            self.blocks = self.blocks + added if not resumed else added
            new.append(SimpleNamespace(req_id=self.req_id, prompt_token_ids=self.prompt,
                                       block_ids=(list(self.blocks),),
                                       num_computed_tokens=self.computed))
            self.sent_once = True
        else:
            self.blocks += added
            cached.req_ids.append(self.req_id)
            cached.new_block_ids.append((added,) if added else None)
            cached.num_computed_tokens.append(self.computed)
        out = SimpleNamespace(scheduled_new_reqs=new, scheduled_cached_reqs=cached,
                              num_scheduled_tokens={self.req_id: count},
                              preempted_req_ids=set(preempted))
        self.sched.note_step(out)
        self.computed = end
        return self.sched.take_meta()

    def finish(self, status):
        self.request.status = status
        return self.sched.finished(self.request, list(self.blocks))


def pool():
    ids = list(range(1000))
    random.Random(7).shuffle(ids)
    return ids


@pytest.mark.parametrize("exact", [True, False])
def test_each_chunk_is_written_once_computed_and_the_last_layer_by_layer(exact):
    # 100 tokens in chunks of 40, 40, 20: the first two are written whole once computed (tokens
    # final up to their end: exactly, or their whole blocks where pages move whole), the last
    # layer by layer from where the chunks left off; the blocks named are the ones vLLM gave.
    sched = _Scheduler(FerryOptions(), BLOCK, exact_tokens=exact)
    prompt = list(range(3, 103))
    req, blocks = Prefill(sched, "r1", prompt, 11), pool()
    metas = [req.step(40, blocks), req.step(40, blocks), req.step(20, blocks)]
    assert metas[0].scheduled == [("r1", req.key)]
    got = [m.layers for m in metas]
    ends = [(40, 0), (80, 40), (100, 80)] if exact else [(32, 0), (80, 32), (112, 80)]
    want = [[LayerSpec("r1", req.key, req.blocks[:need], end, first, final)]
            for need, (end, first), final in zip((3, 5, 7), ends, (False, False, True))]
    assert got == want
    # Finished as vLLM finishes a prefill leg: the whole prompt goes (prefill_done sends what
    # the chunks left), the blocks held until the send ends.
    hold, params = req.finish(RequestStatus.FINISHED_LENGTH_CAPPED)
    assert hold and params["ferry_transfer_id"] == 11
    assert sched.take_meta().send[0].block_ids == req.blocks[:7]


def test_a_prompt_computed_in_one_step_is_written_layer_by_layer_as_before():
    sched = _Scheduler(FerryOptions(), BLOCK, exact_tokens=True)
    req = Prefill(sched, "r1", list(range(3, 53)), 12)
    meta = req.step(50, pool())
    assert meta.layers == [LayerSpec("r1", req.key, req.blocks, 50, 0, True)]


def test_nothing_is_written_early_where_the_worker_cannot():
    # GPU KV caches (layerwise=False from the platform) or layerwise off: whole requests only.
    for sched in (_Scheduler(FerryOptions(), BLOCK, exact_tokens=True, layerwise=False),
                  _Scheduler(FerryOptions(layerwise=False), BLOCK, exact_tokens=True)):
        req, blocks = Prefill(sched, "r1", list(range(3, 103)), 13), pool()
        assert [req.step(40, blocks).layers, req.step(60, blocks).layers] == [[], []]


def test_a_request_preempted_after_a_chunk_went_out_gives_its_transfer_up():
    # vLLM frees a preempted request's blocks, and may hand them to another request in the
    # same step: the worker must fail the transfer and wait for its writes before that step's
    # forward. The request computes again later; its KV then goes nowhere (decode's load failed
    # by its policy), and it is not reported scheduled again.
    sched = _Scheduler(FerryOptions(), BLOCK, exact_tokens=True)
    req, blocks = Prefill(sched, "r1", list(range(3, 103)), 14), pool()
    assert req.step(40, blocks).layers
    meta = req.step(0, blocks, preempted={"r1"})
    assert meta.preempted == [("r1", req.key)] and meta.layers == []
    req.computed = 0
    again = [req.step(60, blocks, resumed=True), req.step(40, blocks)]
    assert [(m.layers, m.scheduled, m.preempted) for m in again] == [([], [], [])] * 2
    assert req.finish(RequestStatus.FINISHED_LENGTH_CAPPED) == (False, None)
    assert not sched.take_meta().send and not sched.pending()


def test_a_request_preempted_before_anything_went_out_carries_on():
    sched = _Scheduler(FerryOptions(), BLOCK, exact_tokens=True)
    req, blocks = Prefill(sched, "r1", list(range(3, 13)), 15), pool()
    other = Prefill(sched, "r2", list(range(3, 103)), 16)
    other.step(40, blocks)
    meta = other.step(0, blocks, preempted={"r1"})  # r1 was waiting, never computed
    assert meta.preempted == []
    assert req.step(10, blocks).layers[0].final


def test_an_abort_after_a_chunk_went_out_holds_the_blocks_until_the_writes_end():
    sched = _Scheduler(FerryOptions(), BLOCK, exact_tokens=True)
    req, blocks = Prefill(sched, "r1", list(range(3, 103)), 17), pool()
    req.step(40, blocks)
    hold, params = req.finish(RequestStatus.FINISHED_ABORTED)
    assert (hold, params) == (True, None)
    (req_id, key, reason, held), = sched.take_meta().fail_send
    assert (req_id, key, held) == ("r1", req.key, True) and "FINISHED_ABORTED" in reason
    # Aborted before anything went out: freed at once, as before.
    other = Prefill(sched, "r2", list(range(3, 103)), 18)
    other.step(0, blocks)
    assert other.finish(RequestStatus.FINISHED_ABORTED) == (False, None)
    assert sched.take_meta().fail_send[0][3] is False
