"""The grouped GEMM's host-side check of ``group_sizes`` (the reference and the dispatcher's
checked path both use it)."""

from __future__ import annotations

import torch


def check_group_sizes_values(group_sizes: torch.Tensor, num_rows: int) -> list[int]:
    """Read ``group_sizes`` on the host and check it: no negative size, sum equal to ``num_rows``.

    Returns the sizes as Python ints. Costs a device sync when ``group_sizes`` lives on a GPU.
    """
    sizes = [int(s) for s in group_sizes.tolist()]
    negative = [g for g, s in enumerate(sizes) if s < 0]
    if negative:
        raise ValueError(
            f"group_sizes must be >= 0, but group(s) {negative[:8]} have sizes "
            f"{[sizes[g] for g in negative[:8]]}; pass the number of rows of x that belong to each group"
        )
    total = sum(sizes)
    if total != num_rows:
        raise ValueError(
            f"sum(group_sizes) = {total} but x has {num_rows} rows; every row of x must belong to "
            "exactly one group (pad x or add the missing rows to a group)"
        )
    return sizes
