"""CUDA graphs for the runtime's forwards: one graph per (batch, tokens) shape, captured on first use.

At this model size launch overhead, not memory bandwidth, bounds a decode step; replaying a graph
launches the whole forward at once. On CPU (or with graphs off) the same call runs eagerly.
"""
from __future__ import annotations

import torch
from torch import Tensor

from draftsmith.serve.model import Transformer


class GraphedForward:
    def __init__(self, model: Transformer, enabled: bool = True, compile_blocks: bool = True, max_tokens: int = 16):
        self.model = model
        device = model.output.weight.device
        self.enabled = enabled and device.type == "cuda"
        if self.enabled and compile_blocks:  # graphs remove launch gaps; compiling removes launches
            model.compile_blocks()
        self.max_tokens = max_tokens  # longer inputs (prefill) run eagerly
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor, Tensor, Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.enabled else None

    @torch.inference_mode()
    def __call__(self, tokens: Tensor, positions: Tensor) -> Tensor:
        B, T = tokens.shape
        if not self.enabled or T > self.max_tokens:
            return self.model(tokens, positions)
        entry = self.graphs.get((B, T)) or self._capture(B, T, tokens.device)
        graph, static_tokens, static_positions, static_logits = entry
        static_tokens.copy_(tokens)
        static_positions.copy_(positions)
        graph.replay()
        return static_logits

    def _capture(self, B: int, T: int, device: torch.device):
        static_tokens = torch.zeros(B, T, dtype=torch.long, device=device)
        # warm-up and capture write the cache's spare slot only
        static_positions = torch.full((B, T), self.model.max_seq_len, dtype=torch.long, device=device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # also compiles the fused blocks for this shape
                self.model(static_tokens, static_positions, fused=True)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            static_logits = self.model(static_tokens, static_positions, fused=True)
        self.graphs[(B, T)] = (graph, static_tokens, static_positions, static_logits)
        return self.graphs[(B, T)]
