// Paged attention: every row of a step attends straight from the pool of blocks, through its
// request's block table (the paper's section 4.1; vLLM's unified paged attention), prompt chunks,
// prefix-cache hits and decode rows in one loop. bfloat16 with a head size of 64, 128 or 256 runs
// on VDPBF16PS; everything else on plain loops through the same block order (kv_layout.h). The cache
// holds the model's dtype or 8-bit entries (kv_layout.h: to_cache), read as the numbers they stand for.
#include "ops.h"
#include "attention_jobs.h"
#include "kv_layout.h"
#include "vec16.h"

// ---- paged attention -------------------------------------------------------------------------
// For each KV head of a row: the row's G query heads (the heads that share this KV head, GQA) over
// the first n keys of its request, which the block table scatters over the pool. Three passes:
// the scores q . k of every query head with every key, a softmax over each head's scores, then
// the values weighted by it. The weights are rounded to T before they weigh the values, as SDPA's
// CPU kernel (and so Hugging Face) rounds them in bfloat16; the sum is the float32 one, as there.

// Softmax of n scores in place, 16 at a time: the weights rounded to T; returns 1 / their float32 sum.
template <typename T>
static inline float softmax_in_place(float* s, int64_t n) {
  // the last n % 16 scores as one more register, padded with -inf: a score past n weighs nothing.
  // (One exp_scalar per leftover score cost a prompt row of ~45 keys about as much as its dot
  // products: an exp is a register's work whether it fills one lane or sixteen.)
  const int64_t body = n - n % 16, tail = n - body;
  alignas(64) float last[16];
  for (int64_t i = 0; i < 16; ++i) last[i] = i < tail ? s[body + i] : -INFINITY;
  Vec16 mv = Vec16::load(last);
  for (int64_t t = 0; t < body; t += 16) mv = max(mv, Vec16::load(s + t));
  const Vec16 mx = Vec16::fill(mv.max());
  Vec16 sv = Vec16::fill(0.f);
  for (int64_t t = 0; t < body; t += 16) {
    const Vec16 e = exp(Vec16::load(s + t) - mx);
    round_to<T>(e).store(s + t);
    sv = sv + e;
  }
  if (tail) {
    exp(Vec16::load(last) - mx).store(last);
    for (int64_t i = tail; i < 16; ++i) last[i] = 0.f;     // exp clamps -inf to e^-87, not 0
    const Vec16 e = Vec16::load(last);
    sv = sv + e;
    round_to<T>(e).store(last);
    for (int64_t i = 0; i < tail; ++i) s[body + i] = last[i];
  }
  return 1.f / sv.sum();
}

// int8: each token's score (or weight) times the scale its K (or V) row carries, so that the passes
// over the cache multiply its codes alone; the other entries carry none.
template <typename C>
static inline void times_row_scales(float* x, const C* cache, const KvLayout& L, const int64_t* table, int64_t n,
                                    int64_t h) {
  if constexpr (std::is_same_v<C, int8_t>)
    for (int64_t t = 0; t < n; ++t) x[t] *= stored_scale(cache, L, table[t / L.block_size], t % L.block_size, h);
}

// Any dtype, any head_dim, any even block size: plain loops through KvLayout.
template <typename T, typename C>
static void attend_one_head_any(const T* q, int64_t q_head, const C* kc, const C* vc, const KvLayout& L,
                                const int64_t* table, int64_t n, int64_t h, int64_t G, float scale, T* out,
                                float* scores) {
  const int64_t D = L.D;
  std::vector<float> acc(D);
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * n;
    for (int64_t t = 0; t < n; ++t) {
      const int64_t block_id = table[t / L.block_size], j = t % L.block_size;
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += float(q[g * q_head + d]) * float(kc[L.k(block_id, j, h, d)]);
      s[t] = dot * scale;
    }
    times_row_scales(s, kc, L, table, n, h);
    const float inv = softmax_in_place<T>(s, n);
    times_row_scales(s, vc, L, table, n, h);
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t block_id = table[t / L.block_size], j = t % L.block_size;
      for (int64_t d = 0; d < D; ++d) acc[d] += s[t] * float(vc[L.v(block_id, j, h, d)]);
    }
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = T(acc[d] * inv);
  }
}

// One row of a job (JobHeads below): its query heads of h0 .. h1 (q), their output (out), its table and
// n keys; scores: units() (n + 16) floats; sums: units() (DIM + 1).
struct JobRow {
  const bf16* q; bf16* out; const int64_t* table; int64_t n; float *scores, *sums;
};

#if defined(__AVX512BF16__)
static inline uint32_t bf16_bits(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u >> 16; }  // x already rounded

// 32 entries of the cache (16 tokens x a pair of dims of K, or 16 dims x a pair of tokens of V) as
// 32 bfloat16 numbers, those outside `keep` zero: what VDPBF16PS multiplies.
static inline __m512bh load_pairs(const bf16* p, __mmask32 keep) {
  return (__m512bh)_mm512_maskz_loadu_epi16(keep, p);
}
// An fp8 entry is a bfloat16 number too, widened here in registers: e5m2 is the top byte of a
// float16; e4m3's byte, moved one bit lower (its sign back on top), is a float16 2^8 times too small.
// float16 -> float32 (x 2^8) -> bfloat16 is then exact. (e4m3 has no infinity; its NaN, which only a
// NaN stores, reads as a finite number.)
template <typename C>
static inline __m512bh load_pairs(const C* p, __mmask32 keep) {
  const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(keep, p));
  constexpr bool e5m2 = std::is_same_v<C, c10::Float8_e5m2>;
  const __m512i sign = _mm512_and_si512(bytes, _mm512_set1_epi16(0x80));     // e4m3: added, it moves to bit 8
  const __m512i half = e5m2 ? _mm512_slli_epi16(bytes, 8) : _mm512_slli_epi16(_mm512_add_epi16(bytes, sign), 7);
  const __m512 scale = _mm512_set1_ps(e5m2 ? 1.f : 256.f);
  const __m512 lo = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(half)), scale);
  const __m512 hi = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(half, 1)), scale);
  return _mm512_cvtne2ps_pbh(hi, lo);
}
static inline __m512bh load_pairs(const int8_t* p, __mmask32 keep) {    // int8's codes, exact in bfloat16
  const __m256i bytes = _mm256_maskz_loadu_epi8(keep, p);
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// bfloat16 on VDPBF16PS, block_size a multiple of 16. A job is one row's query heads of KV heads
// h0 .. h1, taken GC (at most 4) at a time, a "unit": their sums stay in registers only if the
// compiler knows how many there are. Scores: for each 16 tokens, each pair of dims p is one
// register of K (16 tokens x the pair) times q's pair p broadcast, summed into one register of 16
// scores per query head: no sum across a register. Values: for each pair of tokens, each 16 dims
// are one register of V (16 dims x the pair) times the two tokens' weights broadcast.
// Both passes go block by block and, inside a block, head by head: a block holds its KV heads one
// after another, so the job reads each block's K (and then V) as one run of memory, and a request
// whose blocks lie in order as one long run, which the CPU's prefetcher streams from memory.
// (Head by head over all blocks, the job read 1 / kv_heads of each block, a short run each time,
// and a decode step's attention took longer: measured in docs/05, "What it took to be fast".)
// `pairs` pairs of tokens of one block (V laid out at x: every dim's two values, pair after pair),
// the first of them pair `first` of the request, weighed into GC x DIM / 16 sums. Its own function
// with its own copy of the sums: the compiler then keeps them in registers through the loop.
template <int DIM, int GC, typename C>
static void __attribute__((noinline)) weigh_values(const C* x, int64_t first, int64_t pairs,
                                                   const int32_t* const* weights, float* sums, __mmask32 keep) {
  constexpr int V = DIM / 16;
  __m512 acc[GC * V];
  NP_UNROLL
  for (int i = 0; i < GC * V; ++i) acc[i] = _mm512_loadu_ps(sums + 16 * i);
  for (int64_t i = 0; i < pairs; ++i, x += 2 * DIM) {
    __m512bh vals[V];
    NP_UNROLL
    for (int v = 0; v < V; ++v) vals[v] = load_pairs(x + 32 * v, keep);
    NP_UNROLL
    for (int g = 0; g < GC; ++g) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(weights[g][first + i]);
      NP_UNROLL
      for (int v = 0; v < V; ++v) acc[g * V + v] = _mm512_dpbf16_ps(acc[g * V + v], vals[v], w);
    }
  }
  NP_UNROLL
  for (int i = 0; i < GC * V; ++i) _mm512_storeu_ps(sums + 16 * i, acc[i]);
}

// The scores of one unit's GC query heads (q32[g]: head g's dims as pairs) with the tokens
// t0 .. end of one block (block_k: its K of the unit's KV head), into scores[g * stride + t].
template <int DIM, int GC, typename C>
static inline void score_block(const int32_t* const* q32, const C* block_k, int64_t bs, int64_t b0, int64_t end,
                               float scale, float* scores, int64_t stride) {
  constexpr int P = DIM / 2;
  for (int64_t t0 = b0; t0 < end; t0 += 16) {
    const C* k = block_k + 2 * (t0 - b0);                           // pair p of these 16 tokens: k + 2 bs p
    // two sums per query head, over even and odd pairs: consecutive instructions do not wait on
    // each other's result (an instruction takes several cycles; the unit starts one each cycle)
    __m512 acc[GC][2];
    NP_UNROLL
    for (int g = 0; g < GC; ++g) acc[g][0] = acc[g][1] = _mm512_setzero_ps();
    for (int p = 0; p < P; p += 2)
      NP_UNROLL
      for (int e = 0; e < 2; ++e) {
        const __m512bh kp = load_pairs(k + 2 * bs * (p + e), 0xFFFFFFFFu);
        NP_UNROLL
        for (int g = 0; g < GC; ++g)
          acc[g][e] = _mm512_dpbf16_ps(acc[g][e], kp, (__m512bh)_mm512_set1_epi32(q32[g][p + e]));
      }
    NP_UNROLL
    for (int g = 0; g < GC; ++g)
      _mm512_storeu_ps(scores + g * stride + t0, _mm512_mul_ps(_mm512_add_ps(acc[g][0], acc[g][1]), _mm512_set1_ps(scale)));
  }
}

static inline void prefetch_run(const void* p, int64_t bytes) {     // into L1, a line (64 bytes) at a time
  for (int64_t e = 0; e < bytes; e += 64) _mm_prefetch(static_cast<const char*>(p) + e, _MM_HINT_T0);
}

// One job's rows: the same KV heads h0 .. h1 of one or more rows (a group that shares its first
// `shared` blocks, attention_jobs.h). G query heads share a KV head; GC of them are a unit.
struct JobHeads {
  const KvLayout& L;
  int64_t q_head, h0, h1, G;
  float scale;
  int64_t units() const { return (h1 - h0) * G; }                  // query heads in the job, per row
  bool whole() const { return h1 - h0 == L.kv_heads; }
  int64_t blocks(const JobRow& r) const { return (r.n + L.block_size - 1) / L.block_size; }   // that r reads
};

// Blocks are read two ahead of use where the CPU's own prefetcher cannot foresee them: it follows
// a run of memory into the next block when that block lies right after (the pool hands out
// blocks in order, so a request's mostly do), not a jump to another block, nor a job's short run
// of part of each block. (Asked for every block, a step's attention took longer when the blocks
// lay in order; asked for none, longer when they lay shuffled: docs/05, "What it took to be fast".)
static inline bool fetch_ahead(const JobHeads& J, const JobRow& r, int64_t b0) {
  const int64_t bs = J.L.block_size;
  return b0 + 2 * bs < r.n && (!J.whole() || r.table[b0 / bs + 2] != r.table[b0 / bs + 1] + 1);
}

// The scores of row r's query heads with the keys of its blocks i0 .. i1, block by block, and in a
// block unit by unit (no division per key). `fetch`: whether this row brings the blocks in.
template <int DIM, int GC, typename C>
static void score_blocks(const JobHeads& J, const JobRow& r, const C* kc, int64_t i0, int64_t i1, bool fetch) {
  const KvLayout& L = J.L;
  const int64_t bs = L.block_size, stride = r.n + 16, per_kv = J.G / GC, units = (J.h1 - J.h0) * per_kv;
  for (int64_t b0 = i0 * bs; b0 < std::min(r.n, i1 * bs); b0 += bs) {
    const int64_t block = r.table[b0 / bs], end = std::min(r.n, b0 + bs);
    const bool ahead = fetch && fetch_ahead(J, r, b0);
    for (int64_t u = 0; u < units; ++u) {
      if (ahead && u % per_kv == 0)
        prefetch_run(kc + L.k(r.table[b0 / bs + 2], 0, J.h0 + u / per_kv, 0), DIM * bs * sizeof(C));
      const int32_t* q32[GC];
      NP_UNROLL
      for (int g = 0; g < GC; ++g) q32[g] = reinterpret_cast<const int32_t*>(r.q + (u * GC + g) * J.q_head);
      score_block<DIM, GC, C>(q32, kc + L.k(block, 0, J.h0 + u / per_kv, 0), bs, b0, end, J.scale,
                              r.scores + u * GC * stride, stride);
    }
  }
}

// Each query head's scores become its weights, rounded to bfloat16 by the softmax and then kept as
// bfloat16 in place: pairs[t / 2] holds tokens t and t + 1 (an odd n's last pair weighs nothing
// past n). 1 / each head's sum goes to sums[units() DIM + i]; the sums are zeroed for the values.
template <int DIM, typename C>
static void weights_of_row(const JobHeads& J, const JobRow& r, const C* kc, const C* vc) {
  const int64_t n = r.n, heads = J.units();
  float* inv = r.sums + heads * DIM;
  for (int64_t i = 0; i < heads; ++i) {
    float* s = r.scores + i * (n + 16);
    times_row_scales(s, kc, J.L, r.table, n, J.h0 + i / J.G);
    inv[i] = softmax_in_place<bf16>(s, n);
    times_row_scales(s, vc, J.L, r.table, n, J.h0 + i / J.G);
    s[n] = 0.f;
    uint16_t* w = reinterpret_cast<uint16_t*>(s);                   // w[t] is written after s[t] is read
    int64_t t = 0;
    for (; t + 16 <= n + 1; t += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + t), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + t)));
    for (; t <= n; ++t) w[t] = uint16_t(bf16_bits(s[t]));
  }
  std::fill(r.sums, r.sums + heads * DIM, 0.f);
}

// The values of row r's blocks i0 .. i1 weighed into its sums, block by block, unit by unit.
template <int DIM, int GC, typename C>
static void weigh_blocks(const JobHeads& J, const JobRow& r, const C* vc, int64_t i0, int64_t i1, bool fetch) {
  const KvLayout& L = J.L;
  const int64_t bs = L.block_size, n = r.n, stride = n + 16, per_kv = J.G / GC, units = (J.h1 - J.h0) * per_kv;
  for (int64_t b0 = i0 * bs; b0 < std::min(n, i1 * bs); b0 += bs) {
    const int64_t block = r.table[b0 / bs], pairs = (std::min(n, b0 + bs) - b0) / 2;
    const bool ahead = fetch && fetch_ahead(J, r, b0);
    for (int64_t u = 0; u < units; ++u) {
      const int64_t h = J.h0 + u / per_kv;
      if (ahead && u % per_kv == 0) prefetch_run(vc + L.v(r.table[b0 / bs + 2], 0, h, 0), DIM * bs * sizeof(C));
      const int32_t* weights[GC];                                   // weights[g][t / 2]: tokens t, t + 1
      NP_UNROLL
      for (int g = 0; g < GC; ++g) weights[g] = reinterpret_cast<const int32_t*>(r.scores + (u * GC + g) * stride);
      float* sums = r.sums + u * GC * DIM;
      weigh_values<DIM, GC, C>(vc + L.v(block, 0, h, 0), b0 / 2, pairs, weights, sums, 0xFFFFFFFFu);
      if (n % 2 && b0 + bs >= n)  // an odd n's last token: the slot past it is not the request's (it may hold anything)
        weigh_values<DIM, GC, C>(vc + L.v(block, (n - 1) % bs, h, 0), (n - 1) / 2, 1, weights, sums, 0x55555555u);
    }
  }
}

template <int DIM>
static void finish_row(const JobHeads& J, const JobRow& r) {        // out = sums / the weights' sum
  constexpr int V = DIM / 16;
  const float* inv = r.sums + J.units() * DIM;
  for (int64_t i = 0; i < J.units(); ++i)
    NP_UNROLL
    for (int v = 0; v < V; ++v)
      round_to<bf16>(Vec16{_mm512_mul_ps(_mm512_loadu_ps(r.sums + i * DIM + 16 * v), _mm512_set1_ps(inv[i]))})
          .store(r.out + i * DIM + 16 * v);
}

// One job: its rows' scores, weights, then values. The blocks every row shares are taken a span at
// a time, each row through the whole span before the next: the span comes from memory once and from
// L2 for the rest. Each row still goes through its blocks in order, unit by unit, as it would alone.
static constexpr int64_t kSpanBytes = 256 << 10;                    // of K (or V) of the job's heads

template <int DIM, int GC, typename C>
static void attend_job_rows(const JobHeads& J, const std::vector<JobRow>& rows, int64_t shared, const C* kc,
                            const C* vc) {
  const int64_t span = std::max<int64_t>(1, kSpanBytes / (J.L.block_size * (J.h1 - J.h0) * J.L.row * sizeof(C)));
  for (int64_t i = 0; i < shared; i += span)
    for (size_t k = 0; k < rows.size(); ++k)
      score_blocks<DIM, GC, C>(J, rows[k], kc, i, std::min(shared, i + span), k == 0);
  for (const JobRow& r : rows) {
    score_blocks<DIM, GC, C>(J, r, kc, shared, J.blocks(r), true);
    weights_of_row<DIM, C>(J, r, kc, vc);
  }
  for (int64_t i = 0; i < shared; i += span)
    for (size_t k = 0; k < rows.size(); ++k)
      weigh_blocks<DIM, GC, C>(J, rows[k], vc, i, std::min(shared, i + span), k == 0);
  for (const JobRow& r : rows) {
    weigh_blocks<DIM, GC, C>(J, r, vc, shared, J.blocks(r), true);
    finish_row<DIM>(J, r);
  }
}

// The job's query heads GC at a time: the largest GC of 4, 3, 2, 1 that divides G.
template <int DIM, typename C>
static void attend_job_bf16(const JobHeads& J, const std::vector<JobRow>& rows, int64_t shared, const C* kc,
                            const C* vc) {
  if (J.G % 4 == 0) attend_job_rows<DIM, 4, C>(J, rows, shared, kc, vc);
  else if (J.G % 3 == 0) attend_job_rows<DIM, 3, C>(J, rows, shared, kc, vc);
  else if (J.G % 2 == 0) attend_job_rows<DIM, 2, C>(J, rows, shared, kc, vc);
  else attend_job_rows<DIM, 1, C>(J, rows, shared, kc, vc);
}
#endif

// The step's rows, job by job over the threads (attention_jobs.h): on VDPBF16PS where it runs,
// else on the plain loops.
template <typename T, typename C>
static void attend_rows(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                        const torch::Tensor& tables, const StepRows& rows, torch::Tensor& out, float scale,
                        bool share) {
  const KvLayout L = kv_layout(k_cache);
  const int64_t num_rows = q.size(0), heads = q.size(1), D = q.size(2), kv_heads = L.kv_heads;
  const int64_t G = heads / kv_heads, max_blocks = tables.size(1);
  const int64_t q_row = q.stride(0), q_head = q.stride(1);
  const T* qp = q.data_ptr<T>();
  const C *kc = k_cache.data_ptr<C>(), *vc = v_cache.data_ptr<C>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t longest = num_rows ? *std::max_element(rows.n.begin(), rows.n.end()) : 0;
#if defined(__AVX512BF16__)
  const bool vector = std::is_same_v<T, bf16> && L.block_size % 16 == 0 && q_head % 2 == 0 &&
                      q_row % 2 == 0 && reinterpret_cast<uintptr_t>(qp) % 4 == 0 && (D == 64 || D == 128 || D == 256);
#else
  const bool vector = false;
#endif
  // plain loops read row by row: sharing would not pay there (attention_jobs.h: step_jobs)
  const StepJobs S = step_jobs(rows, tp, max_blocks, L.block_size, kv_heads, at::get_num_threads(), share && vector);
  const int64_t job_heads = kv_heads / S.per_group;
  at::parallel_for(0, S.threads, 1, [&](int64_t begin, int64_t end) {
    const int64_t row_scores = job_heads * G * (longest + 32), row_sums = job_heads * G * (D + 1);
    // kept by each thread from call to call: a group of 16 rows at 1,024 keys holds 0.6 MB of
    // scores, which a fresh vector would zero and fault in at every layer
    thread_local std::vector<float> scores, sums;
    if (scores.size() < size_t(S.most_rows * row_scores)) scores.resize(S.most_rows * row_scores);
    if (sums.size() < size_t(S.most_rows * row_sums)) sums.resize(S.most_rows * row_sums);
    std::vector<JobRow> job_rows;                                   // one job's rows at a time
    for (int64_t job = S.cut[begin]; job < S.cut[end]; ++job) {
      const RowGroup& group = S.groups[job / S.per_group];
      const int64_t h0 = (job % S.per_group) * job_heads, h1 = h0 + job_heads;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, bf16>) {
        if (vector) {
          job_rows.clear();
          for (int64_t k = 0; k < group.count; ++k) {
            const int64_t t = S.order[group.first + k];
            job_rows.push_back({qp + t * q_row + h0 * G * q_head, op + (t * heads + h0 * G) * D,
                                tp + rows.req[t] * max_blocks, rows.n[t], scores.data() + k * row_scores,
                                sums.data() + k * row_sums});
          }
          const JobHeads J{L, q_head, h0, h1, G, scale};
          auto job_fn = D == 64 ? attend_job_bf16<64, C> : D == 128 ? attend_job_bf16<128, C> : attend_job_bf16<256, C>;
          job_fn(J, job_rows, group.shared, kc, vc);
          continue;
        }
      }
#endif
      for (int64_t k = 0; k < group.count; ++k) {
        const int64_t t = S.order[group.first + k];
        const T* qt = qp + t * q_row + h0 * G * q_head;
        T* o = op + (t * heads + h0 * G) * D;
        for (int64_t h = h0; h < h1; ++h)
          attend_one_head_any<T, C>(qt + (h - h0) * G * q_head, q_head, kc, vc, L, tp + rows.req[t] * max_blocks,
                                    rows.n[t], h, G, scale, o + (h - h0) * G * D, scores.data());
      }
    }
  });
}

// The whole step's attention in one call, every row through its request's block table (the
// K/V of the step's own tokens already stored): prompt chunks, prefix-cache hits and decode rows
// alike, as vLLM's unified paged attention does.
//   q (rows, heads, dim) with unit stride in dim; caches (blocks, block_size, kv_heads, dim; int8's
//   rows dim + 4) in the kernels' order, of q's dtype or 8-bit entries (kv_layout.h)
//   block_tables (reqs, max_blocks), seq_lens (reqs,), query_start_loc (reqs + 1,): int64
//   share_prefixes: rows whose tables begin with the same blocks read them once (attention_jobs.h);
//   the result is the same either way
// Returns out (rows, heads, dim).
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
                              double scale, bool share_prefixes) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.size(2) == kv_layout(k_cache).D,
              "paged_attention: q (rows, heads, head_dim) with unit stride in head_dim, as the caches' head_dim");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && v_cache.is_contiguous(), "paged_attention: K and V caches of one shape");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "paged_attention: K and V caches of one dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "paged_attention: heads must be a multiple of kv_heads");
  auto tables = block_tables.contiguous(), lens = seq_lens.contiguous(), starts = query_start_loc.contiguous();
  const int64_t num_reqs = lens.size(0);
  TORCH_CHECK(tables.size(0) == num_reqs && starts.numel() == num_reqs + 1, "paged_attention: one table, one "
              "length and one start per request");
  const int64_t *lp = lens.data_ptr<int64_t>(), *sp = starts.data_ptr<int64_t>();
  TORCH_CHECK(sp[0] == 0 && sp[num_reqs] == q.size(0), "paged_attention: query_start_loc must run from 0 to the rows");
  for (int64_t i = 0; i < num_reqs; ++i)
    TORCH_CHECK(sp[i + 1] >= sp[i] && lp[i] >= sp[i + 1] - sp[i] && lp[i] <= tables.size(1) * k_cache.size(1),
                "paged_attention: request ", i, " has more rows than keys, or more keys than its block table holds");
  const StepRows rows = step_rows(lp, sp, num_reqs);
  auto out = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  DISPATCH_MODEL_DTYPES(q.scalar_type(), "paged_attention", [&] {
    dispatch_cache_entry<scalar_t>(k_cache, [&](auto entry) {       // q's dtype, or 8-bit entries
      attend_rows<scalar_t, decltype(entry)>(q, k_cache, v_cache, tables, rows, out, float(scale), share_prefixes);
    });
  });
  return out;
}

// Which rows of a step paged_attention reads together, `threads` threads attending: each group's row
// indices and the blocks they share (a row alone shares none). For tests, and for a reader to see it.
RowGroups shared_prefix_groups(torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
                               int64_t block_size, int64_t threads) {
  auto tables = block_tables.contiguous(), lens = seq_lens.contiguous(), starts = query_start_loc.contiguous();
  TORCH_CHECK(tables.size(0) == lens.numel() && starts.numel() == lens.numel() + 1 && threads >= 1 && block_size >= 1,
              "shared_prefix_groups: one table and one length per request, one start more, threads >= 1");
  const StepRows rows = step_rows(lens.data_ptr<int64_t>(), starts.data_ptr<int64_t>(), lens.numel());
  std::vector<int64_t> order;
  RowGroups out;
  for (const RowGroup& g : group_rows(rows, tables.data_ptr<int64_t>(), tables.size(1), block_size, threads, true, order))
    out.push_back({std::vector<int64_t>(order.begin() + g.first, order.begin() + g.first + g.count), g.shared});
  return out;
}
