// The fp32 vector a kernel written once runs on, per instruction set: `Avx512` (16 lanes) where the module is built
// with AVX-512, `Avx2` (8 lanes, with FMA) everywhere the x86-64 kernels run. Each gives loads and round-to-nearest-
// even stores of bf16, the arithmetic the element-wise kernels need, an exp, and lane compares for argmax.
#pragma once
#include <immintrin.h>
#include <cstdint>

#ifdef __AVX512F__
struct Avx512 {
  static constexpr int kLanes = 16;
  using F = __m512;
  using I = __m512i;
  using Mask = __mmask16;

  static F load_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }
  static void store_bf16(uint16_t* p, F v) {
    __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
  }
  // v rounded to the nearest bf16 (ties to even), kept in fp32.
  static F round_bf16(F v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)),
                                                _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static F set1(float f) { return _mm512_set1_ps(f); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F min(F a, F b) { return _mm512_min_ps(a, b); }
  static F round_to_int(F x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT); }
  static F scale_by_pow2(F p, F n) { return _mm512_scalef_ps(p, n); }
  static float reduce_add(F v) { return _mm512_reduce_add_ps(v); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }

  static I iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  static I add_int(I a, int b) { return _mm512_add_epi32(a, _mm512_set1_epi32(b)); }
  static I zero_int() { return _mm512_setzero_si512(); }
  static void store_int(int32_t* p, I v) { _mm512_storeu_si512(p, v); }
  static Mask greater(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  static Mask unordered(F a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
  static Mask no_lanes() { return 0; }
  static Mask either(Mask a, Mask b) { return a | b; }
  static bool any(Mask m) { return m != 0; }
  static F select(Mask m, F if_set, F otherwise) { return _mm512_mask_mov_ps(otherwise, m, if_set); }
  static I select_int(Mask m, I if_set, I otherwise) { return _mm512_mask_mov_epi32(otherwise, m, if_set); }
};
#endif

struct Avx2 {
  static constexpr int kLanes = 8;
  using F = __m256;
  using I = __m256i;
  using Mask = __m256;  // all ones in a set lane, as AVX2's compares give

  static F load_bf16(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  }
  static void store_bf16(uint16_t* p, F v) {
    __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)), 16);
    // Each 32-bit lane now holds its bf16 in the low half: pack the halves of both 128-bit lanes into one.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0b1000);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static F round_bf16(F v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)),
                                                _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static F set1(float f) { return _mm256_set1_ps(f); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F min(F a, F b) { return _mm256_min_ps(a, b); }
  static F round_to_int(F x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // p * 2^n for integral n in [-126, 254], in two factors so that neither's exponent field overflows.
  static F scale_by_pow2(F p, F n) {
    const __m256i whole = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(whole, 1);
    const auto pow2 = [](__m256i e) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23)); };
    return _mm256_mul_ps(_mm256_mul_ps(p, pow2(half)), pow2(_mm256_sub_epi32(whole, half)));
  }
  static float reduce_add(F v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
  }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }

  static I iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  static I add_int(I a, int b) { return _mm256_add_epi32(a, _mm256_set1_epi32(b)); }
  static I zero_int() { return _mm256_setzero_si256(); }
  static void store_int(int32_t* p, I v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
  static Mask greater(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
  static Mask unordered(F a) { return _mm256_cmp_ps(a, a, _CMP_UNORD_Q); }
  static Mask no_lanes() { return _mm256_setzero_ps(); }
  static Mask either(Mask a, Mask b) { return _mm256_or_ps(a, b); }
  static bool any(Mask m) { return _mm256_movemask_ps(m) != 0; }
  static F select(Mask m, F if_set, F otherwise) { return _mm256_blendv_ps(otherwise, if_set, m); }
  static I select_int(Mask m, I if_set, I otherwise) {
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(otherwise), _mm256_castsi256_ps(if_set), m));
  }
};
