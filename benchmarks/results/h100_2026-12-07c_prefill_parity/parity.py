"""Where do compiled prompt forwards part from eager ones? One prompt's prefill (its last logits and its KV rows)
and then 48 greedy tokens decoded eagerly from that cache, for: a batch-1 cache (bench decode's batch-1 engine),
alone in a batch-16 cache, and beside a second prompt in a bucket of two (a batch-16 engine's admissions).
Eager, and compiled with symbolic shapes (the twelfth run's patch), with three attentions:
  sdpa  F.scaled_dot_product_attention(enable_gqa), as the runtime calls it on a GPU
  folded  each KV head's query heads folded into its rows (no enable_gqa), as on a CPU
  opaque  sdpa inside a custom op: inductor does not see it, so it runs the eager kernel
usage: python parity.py <target dir> <device> [variants, comma-separated]"""

import sys
import time

import torch
import torch.nn.functional as F
from torch import Tensor

from draftsmith.serve import model as m
from draftsmith.serve.graphs import GraphedPrefill
from draftsmith.serve.weights import load_model

target_dir, device = sys.argv[1], sys.argv[2]
variants = (sys.argv[3] if len(sys.argv) > 3 else "sdpa,folded,opaque").split(",")
BUCKET, NEW = 64, 48


@torch.library.custom_op("paritydiag::sdpa", mutates_args=())
def opaque_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, gqa: bool) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa).contiguous()


@opaque_sdpa.register_fake
def _(q, k, v, mask, scale, gqa):
    return q.new_empty(q.shape)


def attend_with(kind):
    def attend(self, q, keys, values, mask):
        B, T = q.shape[:2]
        gqa = self.args.num_heads != self.args.num_kv_heads
        qt = q.transpose(1, 2)
        if kind == "folded":
            y = m.folded_attention(qt, keys, values, mask, self.scale)
        elif kind == "opaque":
            y = opaque_sdpa(qt.contiguous(), keys.contiguous(), values.contiguous(), mask.contiguous(), self.scale, gqa)
        else:
            y = F.scaled_dot_product_attention(qt, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))

    return attend


model = load_model(target_dir, torch.bfloat16, device)
V = model.args.vocab_size
g = torch.Generator().manual_seed(0)
p1 = torch.randint(100, V, (37,), generator=g).tolist()
p2 = torch.randint(100, V, (53,), generator=g).tolist()
state1 = model.setup_cache(1, 256)
state16 = model.setup_cache(16, 256)
# None: a padding row (the spare slot of the first prompt's cache row, as GraphedPrefill pads a bucket)
CASES = {
    "b1 cache, alone": (state1, [p1], [0]),
    "b16 cache, alone": (state16, [p1], [3]),
    "b16 cache, pair": (state16, [p1, p2], [3, 7]),
    "b1 cache, padded to 2 rows": (state1, [p1, None], [0, 0]),
    "b16 cache, padded to 2 rows": (state16, [p1, None], [3, 3]),
    # added after the run, for the next: the same prompts in longer buckets (a batch-16 engine pads a pair to its longer
    # prompt's bucket, and 16 joining at once to the longest's)
    "b16 cache, pair, 128-token bucket": (state16, [p1, p2], [3, 7], 128),
    "b16 cache, 16 rows, 256-token bucket": (state16, [p1, p2] * 8, list(range(3, 16)) + [0, 1, 2], 256),
}


@torch.inference_mode()
def run_case(state, prompts, rows, graphed, BUCKET=BUCKET):
    model.use_cache(state)
    for c in state.caches:  # other rows hold text: a prefill must leave them as they were
        c.k.normal_(generator=None), c.v.normal_()
    before = [(c.k.clone(), c.v.clone()) for c in state.caches]
    B = len(prompts)
    tokens = torch.zeros(B, BUCKET, dtype=torch.long)
    positions = torch.arange(BUCKET).repeat(B, 1)
    for i, p in enumerate(prompts):
        if p is None:
            positions[i] = model.max_seq_len
        else:
            tokens[i, : len(p)] = torch.tensor(p)
    tokens, positions = tokens.to(device), positions.to(device)
    at = torch.tensor([[len(p or [0]) - 1] for p in prompts], device=device)
    cache_rows = torch.tensor(rows, device=device)
    if graphed:  # as the scheduler admits: the prompt graph of the bucket, captured on this cache
        T = max(len(p or [0]) for p in prompts)
        lengths = torch.tensor([len(p or [0]) for p in prompts], device=device)
        logits = GraphedPrefill(model, (), enabled=True)(tokens[:, :T], positions[:, :T], lengths, cache_rows)[0][0].float()
    else:
        logits = model(tokens, positions, fused=True, logits_at=at, cache_rows=cache_rows)[0, 0].float()
    row, n = rows[0], len(p1)
    kv = torch.stack([torch.stack([c.k[row, :, :n].float(), c.v[row, :, :n].float()]) for c in state.caches])  # [L, 2, H, n, D]
    others = torch.ones(state.caches[0].k.shape[0], dtype=torch.bool)
    others[rows] = False
    changed = max(
        max((c.k[others] != k[others]).sum().item(), (c.v[others] != v[others]).sum().item()) for c, (k, v) in zip(state.caches, before)
    )
    spare = [(c.k[:, :, -1] != k[:, :, -1]).any(-1).any(-1).nonzero().flatten().tolist() for c, (k, _) in zip(state.caches, before)][0]
    print(f"  other rows' KV entries changed: {changed}; rows whose spare slot changed: {spare}", flush=True)
    out, last = [], int(logits.argmax())
    for i in range(NEW):  # eager greedy decode from this cache row (the same path for every case)
        out.append(last)
        pos = torch.tensor([[n + i]], device=device)
        nxt = model(torch.tensor([[last]], device=device), pos, cache_rows=cache_rows[:1])
        last = int(nxt[0, -1].argmax())
    return logits, kv, out


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


print(f"{torch.cuda.get_device_name() if device.startswith('cuda') else device}, torch {torch.__version__}")
print("Each row against the eager b1 row, then against its own forward's b1 row.")
print(
    "| attention | case | forward | logits: max abs diff | same argmax | KV: max abs diff (first layer > 0) | tokens part at | vs own b1: logits, KV, tokens |"
)
print("|---|---|---|---:|---|---:|---:|---|")
for kind in variants:
    m.Attention.attend = attend_with(kind)
    torch._dynamo.reset()
    ref = None
    for fused in (False, True):
        compiled = torch.compile(m._run_block, fullgraph=True, dynamic=True) if fused else None
        model.fused_block = model.fused_prompt_block = compiled
        own = None
        # through GraphedPrefill (it picks its own bucket): the placements without padding rows or a bucket of their own
        graphed_cases = [(True, c) for c in CASES.items() if None not in c[1][1] and len(c[1]) == 3] if device.startswith("cuda") else []
        for graphed, (name, (state, prompts, rows, *length)) in [(False, c) for c in CASES.items()] + graphed_cases:
            t = time.time()
            name = name + (", graphed" if graphed else "")
            logits, kv, out = run_case(state, prompts, rows, graphed, *length)
            ref = ref or (logits, kv, out)
            own = own or (logits, kv, out)
            dk = (kv - ref[1]).abs()
            per_layer = dk.flatten(1).amax(1)
            first = next((i for i, x in enumerate(per_layer.tolist()) if x > 0), None)
            print(
                f"| {kind} | {name} | {'compiled' if fused else 'eager'} | {(logits - ref[0]).abs().max().item():.4g} | "
                f"{int(logits.argmax()) == int(ref[0].argmax())} | {dk.max().item():.4g} ({first}) | {first_diff(out, ref[2])} | "
                f"{(logits - own[0]).abs().max().item():.4g}, {(kv - own[1]).abs().max().item():.4g}, {first_diff(out, own[2])} |"
                + (f" {time.time() - t:.1f} s" if fused else ""),
                flush=True,
            )
