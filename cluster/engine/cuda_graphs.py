"""Decode-only steps replayed from CUDA graphs, one graph per padded batch size.

On a GPU a decode step of a small model is bound by the host, not the device: every layer
launches about ten kernels (the Triton ones cost ~45 µs of Python each), 300 for the default
model, while the GPU needs a few µs for each. A graph records the whole forward once and
replays it with one launch. Steps that carry a prefill chunk run eagerly, as in vLLM.

A speculative verify step replays the same graphs: a request's last token and its k drafts
are 1 + k rows over one block table, row j's context ending at its own position. Each layer
stores all rows' KV before attending, so a draft attends to the drafts before it.

Everything the captured forward reads comes from one static int32 buffer, one row per
position, filled on the host and copied in one transfer per step:

    row i:  | token id | position | slot | context length | block table (width W) ... |
    pad:    |    0     |    0     |  -1  |       1        | (stale ids, never written)  |

A pad row stores nothing (store_kv skips slot -1) and attends to one cached position of
whatever block its stale table names: it reads, never writes, and its output is dropped.
W covers the longest sequence the engine admits, so no step is refused for length.

With `capture=False` the same padded forward runs eagerly on the same buffers: that is how
CPU tests check the row layout and the padding, which a GPU then replays.
"""

from __future__ import annotations

import torch

from cluster.models.attention import AttentionMetadata

PAD_ROW = (0, 0, -1, 1)  # token, position, slot (skipped), context length
_META = len(PAD_ROW)


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_batch (and max_batch itself)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


class DecodeGraphs:
    def __init__(self, model, kv_cache: torch.Tensor, block_size: int, max_model_len: int,
                 max_batch: int, capture: bool) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = capture_sizes(max_batch)
        self.max_batch = max_batch
        self.width = min(-(-max_model_len // block_size), kv_cache.shape[2])
        self.capture = capture
        self.host = torch.zeros(max_batch, _META + self.width, dtype=torch.int32, pin_memory=capture)
        self.host[:, :_META] = torch.tensor(PAD_ROW, dtype=torch.int32)
        self.rows = self.host.numpy()
        self.inputs = self.host.to(kv_cache.device, copy=True)  # a buffer of its own on CPU too
        self.copied = torch.cuda.Event() if capture else None
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.steps = 0  # steps run through the static buffers
        if capture:
            self._capture_all()

    def fits(self, num_seqs: int) -> bool:
        return 0 < num_seqs <= self.max_batch

    @torch.inference_mode()
    def run(self, rows: list[tuple[int, int, int, int, list[int]]]) -> torch.Tensor:
        """rows: (token id, position, slot, context length, block table) per decode sequence →
        hidden [len(rows), H], rows in order."""
        n = len(rows)
        size = next(s for s in self.sizes if s >= n)
        if self.copied is not None:
            self.copied.synchronize()  # the last step's copy has left the pinned buffer
        host = self.rows
        host[n:size, :_META] = PAD_ROW
        for i, (token, position, slot, length, table) in enumerate(rows):
            host[i, :_META] = (token, position, slot, length)
            host[i, _META:_META + len(table)] = table
        self.inputs[:size].copy_(self.host[:size], non_blocking=True)
        self.steps += 1
        if not self.capture:
            return self._forward(size)[:n]
        self.copied.record()
        graph, hidden = self.graphs[size]
        graph.replay()
        return hidden[:n]

    def _forward(self, size: int) -> torch.Tensor:
        rows = self.inputs[:size]
        meta = AttentionMetadata(
            slot_mapping=rows[:, 2].long(), num_decode_tokens=size,
            decode_block_tables=rows[:, _META:], decode_context_lens=rows[:, 3].contiguous(),
            prefills=())
        return self.model.forward(rows[:, 0].long(), rows[:, 1].long(), self.kv_cache, meta)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Largest first, all in one memory pool: smaller graphs reuse the largest's blocks."""
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: Triton compiles, cuBLAS picks its kernels
                self._forward(size)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(size)
            self.graphs[size] = (graph, hidden)
        torch.cuda.synchronize()
