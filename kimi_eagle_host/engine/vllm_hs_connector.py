"""A vLLM KV connector that writes kimi-eagle hidden-state samples (vLLM >= 0.18, native extraction).

vLLM's `extract_hidden_states` speculative method stores the requested layers' hidden states of every prompt
token in a KV-cache-like buffer ([blocks, layers, block_size, hidden]); a KV connector copies them out when a
request finishes. vLLM's own ExampleHiddenStatesConnector does that with CUDA events, a CUDA copy stream and
pinned memory, so its worker dies on a CPU-only vLLM, and it writes `{req_id}.safetensors` without the loss
mask. This subclass keeps its scheduler-side bookkeeping (which blocks hold which request) and replaces the
copy-out and the write:

  * CUDA: gather on a side stream that waits for the forward, copy into pinned host memory asynchronously,
    record an event; the writer thread waits on the event. The request's blocks are released (finished
    sending) only after the copy is done, never before.
  * CPU: the buffer already lives in host memory; the gather is a copy, done right away.
  * The sample is `hs_{i}.safetensors` with token_ids int64 [T], hidden_states [T, L, H], loss_mask int64 [T]
    (our format), written to a temp name and os.replace()d: a file that exists is complete. The path and the
    loss mask come from the request's kv_transfer_params (`hidden_states_path`, `kimi_eagle_loss_mask`),
    which extract.py sets per sample; a failed write leaves `.hs_{i}.error` with the reason instead.

Loaded by vLLM in every worker through kv_transfer_config = {"kv_connector": "KimiEagleHiddenStatesConnector",
"kv_connector_module_path": "vllm_hs_connector", ...}; extract puts this folder on the workers' PYTHONPATH.
"""
import os
from dataclasses import dataclass, field

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector, PendingSave, extract_from_kv_cache)

from kimi_eagle_host.data.hidden_state_files import error_path, tmp_path

LOSS_MASK_KEY = "kimi_eagle_loss_mask"


@dataclass
class SamplePendingSave(PendingSave):
    loss_mask: list = field(default_factory=list)


class _CopyDone:
    """Stands in for a CUDA event when the copy-out already happened (CPU)."""

    def query(self):
        return True

    def synchronize(self):
        pass


class KimiEagleHiddenStatesConnector(ExampleHiddenStatesConnector):

    # ---- scheduler side: carry the loss mask from the request to the worker ----
    def request_finished(self, request, block_ids):
        delay, params = super().request_finished(request, block_ids)
        pending = self._pending_saves.get(request.request_id)
        if pending is not None:
            mask = (request.kv_transfer_params or {}).get(LOSS_MASK_KEY) or []
            self._pending_saves[request.request_id] = SamplePendingSave(
                req_id=pending.req_id, filename=pending.filename, token_ids=pending.token_ids,
                block_ids=pending.block_ids, loss_mask=list(mask))
        return delay, params

    # ---- worker side ----
    def _gather(self, block_ids, num_tokens):
        """[T, L, H] of one request. The cache's layout changed between releases ([blocks, block_size, L, H] at
        0.25, [blocks, L, block_size, H] at 0.32): vLLM's own extract_from_kv_cache of the installed release
        knows which, so the slot arithmetic here stays layout-free."""
        bs = self._block_size
        blocks = torch.as_tensor(block_ids, dtype=torch.long)
        slots = (blocks[:, None] * bs + torch.arange(bs, dtype=torch.long)[None, :]).reshape(-1)[:num_tokens]
        if self._kv_cache.is_cuda:
            slots = slots.to(self._kv_cache.device, non_blocking=True)
        return extract_from_kv_cache(self._kv_cache, slots, num_tokens)

    def _submit_async_write(self, pending):
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None, "register_kv_caches was not called"
        num_tokens = int(pending.token_ids.shape[0])
        if self._kv_cache.is_cuda:
            stream = self._get_copy_stream()
            stream.wait_stream(torch.cuda.current_stream())  # the forward that filled the cache comes first
            with torch.cuda.stream(stream):
                gathered = self._gather(pending.block_ids, num_tokens)
                host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
                host.copy_(gathered, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        else:
            host = self._gather(pending.block_ids, num_tokens)  # advanced indexing: a copy, cache may be reused
            done = _CopyDone()
        mask = torch.as_tensor(getattr(pending, "loss_mask", None) or [0] * num_tokens, dtype=torch.int64)
        future = self._executor.submit(_write_sample, pending.filename, pending.token_ids.to(torch.int64),
                                       host, mask, done)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(lambda f, rid=pending.req_id: self._req_futures.pop(rid, None))


def _write_sample(path, token_ids, hidden_states, loss_mask, done):
    """Writer thread: wait for the copy, write tmp, rename. Errors land next to the sample for the driver."""
    tmp = tmp_path(path)
    try:
        done.synchronize()
        if loss_mask.shape[0] != token_ids.shape[0]:
            raise ValueError(f"loss mask has {loss_mask.shape[0]} entries for {token_ids.shape[0]} tokens")
        from safetensors.torch import save_file

        save_file({"token_ids": token_ids.contiguous(), "hidden_states": hidden_states.contiguous(),
                   "loss_mask": loss_mask.contiguous()}, tmp)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            if os.path.exists(tmp):
                os.unlink(tmp)
            with open(error_path(path), "w") as f:
                f.write(f"{type(e).__name__}: {e}\n")
        finally:
            raise
