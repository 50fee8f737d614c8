"""Mixture-of-experts feed-forward: top-k router, Switch load-balancing loss, optional shared
experts, and expert parallelism with ``all_to_all_single`` dispatch and combine.

Dropless: every routed token is computed (no capacity factor), so the layer's result does not
depend on how experts are spread over ranks; EP=2 equals EP=1 up to float summation order.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainpilot.specs import ModelSpec


class AuxLossScaler(torch.autograd.Function):
    """Adds d(aux)/d(params) to the backward pass without changing the forward output.

    Megatron-LM's ``MoEAuxLossAutoScaler``: the auxiliary loss need not travel to the loss
    function, which keeps pipeline stages' interfaces plain tensors. ``aux`` already carries its
    coefficient and micro-batch scale.
    """

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad_output, torch.ones_like(aux)


class GroupedExperts(nn.Module):
    """This rank's experts as stacked weights ``w1/w3 [E_local, dim, width]``, ``w2 [E_local,
    width, dim]``. ``expert_offset`` is the global index of the first one (for init and EP)."""

    def __init__(self, *, num_experts: int, dim: int, width: int, swiglu: bool):
        super().__init__()
        self.num_global_experts = num_experts
        self.expert_offset = 0
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, width))
        self.w2 = nn.Parameter(torch.empty(num_experts, width, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, width)) if swiglu else None

    @property
    def num_local_experts(self) -> int:
        return self.w1.shape[0]

    def shard(self, ep_rank: int, ep_size: int) -> None:
        """Keep experts [ep_rank * E/ep, (ep_rank + 1) * E/ep) only (before initialisation)."""
        per_rank = self.num_global_experts // ep_size
        self.expert_offset = ep_rank * per_rank
        for name in ("w1", "w2", "w3"):
            weight = getattr(self, name)
            if weight is not None:
                local = weight.detach()[self.expert_offset:self.expert_offset + per_rank]
                setattr(self, name, nn.Parameter(torch.empty_like(local)))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``x`` holds tokens grouped by local expert, ``counts[e]`` of them for expert e."""
        outputs = []
        for e, chunk in enumerate(torch.split(x, counts)):
            hidden = chunk @ self.w1[e]
            if self.w3 is not None:
                hidden = F.silu(hidden) * (chunk @ self.w3[e])
            else:
                hidden = F.gelu(hidden, approximate="tanh")
            outputs.append(hidden @ self.w2[e])
        return torch.cat(outputs)


class MoE(nn.Module):
    """Routed experts (+ shared experts). Set ``ep_group`` to shard experts over ranks."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        from trainpilot.runtime.models.gpt import MLP

        moe = spec.moe
        assert moe is not None, "MoE layer on a dense spec"
        self.top_k = moe.top_k
        self.num_experts = moe.num_experts
        self.aux_coeff = moe.aux_loss_coeff
        # The trainer sets this to 1 / micro-batches (or 1 under a pipeline schedule, which
        # divides gradients itself) so the aux loss is averaged like the main loss.
        self.aux_scale = 1.0
        self.router = nn.Linear(spec.hidden_size, moe.num_experts, bias=False)
        self.experts = GroupedExperts(num_experts=moe.num_experts, dim=spec.hidden_size,
                                      width=moe.expert_intermediate_size,
                                      swiglu=spec.activation == "swiglu")
        self.shared = (MLP(spec.hidden_size, moe.shared_width, swiglu=spec.activation == "swiglu",
                           bias=spec.bias) if moe.num_shared_experts else None)
        self.ep_group: dist.ProcessGroup | None = None
        self._aux_sum: torch.Tensor | None = None  # not a buffer: built under the meta device
        self._aux_calls = 0

    def take_aux_loss(self) -> torch.Tensor:
        """Mean balance loss (without coefficient) over forwards since the last call; resets.
        (A recomputed forward repeats identical values, so the mean is unaffected.)"""
        mean = torch.zeros(()) if self._aux_sum is None else self._aux_sum / self._aux_calls
        self._aux_sum, self._aux_calls = None, 0
        return mean

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = self.router(tokens).float().softmax(dim=-1)
        top_p, top_i = probs.topk(self.top_k, dim=-1)
        weights = (top_p / top_p.sum(dim=-1, keepdim=True)).to(x.dtype)
        counts = torch.bincount(top_i.flatten(), minlength=self.num_experts)
        # Switch Transformer balance loss: E * sum_e (share of assignments to e) * (mean prob).
        share = counts.float() / top_i.numel()
        aux = self.num_experts * (share * probs.mean(dim=0)).sum()
        aux_value = aux.detach().float()
        self._aux_sum = aux_value if self._aux_sum is None else self._aux_sum + aux_value
        self._aux_calls += 1
        order = torch.argsort(top_i.flatten(), stable=True)
        token_index = order // self.top_k
        routed = self._run_experts(tokens[token_index], counts)
        routed = routed * weights.flatten()[order, None]
        out = torch.zeros_like(tokens).index_add(0, token_index, routed)
        if self.shared is not None:
            out = out + self.shared(tokens)
        if self.aux_coeff and self.training and torch.is_grad_enabled():
            out = AuxLossScaler.apply(out, aux * (self.aux_coeff * self.aux_scale))
        return out.view(shape)

    def _run_experts(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``routed`` is grouped by global expert id with ``counts`` per expert."""
        if self.ep_group is None:
            return self.experts(routed, counts.tolist())
        return expert_parallel(self.experts, routed, counts, self.ep_group)


class LocalExpertCompute(Protocol):
    """What the all-to-all dispatcher needs of a rank's experts (:class:`GroupedExperts`,
    or an HF model's, ``hf_parallel.LocalExperts``): how many are local, and their forward on
    tokens grouped by local expert."""

    @property
    def num_local_experts(self) -> int: ...

    def __call__(self, x: torch.Tensor, counts: list[int], /) -> torch.Tensor: ...


def expert_parallel(experts: LocalExpertCompute, routed: torch.Tensor, counts: torch.Tensor,
                    group: dist.ProcessGroup) -> torch.Tensor:
    """Dispatch tokens to the ranks owning their experts, compute, and send results back."""
    from torch.distributed.nn.functional import all_to_all_single

    ep = dist.get_world_size(group)
    local = experts.num_local_experts
    send_counts = counts.view(ep, local)
    recv_counts = torch.empty_like(counts)
    # Counts first (int64, no autograd), then the tokens with uneven splits.
    dist.all_to_all_single(recv_counts, counts, group=group)
    recv_counts = recv_counts.view(ep, local)
    in_splits = send_counts.sum(dim=1).tolist()
    out_splits = recv_counts.sum(dim=1).tolist()
    received = all_to_all_single(routed.new_empty(sum(out_splits), routed.shape[1]), routed,
                                 out_splits, in_splits, group=group)
    # Received tokens are ordered (source rank, local expert); the experts want them by
    # (local expert, source rank).
    starts = torch.cumsum(recv_counts.flatten(), 0) - recv_counts.flatten()
    perm = torch.cat([torch.arange(int(starts[s * local + e]),
                                   int(starts[s * local + e] + recv_counts[s, e]))
                      for e in range(local) for s in range(ep)])
    out = experts(received[perm], recv_counts.sum(dim=0).tolist())
    back = out[torch.argsort(perm)]
    # Under autocast the experts answer in bf16 while the tokens came in fp32: the return buffer
    # takes the answer's dtype (all_to_all_single refuses a mixed pair).
    return all_to_all_single(back.new_empty(routed.shape[0], back.shape[1]), back, in_splits,
                             out_splits, group=group)
