"""The fused MoE's block shapes (``fused_moe``): by the pairs each expert sees, the operands' width, and
deterministic mode; measured in ``bench/notes/moe.md``."""

from __future__ import annotations

from flashinfra.kernels.dispatch import is_deterministic
from flashinfra.kernels.quant.act import GROUP

# Long prefills: 128 x 128 tiles in both GEMMs, the most reuse of each loaded weight tile (16-bit and 8-bit operands);
# gemm1 keeps two accumulators (gate and up), so 8-bit weights take 64 columns of each (notes/moe.md: tiles measured).
LARGE_TILES = {1: dict(BM=128, BN1=64, BN2=128, BK=GROUP, num_warps=8, num_stages=3),
               2: dict(BM=128, BN1=128, BN2=128, BK=64, num_warps=8, num_stages=3)}
# Deterministic mode: a pair's sums follow the K loop alone (BK, no split), not BM / BN / the warps, as long as every
# tile is wide enough for Hopper's wgmma (64 rows): so 16-bit and 8-bit operands take these 64-row tiles while experts
# see a few rows each and ``LARGE_TILES`` past that, the same K step in both; float32 keeps one tile.
DETERMINISTIC_CONFIG = {1: dict(BM=64, BN1=64, BN2=64, BK=GROUP, num_warps=4, num_stages=3),
                        2: dict(BM=64, BN1=64, BN2=64, BK=64, num_warps=4, num_stages=3),
                        4: dict(BM=32, BN1=32, BN2=32, BK=32, num_warps=4, num_stages=2)}


def moe_tiles(num_pairs: int, num_experts: int, elem_bytes: int = 2) -> dict:
    """Block shapes: thin M blocks while experts see a few tokens each (decode), square-ish ones after;
    float32 tiles are twice the bytes, so their large shape is halved to fit shared memory. 8-bit weights
    step through K by the fp8 scales' block (``GROUP``)."""
    per_expert = num_pairs / max(num_experts, 1)
    if is_deterministic():
        large = per_expert > 64 and elem_bytes in LARGE_TILES
        return LARGE_TILES[elem_bytes] if large else DETERMINISTIC_CONFIG[min(elem_bytes, 4)]
    if elem_bytes == 1:
        if num_pairs <= 64 or per_expert <= 16:  # gemm1's two accumulators in 32 columns: twice the programs
            return dict(BM=16, BN1=32, BN2=64, BK=GROUP, num_warps=4, num_stages=3)
        if per_expert <= 64:
            return dict(BM=32, BN1=64, BN2=64, BK=GROUP, num_warps=4, num_stages=4)
        return LARGE_TILES[1]
    wide = elem_bytes <= 2
    if num_pairs <= 64 or (per_expert <= 16 and not wide):  # a few experts streamed by many thin programs
        return dict(BM=16, BN1=64, BN2=64, BK=128, num_warps=4, num_stages=4)
    if per_expert <= 16:  # every expert touched, a few rows each: wider tiles, fewer programs per expert
        return dict(BM=16, BN1=128, BN2=128, BK=128, num_warps=4, num_stages=4)
    if per_expert <= 64:
        return dict(BM=32, BN1=64, BN2=64, BK=64, num_warps=8, num_stages=4)
    if not wide:
        return dict(BM=64, BN1=64, BN2=128, BK=64, num_warps=8, num_stages=3)
    return LARGE_TILES[2]
