"""``dist.all_gather`` played by one process: the other ranks' parts are given, as gloo would deliver them."""

from __future__ import annotations

import torch
import torch.distributed as dist


def gather_as_gloo(monkeypatch, others: dict[int, bytes], my_rank: int) -> list[bytes]:
    """Make ``dist.all_gather`` play the other ranks: ``others`` maps global rank -> the bytes it sends.

    The pipeline's agreement gathers twice, the lengths (int64) and then the
    messages padded to the longest (uint8); gloo fills the list in group-rank
    order (ascending global ranks). Returns a list that gets each message this
    rank sends (its padding stripped), in order.
    """
    sent: list[bytes] = []
    ranks = sorted([*others, my_rank])

    def all_gather(out, mine, group=None):
        if mine.dtype == torch.int64:  # first the lengths
            for slot, rank in enumerate(ranks):
                out[slot].fill_(int(mine.item()) if rank == my_rank else len(others[rank]))
            return
        for slot, rank in enumerate(ranks):
            data = bytes(mine.tolist()) if rank == my_rank else others[rank]
            out[slot].zero_()
            out[slot][: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
        sent.append(bytes(mine.tolist()).rstrip(b"\0"))

    monkeypatch.setattr(dist, "all_gather", all_gather)
    return sent
