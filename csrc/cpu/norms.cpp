// CPU kernels of the per-example gradient norms (math and tiling: csrc/include/fastdp/norms.h).
//
// Ghost norm: each example is packed once as fp32 panels of kNR rows ([k][kNR] per panel,
// GotoBLAS style; fp16/bf16 converted here). Gram tiles (kTile x kTile, t-block <= s-block)
// are made by a register-blocked micro-kernel, kMR x kNR, AVX-512 FMA when the CPU has it
// and portable loops otherwise, over column chunks that stay in L1; the a- and g-tiles'
// elementwise product is summed in fp32, tiles and work items in double, in a fixed order.
// Parallel over examples, or over an example's work items when there are few examples.
#include "cpu/norms.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FASTDP_NORMS_AVX512 1
#endif

namespace fastdp {
namespace {

constexpr int64_t kTile = kGhostTile;
constexpr int kMR = 8;   // rows (t) of a micro-tile
constexpr int kNR = 32;  // columns (s) of a micro-tile: two AVX-512 vectors
constexpr int kNRd = 16;  // the same for the certified norms' float64 micro-tiles
constexpr int64_t kChunk = 128;  // columns per pass over a Gram tile: two panel chunks (2 x 16 KiB) fit in L1
constexpr int64_t kShortSeq = 32;  // up to here: row dot products (padding a tile would cost more)
static_assert(kTile % kMR == 0 && kTile % kNR == 0 && kTile % kNRd == 0, "micro-tiles must tile a Gram tile");

// Packs rows [q0 * NR, q1 * NR) of x ([seq, k]: element (r, c) at r * ld + c * cs) as panels of NR rows of P
// (fp32, or float64 for the certified norms): out[(q * k + c) * NR + r] = x[q * NR + r, c];
// rows >= seq are zero. One k step of a panel is NR consecutive values: what the
// micro-kernel streams on both sides.
template <int NR, typename P, typename T>
void pack_panels(const T* x, int64_t seq, int64_t k, int64_t ld, int64_t q0, int64_t q1, P* out, int64_t cs = 1) {
  for (int64_t q = q0; q < q1; ++q) {
    P* panel = out + q * k * NR;
    const int64_t rows = std::min<int64_t>(NR, seq - q * NR);
    const T* src = x + q * NR * ld;
    for (int64_t c = 0; c < k; ++c) {
      P* dst = panel + c * NR;
      for (int64_t r = 0; r < rows; ++r) dst[r] = static_cast<P>(src[r * ld + c * cs]);
      for (int64_t r = rows; r < NR; ++r) dst[r] = P(0);
    }
  }
}

// c[r * kTile + j] (+)= sum_{k < kc} at[k * NR + r] * as[k * NR + j], r < kMR, j < NR:
// one micro-tile of a Gram tile over a chunk of kc columns (at: kMR rows inside a panel,
// as: a whole panel). Portable version.
template <int NR, typename P>
void micro_tile_generic(const P* at, const P* as, int64_t kc, P* c, bool accumulate) {
  P acc[kMR][NR];
  for (int r = 0; r < kMR; ++r) {
    for (int j = 0; j < NR; ++j) acc[r][j] = accumulate ? c[r * kTile + j] : P(0);
  }
  for (int64_t k = 0; k < kc; ++k) {
    for (int r = 0; r < kMR; ++r) {
      const P v = at[k * NR + r];
      for (int j = 0; j < NR; ++j) acc[r][j] += v * as[k * NR + j];
    }
  }
  for (int r = 0; r < kMR; ++r) {
    for (int j = 0; j < NR; ++j) c[r * kTile + j] = acc[r][j];
  }
}

#ifdef FASTDP_NORMS_AVX512
#define FASTDP_AVX512_INLINE __attribute__((target("avx512f"), always_inline)) inline

// One AVX-512 vector of P: float (16 lanes) for the ghost norms, double (8) for the certified ones.
template <typename P>
struct Avx512;

template <>
struct Avx512<float> {
  using V = __m512;
  static constexpr int kLanes = 16;
  FASTDP_AVX512_INLINE static V load(const float* p) { return _mm512_loadu_ps(p); }
  FASTDP_AVX512_INLINE static V zero() { return _mm512_setzero_ps(); }
  FASTDP_AVX512_INLINE static V broadcast(float x) { return _mm512_set1_ps(x); }
  FASTDP_AVX512_INLINE static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  FASTDP_AVX512_INLINE static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
};

template <>
struct Avx512<double> {
  using V = __m512d;
  static constexpr int kLanes = 8;
  FASTDP_AVX512_INLINE static V load(const double* p) { return _mm512_loadu_pd(p); }
  FASTDP_AVX512_INLINE static V zero() { return _mm512_setzero_pd(); }
  FASTDP_AVX512_INLINE static V broadcast(double x) { return _mm512_set1_pd(x); }
  FASTDP_AVX512_INLINE static V fmadd(V a, V b, V c) { return _mm512_fmadd_pd(a, b, c); }
  FASTDP_AVX512_INLINE static void store(double* p, V v) { _mm512_storeu_pd(p, v); }
};

static_assert(kNR == 2 * Avx512<float>::kLanes && kNRd == 2 * Avx512<double>::kLanes, "two vectors per micro-tile row");

// The micro-tile with AVX-512 FMA: 16 accumulators (kMR rows x two vectors; NR = 2 vectors of lanes).
template <typename P>
__attribute__((target("avx512f"))) void micro_tile_avx512(const P* at, const P* as, int64_t kc, P* c,
                                                          bool accumulate) {
  using A = Avx512<P>;
  constexpr int lanes = A::kLanes, nr = 2 * lanes;
  typename A::V acc[kMR][2];
#pragma GCC unroll 8
  for (int r = 0; r < kMR; ++r) {
    acc[r][0] = accumulate ? A::load(c + r * kTile) : A::zero();
    acc[r][1] = accumulate ? A::load(c + r * kTile + lanes) : A::zero();
  }
  for (int64_t k = 0; k < kc; ++k) {
    const typename A::V s0 = A::load(as + k * nr);
    const typename A::V s1 = A::load(as + k * nr + lanes);
#pragma GCC unroll 8
    for (int r = 0; r < kMR; ++r) {
      const typename A::V v = A::broadcast(at[k * nr + r]);
      acc[r][0] = A::fmadd(v, s0, acc[r][0]);
      acc[r][1] = A::fmadd(v, s1, acc[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kMR; ++r) {
    A::store(c + r * kTile, acc[r][0]);
    A::store(c + r * kTile + lanes, acc[r][1]);
  }
}

bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}
#else
bool cpu_has_avx512() { return false; }
#endif

// One micro-tile of either precision: AVX-512 where the CPU has it, else portable loops.
void micro_tile(bool avx512, const float* at, const float* as, int64_t kc, float* c, bool accumulate) {
#ifdef FASTDP_NORMS_AVX512
  if (avx512) return micro_tile_avx512<float>(at, as, kc, c, accumulate);
#endif
  micro_tile_generic<kNR>(at, as, kc, c, accumulate);
}

void micro_tile(bool avx512, const double* at, const double* as, int64_t kc, double* c, bool accumulate) {
#ifdef FASTDP_NORMS_AVX512
  if (avx512) return micro_tile_avx512<double>(at, as, kc, c, accumulate);
#endif
  micro_tile_generic<kNRd>(at, as, kc, c, accumulate);
}

// Gram tile c[r * kTile + j] = x[t0 + r] . x[s0 + j] for r < row_groups * kMR and
// j < col_panels * NR, from the packed panels xp of x ([seq, k]). Columns go in chunks
// of kChunk so a panel chunk of each side stays in L1 while the micro-tiles use it.
// upper: skip the micro-tiles wholly below the diagonal (t > s), left unwritten.
template <int NR, typename P>
void gram_tile(const P* xp, int64_t k, int64_t t0, int64_t row_groups, int64_t s0, int64_t col_panels, bool avx512,
               P* c, bool upper = false) {
  for (int64_t k0 = 0; k0 < k; k0 += kChunk) {
    const int64_t kc = std::min(kChunk, k - k0);
    for (int64_t q = 0; q < col_panels; ++q) {
      const P* as = xp + ((s0 / NR + q) * k + k0) * NR;
      for (int64_t i = 0; i < row_groups; ++i) {
        const int64_t row = t0 + i * kMR;
        if (upper && row > s0 + (q + 1) * NR - 1) continue;
        const P* at = xp + ((row / NR) * k + k0) * NR + row % NR;
        micro_tile(avx512, at, as, kc, c + i * kMR * kTile + q * NR, k0 > 0);
      }
    }
  }
}

// Sum over s-blocks j >= tb of <A_tile(tb, j), G_tile(tb, j)> (off-diagonal tiles twice),
// from the packed panels of one example. tiles: 2 * kTile * kTile floats.
double ghost_t_block(const float* ap, const float* gp, int64_t seq, int64_t d, int64_t p, int64_t tb, bool avx512,
                     float* tiles) {
  float* ca = tiles;
  float* cg = tiles + kTile * kTile;
  const int64_t t0 = tb * kTile;
  const int64_t row_groups = (std::min(kTile, seq - t0) + kMR - 1) / kMR;
  double total = 0.0;
  for (int64_t s0 = t0; s0 < seq; s0 += kTile) {
    const int64_t col_panels = (std::min(kTile, seq - s0) + kNR - 1) / kNR;
    gram_tile<kNR>(ap, d, t0, row_groups, s0, col_panels, avx512, ca);
    gram_tile<kNR>(gp, p, t0, row_groups, s0, col_panels, avx512, cg);
    float tile = 0.0f;  // padded rows and columns are zero in both tiles
    for (int64_t r = 0; r < row_groups * kMR; ++r) {
      for (int64_t j = 0; j < col_panels * kNR; ++j) tile += ca[r * kTile + j] * cg[r * kTile + j];
    }
    total += (s0 == t0 ? 1.0 : 2.0) * static_cast<double>(tile);  // off-diagonal: (t, s) and (s, t)
  }
  return total;
}

// Work item k of one example: t-blocks k and n-1-k (fastdp/norms.h).
double ghost_item(const float* ap, const float* gp, int64_t seq, int64_t d, int64_t p, int64_t item, bool avx512,
                  float* tiles) {
  const int64_t last = ghost_num_t_blocks(seq) - 1 - item;
  double total = ghost_t_block(ap, gp, seq, d, p, item, avx512, tiles);
  if (last != item) total += ghost_t_block(ap, gp, seq, d, p, last, avx512, tiles);
  return total;
}

// Short sequences (seq <= kShortSeq): the Gram entries as plain dot products of fp32
// rows, out = sum_t |a_t|^2 |g_t|^2 + 2 sum_{t<s} (a_t . a_s)(g_t . g_s); no padding to tiles.
float dot_generic(const float* x, const float* y, int64_t k) {
  float acc[8] = {};
  int64_t c = 0;
  for (; c + 8 <= k; c += 8) {
    for (int l = 0; l < 8; ++l) acc[l] += x[c + l] * y[c + l];
  }
  for (; c < k; ++c) acc[0] += x[c] * y[c];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

#ifdef FASTDP_NORMS_AVX512
__attribute__((target("avx512f"))) float dot_avx512(const float* x, const float* y, int64_t k) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 32 <= k; c += 32) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + c), _mm512_loadu_ps(y + c), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + c + 16), _mm512_loadu_ps(y + c + 16), acc1);
  }
  for (; c < k; c += 16) {
    const __mmask16 m = k - c >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (k - c)) - 1);
    acc0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + c), _mm512_maskz_loadu_ps(m, y + c), acc0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}
#endif

float dot(bool avx512, const float* x, const float* y, int64_t k) {
#ifdef FASTDP_NORMS_AVX512
  if (avx512) return dot_avx512(x, y, k);
#endif
  return dot_generic(x, y, k);
}

// Rows of x ([seq, k]) as fp32, row-major: the input itself for fp32, else converted into buf.
template <typename T>
const float* rows_as_float(const T* x, int64_t count, float* buf) {
  for (int64_t i = 0; i < count; ++i) buf[i] = static_cast<float>(x[i]);
  return buf;
}
template <>
const float* rows_as_float<float>(const float* x, int64_t, float*) {
  return x;
}

double ghost_short(const float* a, const float* g, int64_t seq, int64_t d, int64_t p, bool avx512) {
  double total = 0.0;
  for (int64_t t = 0; t < seq; ++t) {
    float row = 0.0f;  // sum over s > t, doubled below
    for (int64_t s = t + 1; s < seq; ++s) {
      row += dot(avx512, a + t * d, a + s * d, d) * dot(avx512, g + t * p, g + s * p, p);
    }
    const float diag = dot(avx512, a + t * d, a + t * d, d) * dot(avx512, g + t * p, g + t * p, p);
    total += static_cast<double>(diag) + 2.0 * static_cast<double>(row);
  }
  return total;
}

// Each example is packed once (fp32 panels, seq rounded up to kNR rows); its items are
// added in item order whichever way the work is split, so the result does not depend on
// the thread count. Many examples: one thread per example. Few: items in parallel.
template <typename T>
void ghost_norm_sq_typed(const T* a, const T* g, const GhostNormShape& shape, float* out) {
  const int64_t seq = shape.seq, d = shape.dim_a, p = shape.dim_g;
  const int64_t panels = (seq + kNR - 1) / kNR;
  const int64_t packed_a = panels * kNR * d, packed_g = panels * kNR * p;
  const int64_t items = ghost_items_per_example(seq);
  const bool avx512 = cpu_has_avx512();
  if (seq <= kShortSeq) {
    at::parallel_for(0, shape.batch, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(std::is_same<T, float>::value ? 0 : static_cast<size_t>(seq * (d + p)));
      for (int64_t b = begin; b < end; ++b) {
        const float* ab = rows_as_float(a + b * seq * d, seq * d, buf.data());
        const float* gb = rows_as_float(g + b * seq * p, seq * p, buf.empty() ? nullptr : buf.data() + seq * d);
        out[b] = static_cast<float>(ghost_short(ab, gb, seq, d, p, avx512));
      }
    });
    return;
  }
  if (shape.batch >= at::get_num_threads() || items == 1) {
    at::parallel_for(0, shape.batch, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(static_cast<size_t>(packed_a + packed_g + 2 * kTile * kTile));
      float* ap = buf.data();
      float* gp = ap + packed_a;
      for (int64_t b = begin; b < end; ++b) {
        pack_panels<kNR>(a + b * seq * d, seq, d, d, 0, panels, ap);
        pack_panels<kNR>(g + b * seq * p, seq, p, p, 0, panels, gp);
        double total = 0.0;
        for (int64_t k = 0; k < items; ++k) total += ghost_item(ap, gp, seq, d, p, k, avx512, gp + packed_g);
        out[b] = static_cast<float>(total);
      }
    });
    return;
  }
  std::vector<float> packed(static_cast<size_t>(packed_a + packed_g));
  float* ap = packed.data();
  float* gp = ap + packed_a;
  std::vector<double> partial(static_cast<size_t>(items));
  for (int64_t b = 0; b < shape.batch; ++b) {
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      pack_panels<kNR>(a + b * seq * d, seq, d, d, begin, end, ap);
      pack_panels<kNR>(g + b * seq * p, seq, p, p, begin, end, gp);
    });
    at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> tiles(static_cast<size_t>(2 * kTile * kTile));
      for (int64_t k = begin; k < end; ++k) partial[k] = ghost_item(ap, gp, seq, d, p, k, avx512, tiles.data());
    });
    double total = 0.0;
    for (int64_t k = 0; k < items; ++k) total += partial[k];
    out[b] = static_cast<float>(total);
  }
}

// ------------------------------------------------------------------ certified (float64) ghost norms
//
// The Grams of fastdp.ref.norms.certified_ghost_norm_sq in float64, tile by tile as above (no [T, T] buffers,
// no float64 copy of the batch): each example packed once as float64 panels of kNRd rows (float32, float16 and
// bfloat16 values convert exactly), the upper triangle only (micro-tiles of a diagonal tile wholly below its
// diagonal are skipped; entries above it count twice). Per example:
//   dot  = sum_t (a_t . a_t)(g_t . g_t) + 2 sum_{t<s} (a_t . a_s)(g_t . g_s)
//   mass = sum_t sqrt(a_t . a_t) sqrt(g_t . g_t)
// in float64 with FMAs, in a fixed order (independent of the thread count). The rounding bound of the reference
// holds for any order of a dot product's or a sum's additions, so it applies unchanged (the caller adds it).

// Adds one t-block's tiles (s-blocks >= tb) to dot, and its diagonal to mass. tiles: 2 kTile^2 doubles.
void certified_t_block(const double* ap, const double* gp, int64_t seq, int64_t d, int64_t p, int64_t tb,
                       bool avx512, double* tiles, double& dot, double& mass) {
  double* ca = tiles;
  double* cg = tiles + kTile * kTile;
  const int64_t t0 = tb * kTile;
  const int64_t rows = std::min(kTile, seq - t0);
  const int64_t row_groups = (rows + kMR - 1) / kMR;
  for (int64_t s0 = t0; s0 < seq; s0 += kTile) {
    const int64_t cols = std::min(kTile, seq - s0);
    const int64_t col_panels = (cols + kNRd - 1) / kNRd;
    const bool diagonal = s0 == t0;
    gram_tile<kNRd>(ap, d, t0, row_groups, s0, col_panels, avx512, ca, diagonal);
    gram_tile<kNRd>(gp, p, t0, row_groups, s0, col_panels, avx512, cg, diagonal);
    double above = 0.0;  // entries counted twice: the tile's strict upper triangle, or all of an off-diagonal tile
    for (int64_t r = 0; r < rows; ++r) {
      const double* ra = ca + r * kTile;
      const double* rg = cg + r * kTile;
      if (diagonal) {
        dot += ra[r] * rg[r];
        mass += std::sqrt(ra[r]) * std::sqrt(rg[r]);
      }
      for (int64_t j = diagonal ? r + 1 : 0; j < cols; ++j) above += ra[j] * rg[j];
    }
    dot += 2.0 * above;
  }
}

template <typename T>
void certified_ghost_typed(const T* a, const T* g, const GhostNormShape& shape, const GhostStrides& strides,
                           double* dot, double* mass) {
  const int64_t seq = shape.seq, d = shape.dim_a, p = shape.dim_g;
  const int64_t panels = (seq + kNRd - 1) / kNRd;
  const int64_t packed_a = panels * kNRd * d, packed_g = panels * kNRd * p;
  const int64_t blocks = ghost_num_t_blocks(seq);
  const bool avx512 = cpu_has_avx512();
  at::parallel_for(0, shape.batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> buf(static_cast<size_t>(packed_a + packed_g + 2 * kTile * kTile));
    double* ap = buf.data();
    double* gp = ap + packed_a;
    for (int64_t b = begin; b < end; ++b) {
      pack_panels<kNRd>(a + b * strides.batch_a, seq, d, strides.row_a, 0, panels, ap);
      pack_panels<kNRd>(g + b * strides.batch_g, seq, p, strides.row_g, 0, panels, gp);
      double total = 0.0, rows = 0.0;
      for (int64_t tb = 0; tb < blocks; ++tb) certified_t_block(ap, gp, seq, d, p, tb, avx512, gp + packed_g, total, rows);
      dot[b] = total;
      mass[b] = rows;
    }
  });
}

// Float64 Grams out[b] = X_b X_b^T ([T, T], both triangles) of rows X_b [T, K] (element (t, c) of example b at
// b * strides.batch + t * strides.row + c * strides.col): the tiles of certified_t_block, mirrored.
template <typename T>
void certified_gram_typed(const T* x, int64_t batch, int64_t seq, int64_t k, const GramStrides& strides, double* out) {
  const int64_t panels = (seq + kNRd - 1) / kNRd;
  const int64_t blocks = ghost_num_t_blocks(seq);
  const bool avx512 = cpu_has_avx512();
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> buf(static_cast<size_t>(panels * kNRd * k + kTile * kTile));
    double* xp = buf.data();
    double* tile = xp + panels * kNRd * k;
    for (int64_t b = begin; b < end; ++b) {
      pack_panels<kNRd>(x + b * strides.batch, seq, k, strides.row, 0, panels, xp, strides.col);
      double* gram = out + b * seq * seq;
      for (int64_t tb = 0; tb < blocks; ++tb) {
        const int64_t t0 = tb * kTile, rows = std::min(kTile, seq - t0);
        for (int64_t s0 = t0; s0 < seq; s0 += kTile) {
          const int64_t cols = std::min(kTile, seq - s0);
          const bool diagonal = s0 == t0;
          gram_tile<kNRd>(xp, k, t0, (rows + kMR - 1) / kMR, s0, (cols + kNRd - 1) / kNRd, avx512, tile, diagonal);
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t j = diagonal ? r : 0; j < cols; ++j) {
              gram[(t0 + r) * seq + s0 + j] = tile[r * kTile + j];
              gram[(s0 + j) * seq + t0 + r] = tile[r * kTile + j];
            }
          }
        }
      }
    }
  });
}

}  // namespace

void ghost_norm_sq_cpu(const void* a, const void* g, const GhostNormShape& shape, ScalarKind kind, float* out) {
  if (shape.seq == 0 || shape.dim_a == 0 || shape.dim_g == 0) {
    std::fill(out, out + shape.batch, 0.0f);
    return;
  }
  switch (kind) {
    case ScalarKind::kFloat32:
      ghost_norm_sq_typed(static_cast<const float*>(a), static_cast<const float*>(g), shape, out);
      break;
    case ScalarKind::kFloat16:
      ghost_norm_sq_typed(static_cast<const c10::Half*>(a), static_cast<const c10::Half*>(g), shape, out);
      break;
    case ScalarKind::kBFloat16:
      ghost_norm_sq_typed(static_cast<const c10::BFloat16*>(a), static_cast<const c10::BFloat16*>(g), shape, out);
      break;
  }
}

void clip_factors_cpu(const float* sq, int64_t layers, int64_t batch, float clip, float* norms, float* factors) {
  at::parallel_for(0, batch, 4096, [&](int64_t begin, int64_t end) {
    std::fill(norms + begin, norms + end, 0.0f);
    for (int64_t l = 0; l < layers; ++l) {
      const float* row = sq + l * batch;
      for (int64_t i = begin; i < end; ++i) norms[i] += row[i];
    }
    for (int64_t i = begin; i < end; ++i) {
      norms[i] = std::sqrt(norms[i]);
      const float f = clip / (norms[i] + kClipEps);
      factors[i] = f > 1.0f ? 1.0f : f;  // NaN > 1 is false: NaN stays NaN
    }
  });
}


void certified_ghost_norm_sq_cpu(const void* a, const void* g, const GhostNormShape& shape,
                                 const GhostStrides& strides, CertifiedKind kind, double* dot, double* mass) {
  if (shape.seq == 0 || shape.dim_a == 0 || shape.dim_g == 0) {
    std::fill(dot, dot + shape.batch, 0.0);
    std::fill(mass, mass + shape.batch, 0.0);
    return;
  }
  switch (kind) {
    case CertifiedKind::kFloat32:
      certified_ghost_typed(static_cast<const float*>(a), static_cast<const float*>(g), shape, strides, dot, mass);
      break;
    case CertifiedKind::kFloat64:
      certified_ghost_typed(static_cast<const double*>(a), static_cast<const double*>(g), shape, strides, dot, mass);
      break;
    case CertifiedKind::kFloat16:
      certified_ghost_typed(static_cast<const c10::Half*>(a), static_cast<const c10::Half*>(g), shape, strides, dot,
                            mass);
      break;
    case CertifiedKind::kBFloat16:
      certified_ghost_typed(static_cast<const c10::BFloat16*>(a), static_cast<const c10::BFloat16*>(g), shape,
                            strides, dot, mass);
      break;
  }
}


void certified_gram_cpu(const void* x, int64_t batch, int64_t seq, int64_t k, const GramStrides& strides,
                        CertifiedKind kind, double* out) {
  if (seq == 0) return;
  if (k == 0) {
    std::fill(out, out + batch * seq * seq, 0.0);
    return;
  }
  switch (kind) {
    case CertifiedKind::kFloat32:
      certified_gram_typed(static_cast<const float*>(x), batch, seq, k, strides, out);
      break;
    case CertifiedKind::kFloat64:
      certified_gram_typed(static_cast<const double*>(x), batch, seq, k, strides, out);
      break;
    case CertifiedKind::kFloat16:
      certified_gram_typed(static_cast<const c10::Half*>(x), batch, seq, k, strides, out);
      break;
    case CertifiedKind::kBFloat16:
      certified_gram_typed(static_cast<const c10::BFloat16*>(x), batch, seq, k, strides, out);
      break;
  }
}

}  // namespace fastdp
