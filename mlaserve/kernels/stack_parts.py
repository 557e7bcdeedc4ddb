"""A native grouped product over an expert weight kept in parts (stacks [E, N_i, R] whose rows follow one another:
gate then up, where the file stores them): one call per part, each writing its columns of one output. The grouped
products of kernels/panels.py, bf16_pairs.py and int16_prefill.py share it; each binds its own C function.

Notation
  xs      [P, K] fp32 activation rows, sorted by group
  experts [A] int64 the groups' expert ids; starts [A + 1] int64, group a = rows starts[a] .. starts[a + 1]
  ys      [P, N] fp32, N = sum N_i: part i's products in columns sum_{j < i} N_j ..
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# product(xs, k, stack, n_i, row_bytes, expert_stride, experts, starts, groups, ys_at_column, ldy, threads) -> rc:
# the C call with its pointers as ints (ctypes' void pointers), rc 0 on success
Product = Callable[..., int]


def grouped(
    xs: torch.Tensor,
    parts: tuple[torch.Tensor, ...],
    k: int,
    experts: torch.Tensor,
    starts: torch.Tensor,
    product: Product,
    check: Callable[[int], None],
) -> torch.Tensor:
    """ys [P, N] fp32: rows of group a times expert experts[a]'s rows of every part, by `product` once per part;
    check(rc) raises on a failed call."""
    xs = xs.float().contiguous()
    n = sum(p.shape[1] for p in parts)
    ys = torch.empty(xs.shape[0], n, dtype=torch.float32)
    experts, starts = experts.to(torch.int64).contiguous(), starts.to(torch.int64).contiguous()
    col = 0
    for p in parts:
        if p.dtype != torch.uint8 or p.stride(2) != 1 or p.stride(1) != p.shape[2]:
            raise ValueError("expert stacks: uint8 rows of whole blocks, one after another")
        rc = product(
            xs.data_ptr(), k, p.data_ptr(), p.shape[1], p.shape[2], p.stride(0), experts.data_ptr(),
            starts.data_ptr(), experts.shape[0], ys[:, col:].data_ptr(), n, torch.get_num_threads(),
        )  # fmt: skip
        check(rc)
        col += p.shape[1]
    return ys
