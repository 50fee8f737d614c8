"""Context parallelism (CP) for the reference GPT: load-balanced sequence chunks and all-gather
attention, on any backend (gloo on CPU, NCCL on GPUs) and with any attention kernel.

Sharding. A sequence of S tokens is cut into 2*cp chunks of S/(2*cp) tokens; cp rank i holds
chunks i and 2*cp-1-i, in that order (Megatron-LM's and Llama 3's load balancing). Under a causal
mask chunk j attends to j+1 chunks of keys, so every rank computes (i+1) + (2*cp-i) = 2*cp+1
chunk pairs: equal work, where a contiguous split would give the last rank 2*cp-1 times the
first's. Inputs and targets are sharded the same way, so the loss of each rank is the mean over
its own S/cp tokens and the global-batch loss is the mean over the cp ranks.

Attention (Llama 3's all-gather CP, Dubey et al. 2024, section 3.3.2). Each rank all-gathers
the K and V of its local tokens over the cp group, puts the 2*cp chunks back in sequence order,
and for each of its two query chunks runs attention against the keys up to and including that
chunk with a lower-right-aligned causal mask, so no fully masked block is computed. It is exact
(the same softmax as one process, up to summation order), needs no online-softmax merging, and
works with every kernel including CPU SDPA, which torch's ring ``context_parallel`` does not
(it has no sharding rule for ``_scaled_dot_product_flash_attention_for_cpu``, checked on torch
2.13). The price against a ring: the gather is not overlapped with compute and each rank holds
the full K and V of one layer at a time; with grouped-query attention K and V are
``kv_heads / heads`` of Q's size (1/8 for Llama 3 70B), which is why Llama 3 chose it.

Gradients. The gather is autograd-aware (DTensor: Shard -> Replicate forward, the gradient
declared Partial): the gradients of the gathered K and V are summed back to the rank that
produced them (a reduce-scatter). So the sum over cp ranks of each rank's parameter gradient is the
gradient of the sum of their local losses, and cp joins data parallelism in the gradient
average (DDP / FSDP2 over the flattened ``dp_cp`` mesh axis), as in Megatron.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


def chunk_ids(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two sequence chunks (of 2*cp) that cp rank ``cp_rank`` holds, in local order."""
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank {cp_rank} outside [0, {cp})")
    return cp_rank, 2 * cp - 1 - cp_rank


def shard_sequence(x: torch.Tensor, *, cp_rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This rank's share of ``x`` along the sequence dimension ``dim`` (length divisible by
    2*cp): chunks ``chunk_ids(cp_rank, cp)`` concatenated."""
    if cp == 1:
        return x
    if x.shape[dim] % (2 * cp):
        raise ValueError(f"sequence length {x.shape[dim]} is not divisible by 2*cp={2 * cp}")
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[c] for c in chunk_ids(cp_rank, cp)], dim=dim)


def unshard_sequence(shards: list[torch.Tensor], *, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: the full sequence from every cp rank's share (index =
    cp rank)."""
    cp = len(shards)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, shard in enumerate(shards):
        first, second = shard.chunk(2, dim=dim)
        a, b = chunk_ids(rank, cp)
        chunks[a], chunks[b] = first, second
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


def global_positions(local_len: int, *, cp_rank: int, cp: int,
                     device: torch.device | str | None = None) -> torch.Tensor:
    """Positions (0 .. S-1) in the full sequence of this rank's ``local_len = S / cp`` tokens;
    they index the RoPE tables and learned position embeddings."""
    if local_len % 2:
        raise ValueError(f"local sequence length {local_len} must be even (two chunks)")
    size = local_len // 2
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device)
                      for c in chunk_ids(cp_rank, cp)])


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of the last ``q_len`` positions of a ``kv_len``-token prefix (mask
    aligned to the lower right). Layout [b, heads, len, head_dim]."""
    q_len, kv_len = q.shape[-2], k.shape[-2]
    if q_len == kv_len:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if q.device.type == "cuda":
        # Flash / memory-efficient kernels take the lower-right causal variant directly.
        from torch.nn.attention.bias import causal_lower_right

        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q_len, kv_len))
    # Query i (at prefix position kv_len - q_len + i) sees keys j <= kv_len - q_len + i.
    mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - q_len)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@dataclass(kw_only=True)
class ContextParallel:
    """This rank's place in the cp group, held by the model (no global state).

    ``mesh``: the 1-D cp DeviceMesh.
    """

    mesh: Any
    rank: int
    size: int

    def positions(self, local_len: int, device: torch.device | str | None = None
                  ) -> torch.Tensor:
        return global_positions(local_len, cp_rank=self.rank, cp=self.size, device=device)

    def gather_kv(self, kv: torch.Tensor) -> torch.Tensor:
        """[b, S/cp, ...] local -> [b, S, ...] in sequence order, differentiable.

        DTensor does the collective: the local shards form Shard(1) over the cp mesh, become
        Replicate (all-gather), and the gradient is declared Partial, so backward sums every
        rank's gradient of the gathered tensor and returns each rank its own slice
        (reduce-scatter). ``torch.distributed.nn.functional.all_gather`` would be the obvious
        call, but on gloo its backward passes group ranks to ``dist.scatter`` as global ranks
        and fails on any cp group that is not ranks 0..cp-1 (torch 2.13).
        """
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        gathered = DTensor.from_local(kv.contiguous(), self.mesh, [Shard(1)], run_check=False)
        parts = gathered.redistribute(self.mesh, [Replicate()]).to_local(
            grad_placements=[Partial()]).chunk(2 * self.size, dim=1)
        # parts[2r], parts[2r+1]: rank r's chunks (r, 2cp-1-r); put them in sequence order.
        ordered = [parts[2 * j] if j < self.size else parts[2 * (2 * self.size - 1 - j) + 1]
                   for j in range(2 * self.size)]
        return torch.cat(ordered, dim=1)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, rep: int
                  ) -> torch.Tensor:
        """Causal attention of the local queries over the whole sequence's keys.

        ``q`` [b, S/cp, heads, d]; ``k``, ``v`` [b, S/cp, kv_heads, d] (local tokens, RoPE
        applied with global positions); ``rep`` = heads / kv_heads. Returns [b, S/cp, heads, d].
        K and V travel as one tensor, before the GQA repeat (kv_heads, not heads).
        """
        d = k.shape[-1]
        full = self.gather_kv(torch.cat([k, v], dim=-1))
        k_all, v_all = full.split(d, dim=-1)
        if rep > 1:
            k_all = k_all.repeat_interleave(rep, dim=2)
            v_all = v_all.repeat_interleave(rep, dim=2)
        chunk = q.shape[1] // 2
        outs = []
        for local, chunk_id in enumerate(chunk_ids(self.rank, self.size)):
            q_c = q[:, local * chunk:(local + 1) * chunk]
            kv_len = (chunk_id + 1) * chunk
            out = _attend(q_c.transpose(1, 2), k_all[:, :kv_len].transpose(1, 2),
                          v_all[:, :kv_len].transpose(1, 2))
            outs.append(out.transpose(1, 2))
        return torch.cat(outs, dim=1)
