// The weight products of decoding on an x86 CPU, registered with XLA as FFI custom calls
// (jaxformer/kernels/cpu.py calls them; jaxformer/products.py says when).
//
// A decoding step multiplies a few rows of activations by every matrix of the model once: the
// time is the matrices' bytes read from memory. XLA:CPU's products read float32 on one core,
// bfloat16 through a float32 copy, and int8 and int4 well below the memory's speed
// (docs/performance.md). These read each matrix once, in the layout it is stored in, on every
// core XLA gives them, with the conversion (bfloat16 to float32, int4 to int8) done in registers:
//
//   kn_product     y[r, n] = sum_k x[r, k] w[k, n]        float32 or bfloat16 w stored [K, N]
//   nk_product     y[r, n] = sum_k x[r, k] w[n, k]        float32 or bfloat16 w stored [N, K]
//   int8_product   y[r, n] = sum_k x[r, k] w[n, k]        int8 x and w, summed exactly in int32
//   int4_product   y[r, n] = sum_g s[n, g] sum_{k in g} x[r, k] q[n, k]
//                                                         int8 x, int4 q in groups g with scales s
//
// Float products accumulate in float32 (a bfloat16 value widens exactly; products of two are
// exact in float32), each output's terms summed in an order of its own (a test bounds the
// difference from XLA's product by that of any summation order). The integer sums are exact.
//
// Built by `pip install` where a compiler is present (setup.py); compiled for the building
// machine's instructions, it registers its products only where AVX-512 (F, BW) and VNNI run.

#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define JAXFORMER_KERNELS 1
#include <immintrin.h>
#else
#define JAXFORMER_KERNELS 0
#endif

namespace ffi = xla::ffi;

namespace {

// ---------------------------------------------------------------------------------------------
// The work of one call split into chunks, taken one at a time by the calling thread and by
// helpers scheduled on XLA's intra-op threads. The caller takes chunks too, so the call finishes
// whether or not a helper ever starts; a helper that starts late finds none left. The chunks'
// state is shared (a helper may outlive the call); `body` is run only while the call waits.
// ---------------------------------------------------------------------------------------------
struct Chunks {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t count = 0;
  std::function<void(int64_t)> body;
};

void Take(Chunks& chunks) {
  for (int64_t c; (c = chunks.next.fetch_add(1, std::memory_order_relaxed)) < chunks.count;) {
    chunks.body(c);
    chunks.done.fetch_add(1, std::memory_order_release);
  }
}

void ParallelFor(ffi::ThreadPool& pool, int64_t count, std::function<void(int64_t)> body) {
  auto chunks = std::make_shared<Chunks>();
  chunks->count = count;
  chunks->body = std::move(body);
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), count - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([chunks] { Take(*chunks); });
  Take(*chunks);
  while (chunks->done.load(std::memory_order_acquire) < count) std::this_thread::yield();
}

#if JAXFORMER_KERNELS

// ----- float products ------------------------------------------------------------------------

inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 Load16(const uint16_t* p) {  // 16 bfloat16s widened: their bits are a float32's top half
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

inline float Widen(float v) { return v; }
inline float Widen(uint16_t v) {
  uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// x as float32 rows (a bfloat16 x widened once per call).
template <class T>
std::vector<float> Widened(const T* x, int64_t n) {
  std::vector<float> out(n);
  for (int64_t i = 0; i < n; ++i) out[i] = Widen(x[i]);
  return out;
}

// y[r, 0 : width] = sum_{k0 <= k < k1} x[r, k] w[k, n0 + (0 : width)] for RG rows of x (x at the
// group's first row, y at its first row with rows ldy apart): w's rows U at a time, each read as a
// run of `width` values, y's values in cache (stored once a U rows: 8 for one row of x; what y
// held before is never read).
template <int RG, int U, class W>
void KnTile(const float* x, int64_t K, const W* w, int64_t N, float* y, int64_t ldy, int64_t n0, int64_t width,
            int64_t k0, int64_t k1) {
  int64_t k = k0;
  bool fresh = true;  // (the first rows start the sums from zero)
  for (; k + U <= k1; k += U, fresh = false) {
    __m512 xk[RG][U];
    for (int r = 0; r < RG; ++r)
      for (int i = 0; i < U; ++i) xk[r][i] = _mm512_set1_ps(x[r * K + k + i]);
    const W* row = w + k * N + n0;
    for (int64_t v = 0; v < width; v += 16) {
      __m512 wk[U];
      for (int i = 0; i < U; ++i) wk[i] = Load16(row + i * N + v);
      for (int r = 0; r < RG; ++r) {
        __m512 acc = fresh ? _mm512_setzero_ps() : _mm512_loadu_ps(y + r * ldy + v);
        for (int i = 0; i < U; ++i) acc = _mm512_fmadd_ps(xk[r][i], wk[i], acc);  // in k's order
        _mm512_storeu_ps(y + r * ldy + v, acc);
      }
    }
  }
  for (; k < k1; ++k, fresh = false) {
    const W* row = w + k * N + n0;
    for (int r = 0; r < RG; ++r) {
      const __m512 xk = _mm512_set1_ps(x[r * K + k]);
      for (int64_t v = 0; v < width; v += 16) {
        const __m512 acc = fresh ? _mm512_setzero_ps() : _mm512_loadu_ps(y + r * ldy + v);
        _mm512_storeu_ps(y + r * ldy + v, _mm512_fmadd_ps(xk, Load16(row + v), acc));
      }
    }
  }
}

constexpr int64_t kSums = 16384;  // float32 sums a tile keeps (64 KiB: in L2), rows x columns
constexpr int64_t kTiles = 8;     // tiles a product is cut into at least, for the threads to share

// w [K, N] cut into tiles: panels of columns by slabs of rows, as many slabs as make kTiles tiles.
// A panel is as wide as kSums sums allow, the whole of w's rows for a row or two of x: a slab is
// then one run of memory, which the hardware prefetches (it stops at each 4 KiB page otherwise).
// One slab: each tile adds into y; several: into its slab's partial sums, added in the slabs'
// order at the end.
template <class W>
void KnProduct(ffi::ThreadPool& pool, const float* x, int64_t R, int64_t K, const W* w, int64_t N, float* y) {
  const int64_t width = std::min(N, std::max<int64_t>(256, kSums / R / 16 * 16)), panels = (N + width - 1) / width;
  const int64_t slabs = std::min<int64_t>(std::max<int64_t>(1, kTiles / panels), std::max<int64_t>(1, K / 64));
  const int64_t depth = (K + slabs - 1) / slabs;
  thread_local std::vector<float> partial;  // (the caller's, kept between calls: no allocation a call)
  partial.resize(std::max<size_t>(partial.size(), slabs > 1 ? slabs * R * N : 0));
  float* out = slabs > 1 ? partial.data() : y;
  ParallelFor(pool, panels * slabs, [=](int64_t t) {
    const int64_t n0 = (t % panels) * width, cols = std::min(width, N - n0);
    const int64_t k0 = (t / panels) * depth, k1 = std::min(K, k0 + depth);
    float* into = out + (t / panels) * R * N + n0;
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) KnTile<4, 4>(x + r * K, K, w, N, into + r * N, N, n0, cols, k0, k1);
    for (; r < R; ++r) KnTile<1, 8>(x + r * K, K, w, N, into + r * N, N, n0, cols, k0, k1);
  });
  if (slabs == 1) return;
  std::copy(out, out + R * N, y);
  for (int64_t s = 1; s < slabs; ++s) {  // the slabs' sums added in order
    const float* slab = out + s * R * N;
    for (int64_t i = 0; i < R * N; ++i) y[i] += slab[i];
  }
}

// The streaming products below read w's rows one after another, one run of memory, and ask for
// the bytes kAhead further on before they need them (the hardware's prefetcher alone, which stops
// at each 4 KiB page, left a core reading int8 at 13 GB/s against 20 with this).
constexpr int64_t kAhead = 4096;

inline void Ahead(const void* p) { _mm_prefetch(static_cast<const char*>(p) + kAhead, _MM_HINT_T0); }

// y[r, n] for one n (w at row n) and RG rows of x: a dot product along k, 16 lanes a vector and
// two vectors apart (two chains of sums), the lanes added last.
template <int RG, class W>
void NkRow(const float* x, int64_t K, const W* w, float* y, int64_t N) {
  __m512 acc[RG][2];
  for (int r = 0; r < RG; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    Ahead(w + k);
    Ahead(w + k + 16);  // (float32's 128 bytes: the second line)
    const __m512 w0 = Load16(w + k), w1 = Load16(w + k + 16);
    for (int r = 0; r < RG; ++r) {
      acc[r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * K + k), w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * K + k + 16), w1, acc[r][1]);
    }
  }
  if (k < K) {  // (K a multiple of 16)
    const __m512 w0 = Load16(w + k);
    for (int r = 0; r < RG; ++r) acc[r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * K + k), w0, acc[r][0]);
  }
  for (int r = 0; r < RG; ++r) y[r * N] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}

constexpr int64_t kRowsPerChunk = 32;  // w's rows (outputs) a chunk of the nk products covers

template <class W>
void NkProduct(ffi::ThreadPool& pool, const float* x, int64_t R, int64_t K, const W* w, int64_t N, float* y) {
  ParallelFor(pool, (N + kRowsPerChunk - 1) / kRowsPerChunk, [=](int64_t c) {
    const int64_t end = std::min(N, (c + 1) * kRowsPerChunk);
    for (int64_t n = c * kRowsPerChunk; n < end; ++n) {
      int64_t r = 0;
      for (; r + 4 <= R; r += 4) NkRow<4>(x + r * K, K, w + n * K, y + r * N + n, N);
      for (; r < R; ++r) NkRow<1>(x + r * K, K, w + n * K, y + r * N + n, N);
    }
  });
}

// ----- int8: W8A8 ------------------------------------------------------------------------------
// VNNI's dpbusd multiplies unsigned bytes by signed ones, four to an int32 lane. w is made
// unsigned, w + 128 (its top bit flipped), so that sum_k (w + 128) x = sum_k w x + 128 sum_k x:
// the second term is x's alone, taken off once per row at the end. Every sum is exact in int32
// while |sum| <= K 255 127 < 2^31 (K below 66,000; checked by the caller).

template <int RG>
void Int8Row(const int8_t* x, int64_t K, const int8_t* w, const int32_t* xsum, int32_t* y, int64_t N) {
  __m512i acc[RG][2];
  for (int r = 0; r < RG; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  int64_t k = 0;
  for (; k + 128 <= K; k += 128) {  // two vectors, two chains
    Ahead(w + k);
    Ahead(w + k + 64);
    const __m512i w0 = _mm512_xor_si512(_mm512_loadu_si512(w + k), flip);
    const __m512i w1 = _mm512_xor_si512(_mm512_loadu_si512(w + k + 64), flip);
    for (int r = 0; r < RG; ++r) {
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], w0, _mm512_loadu_si512(x + r * K + k));
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], w1, _mm512_loadu_si512(x + r * K + k + 64));
    }
  }
  for (; k < K; k += 64) {  // the rest, past K zeros on both sides
    const __mmask64 in = K - k >= 64 ? ~__mmask64(0) : (__mmask64(1) << (K - k)) - 1;
    const __m512i wk = _mm512_maskz_mov_epi8(in, _mm512_xor_si512(_mm512_maskz_loadu_epi8(in, w + k), flip));
    for (int r = 0; r < RG; ++r)
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], wk, _mm512_maskz_loadu_epi8(in, x + r * K + k));
  }
  for (int r = 0; r < RG; ++r)
    y[r * N] = _mm512_reduce_add_epi32(_mm512_add_epi32(acc[r][0], acc[r][1])) - 128 * xsum[r];
}

void Int8Product(ffi::ThreadPool& pool, const int8_t* x, int64_t R, int64_t K, const int8_t* w, int64_t N,
                 int32_t* y) {
  std::vector<int32_t> xsum(R, 0);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t k = 0; k < K; ++k) xsum[r] += x[r * K + k];
  const int32_t* sums = xsum.data();
  ParallelFor(pool, (N + kRowsPerChunk - 1) / kRowsPerChunk, [=](int64_t c) {
    const int64_t end = std::min(N, (c + 1) * kRowsPerChunk);
    for (int64_t n = c * kRowsPerChunk; n < end; ++n) {
      int64_t r = 0;
      for (; r + 4 <= R; r += 4) Int8Row<4>(x + r * K, K, w + n * K, sums + r, y + r * N + n, N);
      for (; r < R; ++r) Int8Row<1>(x + r * K, K, w + n * K, sums + r, y + r * N + n, N);
    }
  });
}

// ----- int4 in groups: W4A8 --------------------------------------------------------------------
// q is packed two values a byte, the even k in the low four bits. 128 values (64 bytes, four
// blocks of 32) are read at once: their low nibbles, the even k, and their high nibbles, the odd,
// each a 512-bit register whose 32-bit lane L holds four values of block L / 4, made unsigned,
// u = q + 8 (q in [-8, 7]: flipping the four-bit sign bit). x's rows are laid out once per call in
// the same order (`Int4Rows`: its evens, then its odds, 64 of each a step), and each lane of
// dpbusd(dpbusd(bias, u_even, x_even), u_odd, x_odd) starts from bias = -8 (its eight x's sum): the
// lane holds sum q x over its eight values, exact. The lanes are then widened to float32 and
// multiplied by their block's scale: y = sum over lanes of s_lane * lane.

struct Int4Rows {  // x's rows in the unpacked order (K rounded up to 128, zeros after), each lane's bias
  int64_t Kp;
  std::vector<int8_t> x;      // [R, Kp]: per 128 values, the 64 evens then the 64 odds
  std::vector<int32_t> bias;  // [R, Kp / 8]: -8 (the sum of each lane's eight x)
};

Int4Rows LayOut(const int8_t* x, int64_t R, int64_t K) {
  const int64_t Kp = (K + 127) / 128 * 128;
  Int4Rows out{Kp, std::vector<int8_t>(R * Kp, 0), std::vector<int32_t>(R * Kp / 8, 0)};
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t t = 0; t < K; t += 64) {  // (K a multiple of 64: whole blocks of 32)
      int8_t* to = out.x.data() + r * Kp + t / 128 * 128 + t % 128 / 2;
      for (int j = 0; j < 32; ++j) {
        to[j] = x[r * K + t + 2 * j];           // evens
        to[64 + j] = x[r * K + t + 2 * j + 1];  // odds
      }
    }
    for (int64_t lane = 0; lane < Kp / 8; ++lane) {
      const int8_t* even = out.x.data() + r * Kp + lane / 16 * 128 + lane % 16 * 4;
      int32_t sum = 0;
      for (int i = 0; i < 4; ++i) sum += even[i] + even[64 + i];
      out.bias[r * Kp / 8 + lane] = -8 * sum;
    }
  }
  return out;
}

inline __m128 Scales4(const float* s, __mmask8 m) { return _mm_maskz_loadu_ps(m, s); }
inline __m128 Scales4(const uint16_t* s, __mmask8 m) {
  return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(_mm_maskz_loadu_epi16(m, s)), 16));
}

// Each lane's scale for the four blocks from value k (groups of G values; lane L: block L / 4).
template <int G, class S>
inline __m512 LaneScales(const S* s, int64_t k, int64_t K) {
  constexpr int per = 128 / G;  // the groups the four blocks span
  const int64_t have = std::min<int64_t>(per, (K - k + G - 1) / G);
  const __m512i which = G == 32 ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
                        : G == 64 ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
                                  : _mm512_setzero_si512();
  return _mm512_permutexvar_ps(which, _mm512_castps128_ps512(Scales4(s + k / G, __mmask8((1u << have) - 1))));
}

template <int RG, int G, class S>
void Int4Row(const int8_t* x, const int32_t* bias, int64_t Kp, int64_t K, const uint8_t* q, const S* s, float* y,
             int64_t N) {
  __m512 acc[RG];
  for (int r = 0; r < RG; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F), sign = _mm512_set1_epi8(0x08);
  for (int64_t k = 0; k < K; k += 128) {
    Ahead(q + k / 2);
    const __mmask64 in = K - k >= 128 ? ~__mmask64(0) : (__mmask64(1) << ((K - k) / 2)) - 1;
    const __m512i packed = _mm512_maskz_loadu_epi8(in, q + k / 2);  // (past K: u = 8 against x = 0)
    const __m512i even = _mm512_xor_si512(_mm512_and_si512(packed, low), sign);
    const __m512i odd = _mm512_xor_si512(_mm512_and_si512(_mm512_srli_epi16(packed, 4), low), sign);
    const __m512 scale = LaneScales<G>(s, k, K);
    for (int r = 0; r < RG; ++r) {
      const int8_t* xr = x + r * Kp + k;
      __m512i lanes = _mm512_dpbusd_epi32(_mm512_loadu_si512(bias + (r * Kp + k) / 8), even, _mm512_loadu_si512(xr));
      lanes = _mm512_dpbusd_epi32(lanes, odd, _mm512_loadu_si512(xr + 64));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes), scale, acc[r]);
    }
  }
  for (int r = 0; r < RG; ++r) y[r * N] = _mm512_reduce_add_ps(acc[r]);
}

template <int G, class S>
void Int4Product(ffi::ThreadPool& pool, const Int4Rows& rows, int64_t R, int64_t K, const uint8_t* q, const S* s,
                 int64_t N, float* y) {
  const int8_t* x = rows.x.data();
  const int32_t* bias = rows.bias.data();
  const int64_t Kp = rows.Kp;
  ParallelFor(pool, (N + kRowsPerChunk - 1) / kRowsPerChunk, [=](int64_t c) {
    const int64_t end = std::min(N, (c + 1) * kRowsPerChunk);
    for (int64_t n = c * kRowsPerChunk; n < end; ++n) {
      const uint8_t* qn = q + n * (K / 2);
      const S* sn = s + n * (K / G);
      int64_t r = 0;
      for (; r + 4 <= R; r += 4) Int4Row<4, G>(x + r * Kp, bias + r * Kp / 8, Kp, K, qn, sn, y + r * N + n, N);
      for (; r < R; ++r) Int4Row<1, G>(x + r * Kp, bias + r * Kp / 8, Kp, K, qn, sn, y + r * N + n, N);
    }
  });
}

// ----- many rows: a packed panel of w, rows of x in blocks ----------------------------------------
// A prompt multiplies many rows by each matrix, and the time is arithmetic, not reading: each panel
// of kPanel outputs is laid out once a call, in cache, as the instructions read it, and every block
// of kBlock rows of x passes over it, its kBlock x kPanel sums held in registers.
//
//   float32:  P[k][32]        one vector of 16 outputs' weights at k; x[r, k] broadcast; FMA.
//   bfloat16: P[k/2][32][2]   16 outputs' pairs (k, k+1); x's pair broadcast; dpbf16ps adds both
//                             products into each float32 lane.
//   int8/int4: P[k/4][32][4]  16 outputs' quads of k as int32 words; x's quad + 128 broadcast as
//                             unsigned bytes; dpbusd adds the four products into each int32 lane.

constexpr int kPanel = 32;  // outputs a panel holds: two vectors
constexpr int64_t kStreamRows = 8;  // the most rows the streaming products take; more: the panels'

inline __mmask16 Mask(int64_t n) { return n >= 16 ? 0xFFFF : n <= 0 ? 0 : __mmask16((1u << n) - 1); }  // n of 16

inline __m512 Load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 Load16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
constexpr int64_t kSlice = 2048;  // values of k a float panel holds at a time (256 KiB of float32: in L2)

// Runs f.template operator()<MR>() for MR = rows (1 .. kBlock): the row blocks' kernels unrolled.
template <class F>
void ForRows(int64_t rows, F&& f) {
  switch (rows) {
    case 6: f.template operator()<6>(); break;
    case 5: f.template operator()<5>(); break;
    case 4: f.template operator()<4>(); break;
    case 3: f.template operator()<3>(); break;
    case 2: f.template operator()<2>(); break;
    default: f.template operator()<1>(); break;
  }
}

constexpr int64_t kBlock = 6;  // rows of x a block holds: 12 vectors of sums (int4: and 12 of its float totals)

// A block's MR x 32 float32 sums: y's (or zeros, `first`), then back into y, columns past `cols` untouched.
template <int MR>
struct Sums {
  __m512 acc[MR][2];
  __mmask16 m0, m1;

  Sums(const float* y, int64_t N, int64_t cols, bool first) : m0(Mask(cols)), m1(Mask(cols - 16)) {
    for (int r = 0; r < MR; ++r) {
      acc[r][0] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m0, y + r * N);
      acc[r][1] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m1, y + r * N + 16);
    }
  }

  void Store(float* y, int64_t N) const {
    for (int r = 0; r < MR; ++r) {
      _mm512_mask_storeu_ps(y + r * N, m0, acc[r][0]);
      _mm512_mask_storeu_ps(y + r * N + 16, m1, acc[r][1]);
    }
  }
};

// y[r, n0 + (0 : 32)] (+)= sum over the slice's k of x[r, k] P[k], MR rows: float32 x, panel of floats.
template <int MR>
void FloatBlock(const float* x, int64_t K, const float* panel, int64_t depth, float* y, int64_t N, int64_t cols,
                bool first) {
  Sums<MR> sums(y, N, cols, first);
  auto& acc = sums.acc;
  for (int64_t k = 0; k < depth; ++k) {
    const __m512 p0 = _mm512_loadu_ps(panel + k * kPanel), p1 = _mm512_loadu_ps(panel + k * kPanel + 16);
    for (int r = 0; r < MR; ++r) {
      const __m512 xk = _mm512_set1_ps(x[r * K + k]);
      acc[r][0] = _mm512_fmadd_ps(xk, p0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xk, p1, acc[r][1]);
    }
  }
  sums.Store(y, N);
}

// x [R, K] . w [K, N] for many rows, w float32 (bfloat16 widened into the panel).
template <class W>
void KnGemm(ffi::ThreadPool& pool, const float* x, int64_t R, int64_t K, const W* w, int64_t N, float* y) {
  ParallelFor(pool, (N + kPanel - 1) / kPanel, [=](int64_t c) {
    const int64_t n0 = c * kPanel, cols = std::min<int64_t>(kPanel, N - n0);
    thread_local std::vector<float> panel;  // (each thread's own, kept between calls: no allocation a chunk)
    panel.resize(std::max<size_t>(panel.size(), std::min(K, kSlice) * kPanel));
    for (int64_t k0 = 0; k0 < K; k0 += kSlice) {
      const int64_t depth = std::min(kSlice, K - k0);
      for (int64_t k = 0; k < depth; ++k) {  // the slice's rows of the panel, widened, zeros past N
        const W* row = w + (k0 + k) * N + n0;
        _mm512_storeu_ps(panel.data() + k * kPanel, Load16(row, Mask(cols)));
        _mm512_storeu_ps(panel.data() + k * kPanel + 16, Load16(row + 16, Mask(cols - 16)));
      }
      for (int64_t r = 0; r < R; r += kBlock) {
        ForRows(std::min(kBlock, R - r), [&]<int MR>() {
          FloatBlock<MR>(x + r * K + k0, K, panel.data(), depth, y + r * N + n0, N, cols, k0 == 0);
        });
      }
    }
  });
}

#if defined(__AVX512BF16__)
// bfloat16 x bfloat16 for many rows: the panel as pairs of k, [K/2][32][2], and dpbf16ps (both
// products of a pair, exact in float32, added to the lane; inputs below float32's normal range read
// as zero). x's rows rows Kp apart, Kp = K rounded up to even (the pad meets a zero row of w).
template <int MR>
void Bf16Block(const uint16_t* x, int64_t Kp, const uint16_t* panel, int64_t pairs, float* y, int64_t N, int64_t cols,
               bool first) {
  Sums<MR> sums(y, N, cols, first);
  auto& acc = sums.acc;
  for (int64_t kp = 0; kp < pairs; ++kp) {
    const __m512bh p0 = (__m512bh)_mm512_loadu_si512(panel + kp * 2 * kPanel);
    const __m512bh p1 = (__m512bh)_mm512_loadu_si512(panel + kp * 2 * kPanel + 32);
    for (int r = 0; r < MR; ++r) {
      const __m512bh xk = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + r * Kp + 2 * kp));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xk, p0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xk, p1);
    }
  }
  sums.Store(y, N);
}

void Bf16Gemm(ffi::ThreadPool& pool, const uint16_t* x, int64_t R, int64_t K, const uint16_t* w, int64_t N, float* y) {
  const int64_t Kp = K + K % 2;
  std::vector<uint16_t> padded(R * Kp, 0);
  for (int64_t r = 0; r < R; ++r) std::copy(x + r * K, x + (r + 1) * K, padded.begin() + r * Kp);
  const uint16_t* xs = padded.data();
  ParallelFor(pool, (N + kPanel - 1) / kPanel, [=](int64_t c) {
    const int64_t n0 = c * kPanel, cols = std::min<int64_t>(kPanel, N - n0);
    thread_local std::vector<uint16_t> panel;
    panel.resize(std::max<size_t>(panel.size(), std::min(Kp, kSlice) * kPanel));
    __m512i first, second;  // the pairs' order: a0 b0 a1 b1 ... of rows a = k, b = k + 1
    alignas(64) uint16_t order[64];
    for (int i = 0; i < 32; ++i) order[2 * i] = i, order[2 * i + 1] = 32 + i;
    first = _mm512_load_si512(order);
    second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
    for (int64_t k0 = 0; k0 < K; k0 += kSlice) {
      const int64_t depth = std::min(kSlice, K - k0), pairs = (depth + 1) / 2;
      const __mmask32 in = cols >= 32 ? ~__mmask32(0) : (__mmask32(1) << cols) - 1;
      for (int64_t kp = 0; kp < pairs; ++kp) {
        const int64_t k = k0 + 2 * kp;
        const __m512i a = _mm512_maskz_loadu_epi16(in, w + k * N + n0);
        const __m512i b = k + 1 < K ? _mm512_maskz_loadu_epi16(in, w + (k + 1) * N + n0) : _mm512_setzero_si512();
        _mm512_storeu_si512(panel.data() + kp * 2 * kPanel, _mm512_permutex2var_epi16(a, first, b));
        _mm512_storeu_si512(panel.data() + kp * 2 * kPanel + 32, _mm512_permutex2var_epi16(a, second, b));
      }
      for (int64_t r = 0; r < R; r += kBlock) {
        ForRows(std::min(kBlock, R - r), [&]<int MR>() {
          Bf16Block<MR>(xs + r * Kp + k0, Kp, panel.data(), pairs, y + r * N + n0, N, cols, k0 == 0);
        });
      }
    }
  });
}
#endif  // __AVX512BF16__

// int8 and int4: the panel's words, and per group (int8: the whole of K) and output 128 sum w, the
// term that x + 128 adds.
struct IntPanel {
  std::vector<int32_t> words;  // [K4, kPanel]: word (k4, i) = w[n0 + i, 4 k4 .. 4 k4 + 3]
  std::vector<int32_t> extra;  // [groups, kPanel]
};

// The 16 x 16 matrix of 32-bit words in r (row i in r[i]) transposed in place: r[c] its column c.
inline void Transpose16(__m512i (&r)[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: rows 2i, 2i + 1 interleaved
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + j], lane L: rows i .. i + 3 of column j + 4 L
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // the lanes transposed: column j + 4 L gathers lane L of u[j], u[4 + j], ...
    const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44), v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44), v3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
    r[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[j + 4] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[j + 8] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[j + 12] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// Lays out 32 rows of int8 values [., K] (`values(i)`: row i's, or null: zeros) as the panel's words,
// 16 rows by 16 words at a time, and adds up each group's 128 sum w (dpbusd of 1s and the words).
template <class Values>
void Pack(IntPanel& p, int64_t K, int64_t group, Values values) {
  const int64_t K4 = (K + 3) / 4;
  p.words.assign(K4 * kPanel, 0);
  p.extra.assign((K + group - 1) / group * kPanel, 0);
  const __m512i ones = _mm512_set1_epi8(1);
  for (int half = 0; half < 2; ++half) {
    for (int64_t k = 0; k < K; k += 64) {  // words k / 4 .. k / 4 + 15
      const __mmask64 in = K - k >= 64 ? ~__mmask64(0) : (__mmask64(1) << (K - k)) - 1;
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const int8_t* v = values(16 * half + i);
        r[i] = v == nullptr ? _mm512_setzero_si512() : _mm512_maskz_loadu_epi8(in, v + k);
      }
      Transpose16(r);
      for (int c = 0; c < 16 && k / 4 + c < K4; ++c) {
        const int64_t k4 = k / 4 + c;
        _mm512_storeu_si512(&p.words[k4 * kPanel + 16 * half], r[c]);
        int32_t* extra = &p.extra[(4 * k4 / group) * kPanel + 16 * half];  // (a group holds whole words)
        _mm512_storeu_si512(extra, _mm512_add_epi32(_mm512_loadu_si512(extra),
                                                    _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(),
                                                                                          ones, r[c]), 7)));
      }
    }
  }
}

// MR rows (xu: x + 128 as bytes, rows K4 words apart) by the panel's words [from, to): the int32 sums.
template <int MR>
inline void IntSums(const uint8_t* xu, int64_t K4, const int32_t* words, int64_t from, int64_t to,
                    __m512i (&acc)[MR][2]) {
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
  for (int64_t k4 = from; k4 < to; ++k4) {
    const __m512i p0 = _mm512_loadu_si512(words + k4 * kPanel), p1 = _mm512_loadu_si512(words + k4 * kPanel + 16);
    for (int r = 0; r < MR; ++r) {
      const __m512i xk = _mm512_set1_epi32(reinterpret_cast<const int32_t*>(xu)[r * K4 + k4]);
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], xk, p0);
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], xk, p1);
    }
  }
}

// x's rows + 128 as bytes, each padded to K4 words (the padding meets zero words).
std::vector<uint8_t> Shifted(const int8_t* x, int64_t R, int64_t K) {
  const int64_t K4 = (K + 3) / 4;
  std::vector<uint8_t> out(R * K4 * 4, 0);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t k = 0; k < K; ++k) out[r * K4 * 4 + k] = uint8_t(x[r * K + k]) ^ 0x80;
  return out;
}

void Int8Gemm(ffi::ThreadPool& pool, const int8_t* x, int64_t R, int64_t K, const int8_t* w, int64_t N, int32_t* y) {
  const std::vector<uint8_t> xu = Shifted(x, R, K);
  const int64_t K4 = (K + 3) / 4;
  const uint8_t* xs = xu.data();
  ParallelFor(pool, (N + kPanel - 1) / kPanel, [=](int64_t c) {
    const int64_t n0 = c * kPanel, cols = std::min<int64_t>(kPanel, N - n0);
    thread_local IntPanel panel;
    Pack(panel, K, K, [&](int i) { return i < cols ? w + (n0 + i) * K : nullptr; });
    const __m512i extra0 = _mm512_loadu_si512(panel.extra.data()), extra1 = _mm512_loadu_si512(panel.extra.data() + 16);
    for (int64_t r0 = 0; r0 < R; r0 += kBlock) {
      ForRows(std::min(kBlock, R - r0), [&]<int MR>() {
        __m512i acc[MR][2];
        IntSums<MR>(xs + r0 * K4 * 4, K4, panel.words.data(), 0, K4, acc);
        for (int r = 0; r < MR; ++r) {
          int32_t* out = y + (r0 + r) * N + n0;
          _mm512_mask_storeu_epi32(out, Mask(cols), _mm512_sub_epi32(acc[r][0], extra0));
          _mm512_mask_storeu_epi32(out + 16, Mask(cols - 16), _mm512_sub_epi32(acc[r][1], extra1));
        }
      });
    }
  });
}

// Row n of a packed int4 matrix [N, K / 2] as int8 values in order (the even k in the low bits), 64 at
// a time: the two nibbles of each byte interleaved, then made signed, (v ^ 8) - 8.
void Unpack(const uint8_t* q, int64_t K, int8_t* out) {
  const __m256i low = _mm256_set1_epi8(0x0F), sign = _mm256_set1_epi8(0x08);
  for (int64_t k = 0; k < K; k += 64) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)(q + k / 2));
    const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    const __m256i a = _mm256_unpacklo_epi8(lo, hi), b = _mm256_unpackhi_epi8(lo, hi);  // per lane, in order
    const __m256i first = _mm256_permute2x128_si256(a, b, 0x20), second = _mm256_permute2x128_si256(a, b, 0x31);
    _mm256_storeu_si256((__m256i*)(out + k), _mm256_sub_epi8(_mm256_xor_si256(first, sign), sign));
    _mm256_storeu_si256((__m256i*)(out + k + 32), _mm256_sub_epi8(_mm256_xor_si256(second, sign), sign));
  }
}

template <class S>
void Int4Gemm(ffi::ThreadPool& pool, const int8_t* x, int64_t R, int64_t K, const uint8_t* q, const S* s, int64_t G,
              int64_t N, float* y) {
  const std::vector<uint8_t> xu = Shifted(x, R, K);
  const int64_t K4 = K / 4, groups = K / G;
  const uint8_t* xs = xu.data();
  ParallelFor(pool, (N + kPanel - 1) / kPanel, [=](int64_t c) {
    const int64_t n0 = c * kPanel, cols = std::min<int64_t>(kPanel, N - n0);
    thread_local std::vector<int8_t> values;
    values.resize(std::max<size_t>(values.size(), kPanel * K));
    for (int i = 0; i < cols; ++i) Unpack(q + (n0 + i) * (K / 2), K, values.data() + i * K);
    thread_local IntPanel panel;
    Pack(panel, K, G, [&](int i) { return i < cols ? values.data() + i * K : nullptr; });
    thread_local std::vector<float> scales;  // [groups, kPanel]
    scales.assign(groups * kPanel, 0.0f);
    for (int i = 0; i < cols; ++i)
      for (int64_t g = 0; g < groups; ++g) scales[g * kPanel + i] = Widen(s[(n0 + i) * groups + g]);
    for (int64_t r0 = 0; r0 < R; r0 += kBlock) {
      ForRows(std::min(kBlock, R - r0), [&]<int MR>() {
        {
          __m512 total[MR][2];
          for (int r = 0; r < MR; ++r) total[r][0] = total[r][1] = _mm512_setzero_ps();
          for (int64_t g = 0; g < groups; ++g) {  // each group's exact sums, scaled, added in the groups' order
            __m512i acc[MR][2];
            IntSums<MR>(xs + r0 * K4 * 4, K4, panel.words.data(), g * G / 4, (g + 1) * G / 4, acc);
            const int32_t* extra = panel.extra.data() + g * kPanel;
            const float* scale = scales.data() + g * kPanel;
            for (int r = 0; r < MR; ++r)
              for (int j = 0; j < 2; ++j)
                total[r][j] = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][j], _mm512_loadu_si512(extra + 16 * j))),
                    _mm512_loadu_ps(scale + 16 * j), total[r][j]);
          }
          for (int r = 0; r < MR; ++r) {
            float* out = y + (r0 + r) * N + n0;
            _mm512_mask_storeu_ps(out, Mask(cols), total[r][0]);
            _mm512_mask_storeu_ps(out + 16, Mask(cols - 16), total[r][1]);
          }
        }
      });
    }
  });
}

#endif  // JAXFORMER_KERNELS

// ----- the FFI handlers ------------------------------------------------------------------------
// Each checks what it is given (jaxformer/kernels/cpu.py sends only what they take, so an error
// here is a bug there) and writes its result.

ffi::Error Refuse(const char* what) { return ffi::Error::InvalidArgument(std::string("jaxformer cpu product: ") + what); }

bool Matrix(const ffi::AnyBuffer& a, int64_t& rows, int64_t& cols) {
  const auto dims = a.dimensions();
  if (dims.size() != 2) return false;
  rows = dims[0];
  cols = dims[1];
  return true;
}

bool Float(ffi::DataType t) { return t == ffi::DataType::F32 || t == ffi::DataType::BF16; }

#if JAXFORMER_KERNELS

// x [R, K] float32 or bfloat16 as float32 rows: the buffer's own, or widened into `widened`.
const float* FloatRows(const ffi::AnyBuffer& x, std::vector<float>& widened) {
  if (x.element_type() == ffi::DataType::F32) return static_cast<const float*>(x.untyped_data());
  widened = Widened(static_cast<const uint16_t*>(x.untyped_data()), x.element_count());
  return widened.data();
}

ffi::Error FloatImpl(bool kn, ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y) {
  int64_t R, K, a, b;
  if (!Matrix(x, R, K) || !Matrix(w, a, b) || !Float(x.element_type()) || !Float(w.element_type()))
    return Refuse("x and w must be float32 or bfloat16 matrices");
  const int64_t N = kn ? b : a;
  if ((kn ? a : b) != K || (kn ? N % 16 : K % 16 + N % 4))
    return Refuse("kn_product takes w [K, N], N a multiple of 16; nk_product w [N, K], K of 16 and N of 4");
  float* out = static_cast<float*>(y->untyped_data());
  const bool many = R > kStreamRows;
#if defined(__AVX512BF16__)
  if (kn && many && w.element_type() == ffi::DataType::BF16 && x.element_type() == ffi::DataType::BF16) {
    Bf16Gemm(pool, static_cast<const uint16_t*>(x.untyped_data()), R, K, static_cast<const uint16_t*>(w.untyped_data()),
             N, out);
    return ffi::Error::Success();
  }
#endif
  std::vector<float> widened;
  const float* xf = FloatRows(x, widened);
  auto run = [&](const auto* weights) {
    if (!kn) NkProduct(pool, xf, R, K, weights, N, out);
    else if (many) KnGemm(pool, xf, R, K, weights, N, out);
    else KnProduct(pool, xf, R, K, weights, N, out);
  };
  if (w.element_type() == ffi::DataType::F32) run(static_cast<const float*>(w.untyped_data()));
  else run(static_cast<const uint16_t*>(w.untyped_data()));
  return ffi::Error::Success();
}

ffi::Error KnImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y) {
  return FloatImpl(true, pool, x, w, y);
}

ffi::Error NkImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y) {
  return FloatImpl(false, pool, x, w, y);
}

ffi::Error Int8Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y) {
  int64_t R, K, N, K2;
  if (!Matrix(x, R, K) || !Matrix(w, N, K2) || K2 != K || x.element_type() != ffi::DataType::S8 ||
      w.element_type() != ffi::DataType::S8 || N % 4 || K >= 66000)
    return Refuse("int8_product takes int8 x [R, K] and w [N, K], N a multiple of 4, K below 66,000");
  (R > kStreamRows ? Int8Gemm : Int8Product)(pool, static_cast<const int8_t*>(x.untyped_data()), R, K,
                                             static_cast<const int8_t*>(w.untyped_data()), N,
                                             static_cast<int32_t*>(y->untyped_data()));
  return ffi::Error::Success();
}

ffi::Error Int4Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer q, ffi::AnyBuffer s,
                    ffi::Result<ffi::AnyBuffer> y) {
  int64_t R, K, N, K2, N2, groups;
  if (!Matrix(x, R, K) || !Matrix(q, N, K2) || !Matrix(s, N2, groups) || K2 != K || N2 != N || K % 64 ||
      x.element_type() != ffi::DataType::S8 || q.element_type() != ffi::DataType::S4 || !Float(s.element_type()))
    return Refuse("int4_product takes int8 x [R, K], int4 q [N, K] and float scales [N, groups], K a multiple of 64");
  const int64_t G = K / groups;
  if (groups * G != K || (G != 32 && G != 64 && G != 128)) return Refuse("groups of 32, 64 or 128");
  const auto* xq = static_cast<const int8_t*>(x.untyped_data());
  const auto* packed = static_cast<const uint8_t*>(q.untyped_data());
  float* out = static_cast<float*>(y->untyped_data());
  const void* scales = s.untyped_data();
  const bool wide = s.element_type() == ffi::DataType::F32;
  if (R > kStreamRows) {
    if (wide) Int4Gemm(pool, xq, R, K, packed, static_cast<const float*>(scales), G, N, out);
    else Int4Gemm(pool, xq, R, K, packed, static_cast<const uint16_t*>(scales), G, N, out);
    return ffi::Error::Success();
  }
  const Int4Rows rows = LayOut(xq, R, K);
  auto run = [&](auto group) {
    constexpr int g = decltype(group)::value;
    if (wide) Int4Product<g>(pool, rows, R, K, packed, static_cast<const float*>(scales), N, out);
    else Int4Product<g>(pool, rows, R, K, packed, static_cast<const uint16_t*>(scales), N, out);
  };
  if (G == 32) run(std::integral_constant<int, 32>());
  if (G == 64) run(std::integral_constant<int, 64>());
  if (G == 128) run(std::integral_constant<int, 128>());
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(kKnProduct, KnImpl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(kNkProduct, NkImpl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(kInt8Product, Int8Impl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(kInt4Product, Int4Impl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());

#endif  // JAXFORMER_KERNELS

// ----- the Python module -----------------------------------------------------------------------

// Whether this machine runs what was compiled: the instructions the build assumed.
bool Runs() {
#if JAXFORMER_KERNELS
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

PyObject* Targets(PyObject*, PyObject*) {
  PyObject* targets = PyDict_New();
#if JAXFORMER_KERNELS
  if (Runs()) {
    const std::pair<const char*, void*> handlers[] = {
        {"kn_product", reinterpret_cast<void*>(kKnProduct)},
        {"nk_product", reinterpret_cast<void*>(kNkProduct)},
        {"int8_product", reinterpret_cast<void*>(kInt8Product)},
        {"int4_product", reinterpret_cast<void*>(kInt4Product)},
    };
    for (const auto& [name, handler] : handlers) {
      PyObject* capsule = PyCapsule_New(handler, nullptr, nullptr);
      PyDict_SetItemString(targets, name, capsule);
      Py_DECREF(capsule);
    }
  }
#endif
  return targets;
}

PyMethodDef kMethods[] = {
    {"targets", Targets, METH_NOARGS, "The products' FFI handlers by name (none where this CPU cannot run them)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_cpu_products", nullptr, -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__cpu_products(void) { return PyModule_Create(&kModule); }
