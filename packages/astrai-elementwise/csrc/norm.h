// The RMSNorm and SiLU-and-mul entry points (norm.cu), bound into the plugin's module.
#pragma once

#include <pybind11/pybind11.h>

namespace astrai::norm {

// Adds rms_norm, fused_add_rms_norm, silu_and_mul and norm_launch to `m`.
void bind(pybind11::module_& m);

}  // namespace astrai::norm
