// Persistent tile schedule with a grouped raster: CTA b takes tiles b, b + grid, ...;
// tile t walks `group_m` tile rows down a column before moving right, so the CTAs that run
// together share A rows and B columns in L2.
#pragma once

namespace astrai::fp8::sm90 {

struct TileScheduler {
    int tiles_m, tiles_n, group_m;

    __host__ __device__ void coords(int t, int& tm, int& tn) const {
        const int per_group = group_m * tiles_n;
        const int g = t / per_group;
        const int first = g * group_m;
        const int left = tiles_m - first;
        const int rows = left < group_m ? left : group_m;
        const int r = t - g * per_group;
        tm = first + r % rows;
        tn = r / rows;
    }
};

}  // namespace astrai::fp8::sm90
