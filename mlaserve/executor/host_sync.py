"""A guard that fails on the ops a CUDA graph cannot capture: those that read a tensor's value on the host or whose
output shape depends on tensor values. Runs on any device (a CPU run checks the op stream a GPU run would issue), so
the padded decode step is held to it in CPU tests.

Refused ops (aten overload packets), and why:
  _local_scalar_dense, item      .item(), int(t), float(t), bool(t), .tolist(): the value is copied to the host
  is_nonzero, equal, allclose    a Python bool from tensor values
  nonzero, masked_select, unique (all forms), bincount, repeat_interleave without output_size, histogram
                                 the output's size is read from the values (nonzero / bincount sync on CUDA)
  index / index_put with a bool index   boolean-mask indexing: a nonzero inside
  lift_fresh, lift_fresh_copy    torch.tensor(host data) inside the step: a host-to-device copy per call
  _grouped_mm on other than bf16 its fallback (every dtype but bf16, and every CPU) copies the group offsets to the
                                 host and loops over the groups; CUDA's grouped kernel (sm90+) takes bf16 only
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

HOST_SYNC_OPS = frozenset(
    {
        aten._local_scalar_dense,
        aten.item,  # seen as itself under inference_mode (outside it, as _local_scalar_dense)
        aten.is_nonzero,
        aten.equal,
        aten.allclose,
        aten.nonzero,
        aten.masked_select,
        aten.unique_dim,
        aten.unique_consecutive,
        aten._unique,
        aten._unique2,
        aten.bincount,
        aten.histc,
        aten.lift_fresh,
        aten.lift_fresh_copy,
    }
)
BOOL_INDEX_OPS = frozenset({aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_})


class HostSyncError(RuntimeError):
    pass


class HostSyncGuard(TorchDispatchMode):
    """with HostSyncGuard(): step()  -> raises HostSyncError naming the first op that needs the host."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in HOST_SYNC_OPS:
            raise HostSyncError(f"{func}: {_why(packet)} (a CUDA graph cannot capture it)")
        if packet is aten.repeat_interleave and kwargs.get("output_size") is None and len(args) and _tensor(args[-1]):
            raise HostSyncError(f"{func} without output_size: its size is read from the repeats")
        if packet is aten._grouped_mm and args[0].dtype != torch.bfloat16:
            raise HostSyncError(
                f"{func} on {args[0].dtype}: its fallback reads the group offsets on the host (the grouped kernel "
                "takes bf16 only)"
            )
        if packet in BOOL_INDEX_OPS and any(_bool_index(i) for i in _indices(args)):
            raise HostSyncError(f"{func} with a boolean index: a nonzero on the host (a CUDA graph cannot capture it)")
        return func(*args, **kwargs)


def _why(packet) -> str:
    if packet in (aten._local_scalar_dense, aten.item):
        return "a tensor's value read on the host (.item(), int(), .tolist())"
    if packet in (aten.lift_fresh, aten.lift_fresh_copy):
        return "a tensor made from host data inside the step"
    return "an output shape or a Python value from tensor values"


def _tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


def _indices(args) -> list:
    return list(args[1]) if len(args) > 1 and isinstance(args[1], (list, tuple)) else []


def _bool_index(i) -> bool:
    return isinstance(i, torch.Tensor) and i.dtype == torch.bool
