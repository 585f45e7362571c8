"""managedkv: the KV-cache request layer in Python (docs/python.md).

The compiled module ``_managedkv`` binds the C++ API under its C++ names: ``KVCacheRuntimeConfig``,
``KVCacheRuntime``, the seed facade ``ManagedKVCacheRequest``, the pools, page tables and resident
slots, and ``AttentionViews`` (block table, lengths, FlashInfer CSR, slot mapping of a step).
Library tensors (``Tensor``) are shared with torch without copies: ``torch.from_dlpack(t)``; calls
that take a tensor accept torch tensors and NumPy arrays (DLPack). Contract violations raise
``managedkv.Error`` with the library's message, ``.call`` and ``.detail``.
"""

from ._managedkv import *  # noqa: F401,F403
from ._managedkv import Error, Tensor  # noqa: F401


def to_torch(tensor):
    """A torch tensor over the library tensor's memory (no copy)."""
    import torch

    return torch.from_dlpack(tensor)
