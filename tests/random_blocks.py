"""Random block layouts for the kernel tests: blocks of random true length (1..block_size, so
most are edge blocks) and a random permutation of the rows per (batch, head)."""
import torch


def random_block_lengths(seq_len: int, block_size: int, g: torch.Generator) -> torch.Tensor:
    """int32 [J] true lengths summing to seq_len."""
    lengths: list[int] = []
    while sum(lengths) < seq_len:
        lengths.append(min(int(torch.randint(1, block_size + 1, (1,), generator=g)), seq_len - sum(lengths)))
    return torch.tensor(lengths, dtype=torch.int32)


def random_perms(seq_len: int, block_len: torch.Tensor, batch: int, heads: int, block_size: int,
                 g: torch.Generator) -> torch.Tensor:
    """int32 [batch, heads, J * block_size]: every row once in the valid slots, -1 in the padding."""
    J = block_len.numel()
    slot_valid = (torch.arange(block_size).view(1, -1) < block_len.view(-1, 1)).view(-1)
    perm = torch.full((batch * heads, J * block_size), -1, dtype=torch.int32)
    for row in perm:
        row[slot_valid] = torch.randperm(seq_len, generator=g).to(torch.int32)
    return perm.view(batch, heads, -1)
