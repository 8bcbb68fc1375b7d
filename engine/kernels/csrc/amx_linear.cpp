// y = x @ W^T with AMX tiles, W read from the GGUF's quantized blocks and decoded in registers to
// exactly the bf16 values the bf16 engine loads, summed as oneDNN's AMX kernel sums a bf16
// product: per output one TDPBF16PS chain over k in blocks of 32, from zero, rounded once to bf16.
// That is oneDNN's bf16 product on CPUs where genserve runs oneDNN in fixed-size calls
// (`linear.onednn_tiled`); `engine.model.quant` checks at load that these kernels give its bits.
//
// Weight kinds (one `Decoder` each):
//   q4_amx_linear: Q4_1 blocks (fp16 d, fp16 m, 32 x 4-bit q; w = bf16(d * q + m)), the
//                  block matrices;
//   q8_amx_linear: Q8_0 blocks (fp16 d, 32 x int8 q; w = bf16(d * q)), the output projection
//                  of SmolLM2's GGUF (tied to the embedding).
// In both, d * q is exact in fp32 (at most 11 + 8 significant bits) and the one FMA (Q4_1) or
// multiply (Q8_0) rounds once, as `gguf.quants.dequantize` does in numpy's fp32; the bf16
// conversion (vcvtne2ps2bf16) rounds to nearest even, as torch's `.to(bfloat16)`.
//
// Layout (`engine.model.quant.amx_pack`): the file's blocks re-grouped at load, no re-quantization:
//
//   [N/64][K/32][4 groups of 16 output columns]{ d[16] fp16, (Q4_1: m[16] fp16),
//                                               q of the 16 columns, each as in the file }
//
// so a thread streams its 64-column blocks from one contiguous run, and one group is one AMX tile
// of 16 columns x 32 k once decoded: each column's 32 k are contiguous in the file's block.
//
// Decoding Q4_1 by table: per column and block the 16 possible weights bf16(d * q + m), q = 0..15,
// are one FMA over (0..15) and one conversion, held twice in a 32-word register. The column's 16
// nibble bytes, laid out at load so that word j holds q[j], q[8 + j], q[16 + j], q[24 + j], are
// broadcast to the four 128-bit lanes and lane L shifted right by 4L: word 8L + j then holds
// q[8L + j] in its low 4 bits, and vpermw, which reads the low 5 bits of each index, looks the
// 32 weights up in k order (bit 4, the next nibble's, picks the table's second copy: the same
// values). Per 32 weights: an FMA, a conversion, a shift and a permute, about a third of the
// instructions of decoding each weight with its own FMA, and only the permute and half the
// conversion on the shuffle port.
//
// Two ways to run the tiles, one sum. TDPBF16PS computes C[m][n] += sum over the tile's 16 k pairs
// of A[m][pair] . B[pair][n]: each output's products and their order over k do not depend on
// whether W is the A operand or the B one (checked bit for bit against oneDNN at load and in
// tests/engine/test_q4_linear.py, at row counts on both sides of the switch):
//   * up to 32 rows of x (decode steps): the decoded group is the A tile (16 columns x 32 k,
//     written to L1 and loaded at once), x^T the B tile (16 k pairs x up to 16 rows; two B tiles
//     above 16 rows), C^T the result. Each group is decoded once and used at once: what bounds
//     this case is the decode. The threads share half blocks (32 columns).
//   * more rows (prefill): a 64-column block is decoded once over all k, each group transposed
//     (16 x 16 dwords) into B tiles, and every 16 rows of x are A tiles against them, as oneDNN
//     runs it: the decode is shared by all rows.
// Rows are computed independently either way, so a row's bits never depend on the batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AMX_TILE__) && \
    defined(__AMX_BF16__)

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <memory>

#include "genserve_ops.h"
#include "prefetch.h"

namespace {

constexpr int64_t BLOCK_N = 64;              // output columns per block a thread takes
constexpr int64_t QK = 32;                   // weights per quantized block (along k)
constexpr int64_t PAIRS = QK / 2;            // k pairs per block: rows of a B tile
constexpr int GROUPS = BLOCK_N / 16;         // 16-column groups (one tile each) per block
constexpr int FEW_ROWS = 16;                 // up to this many rows: W as the A tile
// The few-row paths prefetch the groups they will decode this many k blocks ahead. A thread reads
// two of every four groups (its half of each block), interleaved with ~100 instructions of
// decode per group: the hardware prefetchers left the loads waiting on memory, and prefetching
// made the 120 block products of a one-row step 1.28x faster and its logits 1.2x (A/B in one
// process; 8 and 12 blocks ahead did the same, 4 a little less).
constexpr int64_t PREFETCH_KBS = 8;

// Linux's arch_prctl request for the AMX tile data state (asm/prctl.h, XFEATURE_XTILEDATA): a
// process must ask once before its threads touch the tiles.
constexpr int ARCH_REQ_XCOMP_PERM = 0x1023;
constexpr int XFEATURE_XTILEDATA = 18;

bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return ok;
}

// The 64-byte tile configuration (palette 1) of Intel's AMX.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// GCC's tile intrinsics are asm statements that take addresses in registers and declare no
// memory use: the compiler does not know that tile loads read and tile stores write memory.
// Passing the address through an asm statement that clobbers memory makes the memory reachable
// from it live.
inline void memory_used(const void* p) { asm volatile("" : : "r"(p) : "memory"); }

// GCC's ldtilecfg statement names only the first 8 bytes as its operand: memory_used keeps the
// stores of the rest of the configuration. noipa (here and on the functions that run tiles):
// GCC's interprocedural analysis (ipa-modref, ipa-pure-const) does not see that the tile
// instructions read and write memory; at -O3 the products came out all zero without it.
__attribute__((noipa)) void configure_tiles(const TileConfig& cfg) {
  memory_used(&cfg);
  _tile_loadconfig(&cfg);
}

// Few rows (m <= 16): tmm0-1 C^T of 2 groups (16 columns x m fp32), tmm4 the B tile x^T
// (16 k pairs x m rows), tmm5-6 A tiles (16 columns x 32 k).
TileConfig few_rows_config(int m) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = t < 5 ? m * 4 : 64;
  }
  return cfg;
}

// 17 to 32 rows (m1 = m - 16): tmm0-1 C^T of 2 groups x rows 0-15, tmm2-3 of the same groups x
// the other m1 rows, tmm4-5 the B tiles x^T of the two row groups, tmm6-7 A tiles.
TileConfig two_row_groups_config(int m1) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16;
  for (int t : {0, 1, 4, 6, 7}) cfg.colsb[t] = 64;
  for (int t : {2, 3, 5}) cfg.colsb[t] = m1 * 4;
  return cfg;
}

// Many rows: tmm0-3 C of the 4 groups (rows x 16 fp32), tmm4 the A tile (rows x 32 k of x),
// tmm5-7 B tiles (16 k pairs x 16 columns x 2).
TileConfig many_rows_config(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = t < 5 ? rows : PAIRS;
    cfg.colsb[t] = 64;
  }
  return cfg;
}

// Q4_1 group: d[16] fp16, m[16] fp16, then per column 16 nibble bytes read as 8 little-endian
// words, word j holding q[j], q[8 + j], q[16 + j], q[24 + j] in its 4 nibbles from the lowest
// (`amx_pack` re-orders the file's nibbles so).
struct Q4_1 {
  static constexpr int64_t GROUP_BYTES = 64 + 16 * 16;

  // The group's 16 columns x 32 k as bf16, column-major: out[column][k] (16 x 64 bytes).
  static void decode(const uint8_t* group, uint16_t* out) {
    alignas(64) float d[16], m[16];
    _mm512_store_ps(d, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group))));
    _mm512_store_ps(m, _mm512_cvtph_ps(
                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + 32))));
    memory_used(d);            // broadcast each column's d and m from memory: no shuffles
    memory_used(m);
    const __m512 q_values = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    // With the 8 words broadcast to the 4 128-bit lanes, lane L shifts nibble L down: word
    // 8L + j then holds q[8L + j] in its low 4 bits.
    const __m512i shifts = _mm512_set_epi64(
        0x000C000C000C000CLL, 0x000C000C000C000CLL, 0x0008000800080008LL, 0x0008000800080008LL,
        0x0004000400040004LL, 0x0004000400040004LL, 0, 0);
    const uint8_t* nibbles = group + 64;
    for (int c = 0; c < 16; ++c) {
      const __m512 v = _mm512_fmadd_ps(_mm512_set1_ps(d[c]), q_values, _mm512_set1_ps(m[c]));
      const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(v, v);     // bf16 w(q), twice
      const __m512i words = _mm512_broadcast_i32x4(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(nibbles + c * 16)));
      _mm512_store_si512(out + c * QK,
                         _mm512_permutexvar_epi16(_mm512_srlv_epi16(words, shifts), table));
    }
  }
};

// Q8_0 group: d[16] fp16, then per column the block's 32 int8 q (ggml's block_q8_0).
struct Q8_0 {
  static constexpr int64_t GROUP_BYTES = 32 + 16 * 32;

  static void decode(const uint8_t* group, uint16_t* out) {
    alignas(64) float d[16];
    _mm512_store_ps(d, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group))));
    const uint8_t* q = group + 32;
    for (int c = 0; c < 16; ++c) {
      const __m512 dc = _mm512_set1_ps(d[c]);
      const __m512 lo = _mm512_mul_ps(dc, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c * 32)))));
      const __m512 hi = _mm512_mul_ps(dc, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c * 32 + 16)))));
      _mm512_store_si512(out + c * QK, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
};

// The two groups at `groups` into L1 (PREFETCH_KBS). Past the end of the matrix, a prefetch
// neither faults nor reads anything that matters.
template <class D>
inline void prefetch_groups(const uint8_t* groups) {
  for (int64_t o = 0; o < 2 * D::GROUP_BYTES; o += 64)
    genserve::prefetch_l1(groups + o);
}

// The C tiles tmm0-3, the sums of every path, start from zero.
inline void zero_c_tiles() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// 16 x 16 dwords in place: r[i] (row i) becomes column i. Two unpack stages transpose within
// 128-bit lanes, two 128-bit shuffle stages across them.
inline void transpose_16x16(__m512i r[16]) {
  __m512i a[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  __m512i b[16];               // b[4i + c], lane L: column 4L + c, rows 4i .. 4i + 3
  for (int i = 0; i < 4; ++i) {
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i s0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x44);
    const __m512i s1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xEE);
    const __m512i s2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x44);
    const __m512i s3 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(s0, s2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(s0, s2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(s1, s3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
  }
}

// Few rows: half a 64-column block (groups 2 * half and 2 * half + 1; kbs blocks of 32 k) against
// x^T (xt: [k pairs][m] dwords) -> c[32 columns][m] fp32. a: 2 decoded groups (2 KB). Half
// blocks, not whole ones, are what the threads share: a 576-column matrix is 18 of them, which
// 2 threads split evenly, where 9 whole blocks would leave one thread a ninth of the work idle.
template <class D>
__attribute__((noipa)) void few_rows_half_block(const uint8_t* block, int64_t kbs, int half,
                                                const uint32_t* xt, int m, uint16_t* a, float* c) {
  memory_used(xt);
  memory_used(a);
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t kb = 0; kb < kbs; ++kb) {
    const uint8_t* blk = block + (kb * GROUPS + 2 * half) * D::GROUP_BYTES;
    prefetch_groups<D>(blk + PREFETCH_KBS * GROUPS * D::GROUP_BYTES);
    D::decode(blk, a);
    D::decode(blk + D::GROUP_BYTES, a + 16 * QK);
    memory_used(a);
    _tile_loadd(4, xt + kb * PAIRS * m, m * 4);
    _tile_loadd(5, a, 64);
    _tile_dpbf16ps(0, 5, 4);
    _tile_loadd(6, a + 16 * QK, 64);
    _tile_dpbf16ps(1, 6, 4);
    memory_used(a);            // the next block's decode writes what these loads read
  }
  _tile_stored(0, c, m * 4);
  _tile_stored(1, c + 16 * m, m * 4);
  memory_used(c);
}

// 17 to 32 rows: half a 64-column block (groups g0 = 2 * half, g0 + 1) against x^T in two row
// groups (xt0: [k pairs][16] dwords, rows 0-15; xt1: [k pairs][m1], the other m1 rows) ->
// c[2 groups][16 columns][16] (rows 0-15), then c[2][16][m1]. a: 2 decoded groups (2 KB).
template <class D>
__attribute__((noipa)) void two_row_groups_half_block(const uint8_t* block, int64_t kbs, int half,
                                                      const uint32_t* xt0, const uint32_t* xt1,
                                                      int m1, uint16_t* a, float* c) {
  memory_used(xt0);
  memory_used(xt1);
  memory_used(a);
  zero_c_tiles();
  for (int64_t kb = 0; kb < kbs; ++kb) {
    const uint8_t* blk = block + (kb * GROUPS + 2 * half) * D::GROUP_BYTES;
    prefetch_groups<D>(blk + PREFETCH_KBS * GROUPS * D::GROUP_BYTES);
    D::decode(blk, a);
    D::decode(blk + D::GROUP_BYTES, a + 16 * QK);
    memory_used(a);
    _tile_loadd(4, xt0 + kb * PAIRS * 16, 64);
    _tile_loadd(5, xt1 + kb * PAIRS * m1, m1 * 4);
    _tile_loadd(6, a, 64);
    _tile_loadd(7, a + 16 * QK, 64);
    _tile_dpbf16ps(0, 6, 4);
    _tile_dpbf16ps(1, 7, 4);
    _tile_dpbf16ps(2, 6, 5);
    _tile_dpbf16ps(3, 7, 5);
    memory_used(a);
  }
  _tile_stored(0, c, 64);
  _tile_stored(1, c + 16 * 16, 64);
  _tile_stored(2, c + 32 * 16, m1 * 4);
  _tile_stored(3, c + 32 * 16 + 16 * m1, m1 * 4);
  memory_used(c);
}

// Many rows: one 64-column block decoded over all k and transposed into B tiles:
// out[k pair][64 columns][2] bf16 (packed_linear's layout).
template <class D>
__attribute__((noipa)) void decode_block_b(const uint8_t* block, int64_t kbs, uint16_t* out) {
  alignas(64) uint16_t a[16 * QK];
  for (int64_t kb = 0; kb < kbs; ++kb) {
    const uint8_t* blk = block + kb * GROUPS * D::GROUP_BYTES;
    for (int g = 0; g < GROUPS; ++g) {
      D::decode(blk + g * D::GROUP_BYTES, a);
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(a + i * QK);
      transpose_16x16(r);      // r[pair]: the pair of each of the 16 columns
      for (int p = 0; p < PAIRS; ++p)
        _mm512_storeu_si512(out + ((kb * PAIRS + p) * BLOCK_N + g * 16) * 2, r[p]);
    }
  }
  memory_used(out);
}

// Many rows: up to 16 rows of x (bf16 [.., k], row stride k) times a decoded block
// [kp][64][2] -> y[rows][64].
__attribute__((noipa)) void many_rows_block(const uint16_t* x, int64_t k, const uint16_t* decoded,
                                            int rows, c10::BFloat16* y, int64_t y_stride) {
  constexpr int64_t B_STRIDE = BLOCK_N * 2 * 2;     // bytes between a B tile's rows
  memory_used(x);
  memory_used(decoded);
  zero_c_tiles();
  for (int64_t kb = 0; kb < k / QK; ++kb) {
    const uint16_t* b = decoded + kb * PAIRS * BLOCK_N * 2;
    _tile_loadd(4, x + kb * QK, k * 2);
    _tile_loadd(5, b, B_STRIDE);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, b + 32, B_STRIDE);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, b + 64, B_STRIDE);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, b + 96, B_STRIDE);
    _tile_dpbf16ps(3, 4, 5);
  }
  alignas(64) float c[16 * BLOCK_N];
  _tile_stored(0, c, BLOCK_N * 4);
  _tile_stored(1, c + 16, BLOCK_N * 4);
  _tile_stored(2, c + 32, BLOCK_N * 4);
  _tile_stored(3, c + 48, BLOCK_N * 4);
  memory_used(c);
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < GROUPS; ++g)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * y_stride + g * 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(c + r * BLOCK_N + g * 16)));
}

// x^T of `rows` rows of x from row r0 (x32: [M][kp] bf16 pairs): [kp][rows] pairs, the B operand
// of the few-row paths.
std::unique_ptr<uint32_t[]> transpose_rows(const uint32_t* x32, int64_t kp, int64_t r0, int64_t rows) {
  std::unique_ptr<uint32_t[]> xt(new uint32_t[kp * rows]);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t p = 0; p < kp; ++p) xt[p * rows + r] = x32[(r0 + r) * kp + p];
  return xt;
}

// C^T of a half block for `rows` rows (c: [2 groups][16 columns][rows] fp32) into y (row stride
// n): each row's 32 outputs rounded once to bf16.
inline void store_columns(const float* c, int rows, c10::BFloat16* y, int64_t n) {
  const __m512i column_starts = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(rows));
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < 2; ++g) {
      const __m512 v = rows == 1 ? _mm512_loadu_ps(c + g * 16)
                                 : _mm512_i32gather_ps(column_starts, c + g * 16 * rows + r, 4);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * n + g * 16),
                          (__m256i)_mm512_cvtneps_pbh(v));
    }
}

template <class D>
at::Tensor amx_linear(const char* name, const at::Tensor& x, const at::Tensor& w) {
  constexpr int64_t BYTES_PER_32 = D::GROUP_BYTES / 16;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, name,
              ": x must be a contiguous bf16 [M, K] tensor");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kByte &&
                  w.size(1) % BYTES_PER_32 == 0,
              name, ": the weight must be a contiguous uint8 [N, K / 32 * ", BYTES_PER_32,
              "] tensor");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(w.size(1) / BYTES_PER_32 * QK == k, name, ": x has K = ", k, ", the weight ",
              w.size(1) / BYTES_PER_32 * QK);
  TORCH_CHECK(n % BLOCK_N == 0 && k % QK == 0, name, ": N must be a multiple of ", BLOCK_N,
              " and K of ", QK, ", got N = ", n, ", K = ", k);
  TORCH_CHECK(amx_permitted(), name, ": Linux refused the AMX tile state "
              "(arch_prctl ARCH_REQ_XCOMP_PERM)");
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const uint8_t* ws = w.data_ptr<uint8_t>();
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
  c10::BFloat16* ys = y.data_ptr<c10::BFloat16>();
  const int64_t kp = k / 2, kbs = k / QK;
  const int64_t block_bytes = kbs * GROUPS * D::GROUP_BYTES;
  if (m <= 2 * FEW_ROWS) {
    // x^T in row groups: rows 0-15 (all m when m <= 16), then the other m1 rows. One row is
    // x itself.
    const auto* x32 = reinterpret_cast<const uint32_t*>(xs);
    const int m0 = static_cast<int>(std::min<int64_t>(m, FEW_ROWS));
    const int m1 = static_cast<int>(m - m0);
    const std::unique_ptr<uint32_t[]> xt0 = m > 1 ? transpose_rows(x32, kp, 0, m0) : nullptr;
    const std::unique_ptr<uint32_t[]> xt1 = m1 > 0 ? transpose_rows(x32, kp, m0, m1) : nullptr;
    const uint32_t* xt = m > 1 ? xt0.get() : x32;
    const TileConfig cfg = m1 > 0 ? two_row_groups_config(m1) : few_rows_config(m0);
    at::parallel_for(0, 2 * n / BLOCK_N, 1, [&](int64_t begin, int64_t end) {
      alignas(64) uint16_t a[2 * 16 * QK];
      alignas(64) float c[2 * 16 * 2 * FEW_ROWS];
      configure_tiles(cfg);
      for (int64_t h = begin; h < end; ++h) {
        const int64_t b = h / 2;
        const int half = static_cast<int>(h % 2);
        c10::BFloat16* yh = ys + b * BLOCK_N + 2 * half * 16;
        if (m1 == 0) {
          few_rows_half_block<D>(ws + b * block_bytes, kbs, half, xt, m0, a, c);
          store_columns(c, m0, yh, n);
        } else {
          two_row_groups_half_block<D>(ws + b * block_bytes, kbs, half, xt, xt1.get(), m1, a, c);
          store_columns(c, FEW_ROWS, yh, n);
          store_columns(c + 2 * 16 * FEW_ROWS, m1, yh + FEW_ROWS * n, n);
        }
      }
      _tile_release();         // oneDNN configures its own tiles per call
    });
    return y;
  }
  at::parallel_for(0, n / BLOCK_N, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<uint16_t[]> decoded(new uint16_t[kp * BLOCK_N * 2]);
    int configured = 0;
    for (int64_t b = begin; b < end; ++b) {
      memory_used(decoded.get());  // the previous block's tile loads read the buffer first
      decode_block_b<D>(ws + b * block_bytes, kbs, decoded.get());
      for (int64_t r = 0; r < m; r += 16) {
        const int rows = static_cast<int>(std::min<int64_t>(16, m - r));
        if (rows != configured) {
          configure_tiles(many_rows_config(rows));
          configured = rows;
        }
        many_rows_block(xs + r * k, k, decoded.get(), rows, ys + r * n + b * BLOCK_N, n);
      }
    }
    if (configured) _tile_release();
  });
  return y;
}

}  // namespace

namespace genserve {

// x: bf16 [M, K] contiguous; q4: uint8 [N, K / 32 * 20], W's Q4_1 blocks in `amx_pack`'s layout
// (N % 64 == 0, K % 32 == 0). Returns bf16 [M, N]: per output one TDPBF16PS chain over k, rounded
// once to bf16 (header). Raises (RuntimeError) on another dtype or shape, or when Linux refuses
// this process the AMX tile state.
at::Tensor q4_amx_linear(const at::Tensor& x, const at::Tensor& q4) {
  return amx_linear<Q4_1>("q4_amx_linear", x, q4);
}

// As q4_amx_linear, from Q8_0 blocks: q8: uint8 [N, K / 32 * 34] in `amx_pack`'s layout.
at::Tensor q8_amx_linear(const at::Tensor& x, const at::Tensor& q8) {
  return amx_linear<Q8_0>("q8_amx_linear", x, q8);
}

}  // namespace genserve

TORCH_LIBRARY_FRAGMENT(genserve, m) {
  m.def("q4_amx_linear(Tensor x, Tensor q4) -> Tensor");
  m.def("q8_amx_linear(Tensor x, Tensor q8) -> Tensor");
}
TORCH_LIBRARY_IMPL(genserve, CPU, m) {
  m.impl("q4_amx_linear", &genserve::q4_amx_linear);
  m.impl("q8_amx_linear", &genserve::q8_amx_linear);
}

#endif  // AVX512-BF16, AVX512BW, AMX-TILE, AMX-BF16
