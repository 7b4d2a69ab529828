"""Solutions to chapter 6's exercises that check themselves, and answers a checker must reject."""
import torch


def _angles(head_dim: int, positions: list[int], base: float, step: int = 2) -> torch.Tensor:
    channel = torch.arange(0, head_dim, 2, dtype=torch.float32) if step == 2 \
        else torch.arange(head_dim // 2, dtype=torch.float32)
    return torch.tensor(positions, dtype=torch.float32)[:, None] * base ** (-channel / head_dim)


def rotate(x: torch.Tensor, positions: list[int], base: float) -> torch.Tensor:
    angles = _angles(x.shape[-1], positions, base)
    first, second = x.chunk(2, dim=-1)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def interleaved(x: torch.Tensor, positions: list[int], base: float) -> torch.Tensor:
    """Turns neighbouring channels (0 with 1, 2 with 3): GPT-J's layout, not Qwen2's."""
    angles = _angles(x.shape[-1], positions, base)
    even, odd = x[:, 0::2], x[:, 1::2]
    cos, sin = angles.cos(), angles.sin()
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(1)


def backwards(x: torch.Tensor, positions: list[int], base: float) -> torch.Tensor:
    """Turns by minus the angle: the sine's sign flipped."""
    angles = _angles(x.shape[-1], positions, base)
    first, second = x.chunk(2, dim=-1)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([first * cos + second * sin, second * cos - first * sin], dim=-1)


def half_frequencies(x: torch.Tensor, positions: list[int], base: float) -> torch.Tensor:
    """Forgets the factor 2 in the exponent: base ** (-i / head_dim)."""
    angles = _angles(x.shape[-1], positions, base, step=1)
    first, second = x.chunk(2, dim=-1)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


SOLUTIONS = {"check_rotate": (rotate, [interleaved, backwards, half_frequencies])}
