// AMX basics shared by the kernels that use Intel's matrix unit (Sapphire
// Rapids and later): whether this process may use it, and the one tile
// configuration they use (eight tiles of 16 rows x 64 bytes: a 16 x 32 bf16
// operand, a 16 x 16 fp32 sum, or 16 rows of 16 bf16 pairs).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define KVPAGER_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace kvpager {

// Linux (5.16+) hands a process AMX's 8 KiB of tile state only once it asks:
// arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA). Asked once; false
// where the kernel refuses (the callers keep their AVX-512 forms then).
inline bool amx_usable() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

// Palette 1, every tile 16 rows x 64 bytes.
struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Configured per thread for one call's tiles and released after (oneDNN
// configures its own before each use of them).
inline void amx_begin() {
  AmxConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
}
inline void amx_end() { _tile_release(); }

}  // namespace kvpager
#endif
