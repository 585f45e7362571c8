"""Tensor-parallel deployments from Python (docs/architecture.md, "Tensor parallelism"): each rank's
process creates its KVCacheRuntime with KVCacheRuntimeConfig.tensorParallel, whose agreement is
the group's collective. torch_agreement() makes it over torch.distributed."""

import torch
import torch.distributed as dist

from . import _managedkv as _mkv

_LOW32 = 0xFFFFFFFF


def torch_agreement(group=None):
    """A RankAgreement over torch.distributed: one MIN all-reduce of five int64 values per agreement
    (succeeded, the digest's two halves and their negations: the minimum of a negation is the
    maximum, so the digests agree when both halves' minimum and maximum are equal). `group` must
    reduce CPU tensors (gloo; an engine with an NCCL group keeps a gloo one beside it, as vLLM's
    cpu_group). Every rank of `group` must drive its runtime with the same calls."""

    def agree(outcome):
        digest = int(outcome.decisionDigest)
        high, low = digest >> 32, digest & _LOW32
        values = torch.tensor([int(outcome.succeeded), high, low, -high, -low], dtype=torch.int64)
        dist.all_reduce(values, op=dist.ReduceOp.MIN, group=group)
        succeeded, min_high, min_low, neg_max_high, neg_max_low = values.tolist()
        return _mkv.AgreedOutcome(succeeded == 1, min_high == -neg_max_high and min_low == -neg_max_low)

    return agree


def rank_config(config, rank, size, kv_heads=_mkv.KvHeadLayout.kSplitHeads, agreement=None):
    """`config` (a KVCacheRuntimeConfig, changed in place and returned) for `rank` of `size`, with
    torch_agreement() over the default group unless `agreement` is given."""
    tp = _mkv.TensorParallelConfig()
    tp.size = size
    tp.rank = rank
    tp.kvHeads = kv_heads
    tp.agreement = agreement if agreement is not None else torch_agreement()
    config.tensorParallel = tp
    return config
