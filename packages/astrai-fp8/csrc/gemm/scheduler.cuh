// Tile scheduler: linear CTA id -> (tile row, tile column) of the output.
//
// Grouped raster: consecutive CTAs walk down a band of `group_m` tile rows before moving
// one tile column right, so the CTAs resident at the same time share a few A row-panels
// and B column-panels in L2 instead of streaming all of B once per tile row.
// group_m = 1 degenerates to the plain row-major raster. Pure index math, host and device.
#pragma once

namespace astrai::fp8 {

struct TileCoord {
  int m, n;  // tile indices (multiply by the block shape for element offsets)
};

__host__ __device__ inline TileCoord grouped_tile(int id, int tiles_m, int tiles_n, int group_m) {
  const int per_group = group_m * tiles_n;
  const int group = id / per_group;
  const int first_m = group * group_m;
  const int rows = tiles_m - first_m < group_m ? tiles_m - first_m : group_m;
  const int in_group = id - group * per_group;
  return TileCoord{first_m + in_group % rows, in_group / rows};
}

}  // namespace astrai::fp8
