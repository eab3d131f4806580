"""Launch planning of the Hopper (sm_90a) FP8 GEMM, in pure Python.

A line-by-line mirror of ``csrc/gemm/sm90/planning.h`` (the C++ the binary runs), kept for
CPU tests, for ``explain``-style traces without a GPU, and for tools that want to know which
tile the kernel will pick. A test compiles the C++ header with the host compiler and checks
that both give the same plan on a grid of shapes.

The kernel computes ``out[M, N] = scale * A[M, K] @ B[N, K]^T + bias`` with both operands
K-major (the "TN" layout: ``b`` given as ``[N, K]``, i.e. ``trans_b``), tiles of
128 x BN x 128 on a persistent grid of at most one CTA per SM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "TILE_CONFIGS", "TILE_M", "TILE_K", "GROUP_M", "DeviceLimits", "ProblemShape", "TileConfig",
    "Plan", "can_implement", "plan", "plan_config", "smem_bytes",
]

INT32_MAX = 2**31 - 1
TILE_M = 128
TILE_K = 128
GROUP_M = 8


@dataclass(frozen=True)
class TileConfig:
    id: int
    bn: int
    stages: int
    promote: bool
    cluster: int  # CTAs along M sharing B through TMA multicast (1 or 2)
    rate: float   # relative per-SM throughput of a full tile, measured on an H200
    enabled: bool = True  # considered by default; a disabled config runs only when forced
    swap: bool = False    # swap-AB: 128-row tiles over N, bn columns over M (small M only)

    @property
    def name(self) -> str:
        acc = "promote" if self.promote else "fast"
        kind = "sm90 swap-AB" if self.swap else "sm90"
        return f"{kind} 128x{self.bn}x128 s{self.stages} {acc} cluster {self.cluster}"


# Kept in step with kTileConfigs in planning.h and the instantiations in dispatch.cuh.
TILE_CONFIGS = (
    TileConfig(0, 256, 4, False, 1, 1.00),
    TileConfig(1, 192, 5, True, 1, 0.935),
    # dominated by config 14 (the same tile, pipelined promotion): forced only
    TileConfig(2, 128, 6, True, 1, 0.833, enabled=False),
    TileConfig(3, 128, 6, False, 1, 0.955),
    # 2-CTA clusters with B multicast, timed on the H200 (docs/kernels/fp8-hopper.md): fast
    # 128x256 0-5 % over config 0 at 10 of 12 shapes, promoted mixed; forced only for now
    TileConfig(4, 256, 4, False, 2, 1.05, enabled=False),
    TileConfig(5, 192, 5, True, 2, 0.98, enabled=False),
    TileConfig(6, 128, 6, False, 2, 1.00, enabled=False),
    TileConfig(7, 128, 6, True, 2, 0.87, enabled=False),
    # swap-AB for M <= bn (decode-sized M): memory-bound, so deep rings; the tile's MMA
    # work is bn / 128 of a square tile, hence the cost model's preference needs no rate
    TileConfig(8, 16, 12, True, 1, 1.00, swap=True),
    TileConfig(9, 16, 12, False, 1, 1.00, swap=True),
    TileConfig(10, 32, 11, True, 1, 1.00, swap=True),
    TileConfig(11, 32, 11, False, 1, 1.00, swap=True),
    TileConfig(12, 64, 9, True, 1, 1.00, swap=True),
    TileConfig(13, 64, 9, False, 1, 1.00, swap=True),
    # promoted sums with two wgmma chains in turn (GemmConfig Promote = 2): timed in turn
    # with configs 1 and 2 on the H200, 0.99-1.24x config 1 at the 13 shapes with M >= 1024
    # (docs/kernels/fp8-hopper.md); its rate makes it the promoted choice wherever the
    # rounds are not much fewer with 192-wide tiles
    TileConfig(14, 128, 6, True, 1, 0.97),
)


@dataclass(frozen=True)
class DeviceLimits:
    cc_major: int
    cc_minor: int
    num_sms: int
    smem_optin: int  # bytes a block may opt in to


H200 = DeviceLimits(9, 0, 132, 232448)


@dataclass(frozen=True)
class ProblemShape:
    M: int
    N: int
    K: int
    lda: int | None = None  # elements between rows of A [M, K]; default K
    ldb: int | None = None  # elements between rows of B [N, K]; default K
    a_addr: int = 0
    b_addr: int = 0

    @property
    def lda_(self) -> int:
        return self.K if self.lda is None else self.lda

    @property
    def ldb_(self) -> int:
        return self.K if self.ldb is None else self.ldb


@dataclass
class Plan:
    """tiles_m counts groups of ``cluster`` vertically adjacent tiles; ``num_tiles`` such
    groups go one per cluster and round; ``grid`` is in CTAs (the launch lowers it when fewer
    clusters fit on the device at once)."""

    ok: bool = False
    config: int = -1
    cluster: int = 1
    tiles_m: int = 0
    tiles_n: int = 0
    num_tiles: int = 0
    grid: int = 0
    k_blocks: int = 0
    group_m: int = GROUP_M
    cost: float = 0.0
    trace: list[str] = field(default_factory=list)


def smem_bytes(c: TileConfig) -> int:
    return c.stages * (TILE_M + c.bn) * TILE_K + 2 * c.stages * 8 + 1024


def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def can_implement(s: ProblemShape, d: DeviceLimits) -> str:
    """'' when the Hopper path can take the problem, else the reason it cannot."""
    if not (d.cc_major == 9 and d.cc_minor == 0):
        return f"wgmma/TMA path needs sm_90 (device is sm_{d.cc_major}{d.cc_minor})"
    if s.M <= 0 or s.N <= 0 or s.K <= 0:
        return "M, N and K must be positive"
    if s.M > INT32_MAX or s.N > INT32_MAX or s.K > INT32_MAX:
        return "M, N and K must each fit in int32"
    if s.K % 16 != 0:
        return "K must be a multiple of 16 (TMA row pitch is 16-byte granular)"
    if s.lda_ < s.K or s.ldb_ < s.K:
        return "lda and ldb must be >= K"
    if s.lda_ % 16 != 0 or s.ldb_ % 16 != 0:
        return "lda and ldb must be multiples of 16 bytes for TMA"
    if s.a_addr % 16 != 0 or s.b_addr % 16 != 0:
        return "A and B must be 16-byte aligned for TMA"
    return ""


def plan_config(s: ProblemShape, d: DeviceLimits, c: TileConfig) -> Plan:
    """The plan for one tile config, or ok=False with the reason in the trace."""
    p = Plan()
    head = f"{c.name}: "
    if smem_bytes(c) > d.smem_optin:
        p.trace.append(head + f"needs {smem_bytes(c)} B shared memory, device allows {d.smem_optin}")
        return p
    # swap-AB: the kernel's rows run over N and its bn-wide columns over M
    rows, cols = (s.N, s.M) if c.swap else (s.M, s.N)
    tm, tn = _ceil_div(_ceil_div(rows, TILE_M), c.cluster), _ceil_div(cols, c.bn)
    tiles = tm * tn
    if tiles > INT32_MAX:
        p.trace.append(head + "too many tiles")
        return p
    slots = d.num_sms // c.cluster  # clusters resident at once (an estimate)
    clusters = min(tiles, slots)
    rounds = _ceil_div(tiles, clusters)
    p.ok, p.config, p.cluster = True, c.id, c.cluster
    p.tiles_m, p.tiles_n, p.num_tiles, p.grid = tm, tn, tiles, clusters * c.cluster
    p.k_blocks = _ceil_div(s.K, TILE_K)
    p.cost = rounds * c.bn / (256.0 * c.rate)
    p.trace.append(head + f"{tiles * c.cluster} tiles, {rounds} rounds on {p.grid} CTAs, cost {p.cost:.6f}")
    return p


def plan(s: ProblemShape, d: DeviceLimits = H200, accum: str = "promote",
         force_config: int = -1) -> Plan:
    """The cheapest fitting tile config for the accumulation mode ('promote' or 'fast')."""
    if accum not in ("promote", "fast"):
        raise ValueError(f"accum must be 'promote' or 'fast', got {accum!r}")
    best = Plan()
    why = can_implement(s, d)
    if why:
        best.trace = [f"sm90: {why}"]
        return best
    trace: list[str] = []
    for c in TILE_CONFIGS:
        if force_config >= 0 and c.id != force_config:
            continue
        if force_config < 0 and c.promote != (accum == "promote"):
            continue
        if force_config < 0 and not c.enabled:
            continue
        if force_config < 0 and c.swap and s.M > c.bn:
            trace.append(f"sm90 swap-AB 128x{c.bn}: only for M <= {c.bn}")
            continue
        p = plan_config(s, d, c)
        trace += p.trace
        if p.ok and (not best.ok or p.cost < best.cost):
            best = p
    if not best.ok:
        trace.append("sm90: no tile config fits")
    best.trace = trace
    return best
