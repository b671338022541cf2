"""Device-agnostic checks of a block mover, run on CPU tensors by the main suite and on CUDA tensors by
tests/gpu (`make test-gpu`)."""

from __future__ import annotations

import torch

from vllm_tiercache.kvcache.blocks.transfer import BlockMover, block_spans

#: block id lists a request really gets: a fresh pool's ascending run, a cycled pool's descending run,
#: scattered blocks, one block, and a mix
BLOCK_LISTS = ([2, 3, 4, 5], [9, 8, 7, 6], [0, 7, 3, 11, 1], [10], [1, 2, 3, 8, 7, 6, 0])

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers on the CPU (random bytes include NaNs, which never compare equal)."""
    return tensor.detach().contiguous().view(_INT_OF_SIZE[tensor.element_size()]).cpu()


def check_gather_scatter_bit_for_bit(mover: BlockMover, layers: list[torch.Tensor]) -> None:
    """Gathers equal the blocks they name; scatters land exactly in the blocks they name and nowhere else."""
    generator = torch.Generator().manual_seed(0)
    for layer in layers:
        gathered = [(ids, mover.gather(layer, ids)) for ids in BLOCK_LISTS]
        mover.finish_gathers()
        reference = bits(layer)  # the whole layer on the host (no device indexing of exotic dtypes)
        for ids, host in gathered:
            assert host.device.type == "cpu" and host.is_contiguous() and host.dtype == layer.dtype
            assert torch.equal(bits(host), reference[ids]), ids

        # gathered records (pinned on CUDA: what the memory tier keeps) scattered back into other blocks
        for ids, host in gathered:
            target = ids[::-1]
            mover.scatter_spans(layer, [(block_spans(target), host)])
            mover.finish_scatters()
            assert torch.equal(bits(layer)[target], bits(host)), target

        for ids in BLOCK_LISTS:
            before = bits(layer)
            new = torch.randint(-128, 128, (len(ids) * layer[0].numel() * layer.element_size(),),
                                dtype=torch.int8, generator=generator)
            blocks = new.view(layer.dtype).view(len(ids), *layer.shape[1:])
            mover.scatter_spans(layer, [(block_spans(ids), blocks)])
            mover.finish_scatters()
            after = bits(layer)
            assert torch.equal(after[ids], bits(blocks)), ids
            untouched = [b for b in range(layer.shape[0]) if b not in ids]
            assert torch.equal(after[untouched], before[untouched]), ids
