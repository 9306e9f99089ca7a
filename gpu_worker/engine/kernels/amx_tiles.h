// What the AMX kernels share (quant_amx_kernels.cpp, and cpu_attention_kernels.cpp where built for AMX): Linux's
// leave to use the tile state, and the one tile shape they all use.
#pragma once
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdint>

// Linux hands AMX's tile state to a process that asks (arch_prctl), once.
inline bool amx_permitted() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool permitted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return permitted;
}

// Every tile 16 rows x 64 bytes; edges are zero padding. Each thread configures its own tiles.
inline void configure_tiles() {
  struct {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 8; t++) config.colsb[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
}
