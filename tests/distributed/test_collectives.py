"""The collectives every backend shares (easyfit/distributed/collectives.py), on 2 real gloo processes: the padded
all_gather (ranks holding different lengths, one none; a scalar; bool tensors, also where a backend sends them as
uint8), the mean, the broadcast; and the one-process collectives, which hand back their input."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from easyfit.distributed.collectives import Collectives, TorchCollectives

pytestmark = pytest.mark.timeout(60)

CPU = torch.device("cpu")


class NoBoolCollectives(TorchCollectives):
    """A backend without bool tensors (as Horovod): they travel as uint8."""

    gathers_bool = False


def rows(rank: int) -> torch.Tensor:
    """Rank 0: 3 rows of 2; rank 1: none (an empty tensor of another shape)."""
    return torch.arange(6.0).reshape(3, 2) if rank == 0 else torch.empty(0)


def flags(rank: int) -> torch.Tensor:
    return torch.tensor([True, False]) if rank == 0 else torch.tensor([False, True, True])


def check_rank(rank: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        for collectives in (TorchCollectives(2, CPU), NoBoolCollectives(2, CPU)):
            parts = collectives.all_gather(rows(rank))
            assert [part.shape for part in parts] == [(3, 2), (0, 2)]
            assert torch.equal(torch.cat(parts), rows(0))
            longer = collectives.all_gather(torch.full((2 + 3 * rank,), rank, dtype=torch.int64))
            assert torch.equal(torch.cat(longer), torch.tensor([0, 0, 1, 1, 1, 1, 1]))
            scalars = collectives.all_gather(torch.tensor(rank + 0.5))
            assert [part.shape for part in scalars] == [(), ()] and [part.item() for part in scalars] == [0.5, 1.5]
            gathered = collectives.all_gather(flags(rank))
            assert all(part.dtype == torch.bool for part in gathered)
            assert torch.equal(torch.cat(gathered), torch.cat([flags(0), flags(1)]))
        collectives = TorchCollectives(2, CPU)
        assert torch.equal(collectives.reduce(torch.tensor([rank * 2.0]), "mean"), torch.tensor([1.0]))
        assert collectives.reduce(torch.tensor([rank]), "max").item() == 1
        assert collectives.broadcast({"from": rank}, src=1) == {"from": 1}
        collectives.barrier()
    finally:
        dist.destroy_process_group()


def test_the_padded_all_gather_mean_and_broadcast_agree_on_two_gloo_processes(tmp_path):
    # forked, not spawned: the ranks start in milliseconds, with torch imported (tiny tensors, one thread each)
    mp.start_processes(check_rank, args=(str(tmp_path / "store"),), nprocs=2, start_method="fork")


def test_one_process_collectives_hand_back_their_input():
    collectives, tensor = Collectives(), torch.tensor([1.0, 2.0])
    assert collectives.reduce(tensor, "mean") is tensor and collectives.all_gather(tensor)[0] is tensor
    assert collectives.broadcast("x") == "x"
    with pytest.raises(ValueError, match="reduce op must be one of sum, mean, max, min, got 'avg'"):
        collectives.reduce(tensor, "avg")
