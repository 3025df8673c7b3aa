"""Random block layouts for the kernel tests: blocks of random true length (1..block_size, so
most are edge blocks) and a random permutation of the rows per (batch, head); k, v as H3 lays
them out."""
import torch

from adaptive_sparse_attention.backend.tiling import Tiling


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


def random_tiling(seq_len: int, batch: int, heads: int, block_size: int, seed: int,
                  device: torch.device | str = "cpu") -> Tiling:
    """Blocks of random true length holding a random permutation of the rows, one per (batch,
    head) or one shared by all ([1, 1, L]); q and k share it."""
    g = torch.Generator().manual_seed(seed)
    block_len = random_block_lengths(seq_len, block_size, g)
    perm = random_perms(seq_len, block_len, batch, heads, block_size, g).to(device)
    return Tiling(block_size, perm, perm, block_len.to(device), (), ())


def h3_views(batch: int, heads: int, seq_len: int, dim: int, dtype: torch.dtype, seed: int,
             device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [B, H, S, D] as strided views of one [B, S, 2, H, D] buffer (H3's qkv layout)."""
    g = torch.Generator(device=device).manual_seed(seed)
    buf = torch.randn(batch, seq_len, 2, heads, dim, generator=g, device=device).to(dtype)
    return buf[:, :, 0].transpose(1, 2), buf[:, :, 1].transpose(1, 2)
