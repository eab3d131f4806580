// The two FP8 encodings the Hopper mainloop reads (host and device, no CUDA headers).
#pragma once

namespace astrai::fp8::sm90 {

enum class Fp8Kind : int { E4M3 = 0, E5M2 = 1 };

}  // namespace astrai::fp8::sm90
