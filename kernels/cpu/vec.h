// Small vectorisable helpers shared by the CPU kernels.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvpager {

// exp, vectorisable (std::exp is a scalar libm call: it was most of a
// decode's attention time). Cephes' single-precision polynomial after
// reducing x = n ln2 + f: within ~2 ulp of expf on [-87, 88]; +inf above,
// 0 below (expf's subnormal tail flushed), NaN for NaN, so silu and
// softmax see infinities as torch's exp gives them. Needs IEEE semantics
// (no -ffast-math: the rounding trick must not be reassociated).
inline float vexp(float in) {
  const float x = std::min(std::max(in, -87.0f), 88.0f);
  // Round to nearest by the 1.5 * 2^23 trick (std::floor blocks vectorisation).
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float f = x - n * 0.693359375f + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * f + 1.3981999507e-3f;
  y = y * f + 8.3334519073e-3f;
  y = y * f + 4.1665795894e-2f;
  y = y * f + 1.6666665459e-1f;
  y = y * f + 5.0000001201e-1f;
  y = y * f * f + f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  float r = y * scale;
  r = in > 88.0f ? INFINITY : r;
  r = in < -87.0f ? 0.0f : r;
  return in != in ? in : r;
}

}  // namespace kvpager
