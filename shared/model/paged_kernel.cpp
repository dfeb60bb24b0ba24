// Paged attention on the CPU, reading K and V in place through the block tables.
//
// Invariance is the point: a query's output depends on its own query vector and keys only, never on how many rows
// share the call, where its row sits, or which other rows (decode, k + 1 verify rows, tree nodes, prefill chunks)
// the step holds. Each query takes 4 lanes of a 16-lane block; its score against a key is 4 partial sums (the
// elements d % 4 == j, in ascending d) added in a fixed order, whatever the other lanes hold; its softmax runs over
// its own keys in a layout fixed by their count; its output sums weight x value over its own keys in ascending
// order (keys it does not see have weight 0, and adding 0 * v to a sum that is never -0 leaves it bit for bit).
// Against gathering the context and calling SDPA (bf16, 2 threads, AMX host; docs/engine.md, "The cpu attention
// kernel"): decode and scoring steps faster at batch 1 and 8, a 1,000-token prefill chunk slower (SDPA's products
// use AMX; the scores here are 16-lane FMAs).
//
// Built at run time by shared/model/cpu_attention.py with -march=native and loaded through ctypes. It links the
// process's OpenMP runtime (torch's libgomp, already loaded under the same name), so it runs on torch's threads.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "exp.h"

namespace {

typedef float vf __attribute__((vector_size(64)));  // 16 lanes: one AVX-512 register, two AVX2 ones
typedef uint32_t vu32 __attribute__((vector_size(64)));
typedef uint16_t vu16 __attribute__((vector_size(32)));
constexpr int LANES = 16;
// Keys and values of a step's sequences come from DRAM (30 layers of a batch's cache outgrow the last-level cache),
// and a KV head's rows are 1 of every kv_heads in the cache, a stride the hardware prefetchers follow late: the
// loops ask for the rows AHEAD keys on. Timing only: no value changes.
constexpr int64_t AHEAD = 16;

// acc + a * b rounded once where the CPU fuses it, else twice; either way the same for every lane and call.
inline vf madd(vf a, vf b, vf acc) {
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc);
#else
    return acc + a * b;  // built with -ffp-contract=off: never fused behind our back in one place and not another
#endif
}

inline vf splat(float x) { return vf{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
inline vf splat4(const float* x) {  // x[0:4] in each quarter
#if defined(__AVX512F__)
    return (vf)_mm512_broadcast_f32x4(_mm_loadu_ps(x));
#else
    return vf{x[0], x[1], x[2], x[3], x[0], x[1], x[2], x[3], x[0], x[1], x[2], x[3], x[0], x[1], x[2], x[3]};
#endif
}
inline vf load(const float* x) {
    vf out;
    std::memcpy(&out, x, sizeof out);
    return out;
}
inline vf load(const uint16_t* x) {  // bf16 -> fp32: the 16 bits are the float's high half
    vu16 half;
    std::memcpy(&half, x, sizeof half);
    vu32 bits = __builtin_convertvector(half, vu32) << 16;
    vf out;
    std::memcpy(&out, &bits, sizeof out);
    return out;
}
inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {
    uint32_t bits = static_cast<uint32_t>(x) << 16;
    float out;
    std::memcpy(&out, &bits, sizeof out);
    return out;
}
inline void store(float x, float* out) { *out = x; }
inline void store(float x, uint16_t* out) {  // round to nearest even, as torch's conversion does
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        *out = 0x7fc0;
        return;
    }
    bits += 0x7fffu + ((bits >> 16) & 1u);
    *out = static_cast<uint16_t>(bits >> 16);
}

template <typename T>
inline void prefetch(const T* row, int64_t dim) {
    const char* bytes = reinterpret_cast<const char*>(row);
    for (int64_t b = 0; b < dim * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(bytes + b);
}

inline float sum(vf x) {  // a fixed tree: halves, quarters, ...
    typedef float v8 __attribute__((vector_size(32)));
    typedef float v4 __attribute__((vector_size(16)));
    v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

// exp(x) for x <= 0 (scores minus their max); below -87 the result would leave the normal floats.
inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = specdec::exp_steps(x);
    return specdec::exp_reduced(x, n) * specdec::power_of_two(static_cast<int32_t>(n));
}

// Softmax of one query's scores in place; the layout (16 lanes, the tail padded with -inf) is fixed by their count.
inline void softmax(float* row, int64_t num_keys) {
    const int64_t padded = (num_keys + LANES - 1) / LANES * LANES;
    for (int64_t i = num_keys; i < padded; ++i) row[i] = -INFINITY;
    vf top = load(row);
    for (int64_t i = LANES; i < padded; i += LANES) {
        const vf x = load(row + i);
        top = x > top ? x : top;
    }
    float max = top[0];
    for (int j = 1; j < LANES; ++j) max = top[j] > max ? top[j] : max;
    for (int64_t i = 0; i < padded; ++i) row[i] = exp_nonpositive(row[i] - max);
    vf lanes = load(row);
    for (int64_t i = LANES; i < padded; i += LANES) lanes += load(row + i);
    const float inv = 1.0f / sum(lanes);
    for (int64_t i = 0; i < num_keys; ++i) row[i] *= inv;
}

struct Step {
    const int64_t* block_tables;
    int64_t max_blocks;
    const int32_t* seq_start;    // [B + 1] first row of each sequence
    const int32_t* row_keys;     // [T] a row sees logical positions [0, row_keys[t]) ...
    const int32_t* extra_start;  // [T + 1] ... then extra_keys[extra_start[t] : extra_start[t + 1]] (ascending)
    const int32_t* extra_keys;
    int64_t heads, kv_heads, dim, block_size;
    float scale;
};

struct Scratch {
    std::vector<int32_t> keys;     // the block's keys (logical positions), ascending
    std::vector<int64_t> slots;    // their cache rows, in units of one KV head
    std::vector<vf> queries;       // [groups][dim / 4]: lane 4 * i + j = query i's elements d with d % 4 == j
    std::vector<float> scores;     // [query][stride] scores, then weights (0 where the query does not see the key)
    int64_t stride = 0;            // the keys' count rounded up to 16: room for the softmax's padding
    std::vector<float> row;        // one query's scores over its own keys
    std::vector<float> converted;  // 4 keys as fp32
};

// Scores of up to 16 queries (GROUPS vectors of 4) against 4 keys at a time. A query's score is 4 partial sums,
// each over the elements d % 4 == j in ascending d, added (p0 + p1) + (p2 + p3): the same for it in every block.
template <int GROUPS, typename T>
void score(const T* k_cache, const Step& s, int64_t count, Scratch& w) {
    const int64_t dim = s.dim, quads = dim / 4, num_keys = w.keys.size();
    float* kf = w.converted.data();
    for (int64_t i = 0; i < num_keys; i += 4) {
        const int64_t n = std::min<int64_t>(4, num_keys - i);
        for (int64_t k = i + AHEAD; k < std::min(i + AHEAD + 4, num_keys); ++k)
            prefetch(k_cache + w.slots[k] * dim, dim);
        const float* keys[4];
        for (int64_t k = 0; k < 4; ++k) {
            const T* key = k_cache + w.slots[i + (k < n ? k : 0)] * dim;
            if constexpr (std::is_same_v<T, float>) {
                keys[k] = key;  // in place: the copy only converts bf16 (fp32 batch-8 decode 0.95x the time without it)
                continue;
            }
            for (int64_t d = 0; d < dim; d += LANES) {
                const vf x = load(key + d);
                std::memcpy(kf + k * dim + d, &x, sizeof x);
            }
            keys[k] = kf + k * dim;
        }
        vf acc[4][GROUPS] = {};
        for (int64_t dd = 0; dd < quads; ++dd)
            for (int k = 0; k < 4; ++k) {
                const vf b = splat4(keys[k] + 4 * dd);
                for (int g = 0; g < GROUPS; ++g) acc[k][g] = madd(w.queries[g * quads + dd], b, acc[k][g]);
            }
        for (int64_t k = 0; k < n; ++k)
            for (int g = 0; g < GROUPS; ++g) {
                vf a = acc[k][g];
                a = a + __builtin_shufflevector(a, a, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
                a = a + __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
                for (int64_t qi = 0; qi < 4 && 4 * g + qi < count; ++qi)
                    w.scores[(4 * g + qi) * w.stride + i + k] = a[4 * qi] * s.scale;
            }
    }
}

// Outputs of QT queries at a time: each sums weight x value over the keys in ascending order, per element.
template <int CHUNKS, typename T>
void weigh(const T* v_cache, T* out, const Step& s, const int64_t* rows, const int64_t* heads, int64_t count,
           Scratch& w) {
    constexpr int QT = CHUNKS >= 8 ? 2 : 4;
    const int64_t dim = s.dim, num_keys = w.keys.size();
    for (int64_t l0 = 0; l0 < count; l0 += QT) {
        const float* weights[QT];
        for (int qi = 0; qi < QT; ++qi) weights[qi] = &w.scores[std::min<int64_t>(l0 + qi, count - 1) * w.stride];
        vf acc[QT][CHUNKS] = {};
        for (int64_t i = 0; i < num_keys; ++i) {
            if (l0 == 0 && i + AHEAD < num_keys) prefetch(v_cache + w.slots[i + AHEAD] * dim, dim);
            const T* value = v_cache + w.slots[i] * dim;
            vf v[CHUNKS];
            for (int c = 0; c < CHUNKS; ++c) v[c] = load(value + c * LANES);
            for (int qi = 0; qi < QT; ++qi) {
                const vf weight = splat(weights[qi][i]);
                for (int c = 0; c < CHUNKS; ++c) acc[qi][c] = madd(weight, v[c], acc[qi][c]);
            }
        }
        for (int64_t qi = 0; qi < QT && l0 + qi < count; ++qi) {
            T* o = out + (rows[l0 + qi] * s.heads + heads[l0 + qi]) * dim;
            for (int c = 0; c < CHUNKS; ++c)
                for (int j = 0; j < LANES; ++j) store(acc[qi][c][j], o + c * LANES + j);
        }
    }
}

// One block of up to 16 queries (row, query head) of one sequence and KV head; CHUNKS = dim / 16.
template <int CHUNKS, typename T>
void attend_block(const T* q, const T* k_cache, const T* v_cache, T* out, const Step& s, int64_t seq, int64_t kvh,
                  int64_t first, int64_t count, Scratch& w) {
    const int64_t group = s.heads / s.kv_heads, dim = s.dim, quads = dim / 4;
    const int64_t row0 = s.seq_start[seq];
    int64_t rows[LANES], heads[LANES];
    int32_t max_prefix = 0;
    for (int64_t l = 0; l < count; ++l) {
        rows[l] = row0 + (first + l) / group;
        heads[l] = kvh * group + (first + l) % group;
        max_prefix = std::max(max_prefix, s.row_keys[rows[l]]);
    }
    w.keys.resize(max_prefix);
    for (int32_t p = 0; p < max_prefix; ++p) w.keys[p] = p;
    for (int64_t l = 0; l < count; ++l)  // tree nodes' own keys past every prefix (few): merged in, ascending
        for (int32_t e = s.extra_start[rows[l]]; e < s.extra_start[rows[l] + 1]; ++e) {
            const int32_t p = s.extra_keys[e];
            if (p < max_prefix) continue;
            auto at = std::lower_bound(w.keys.begin() + max_prefix, w.keys.end(), p);
            if (at == w.keys.end() || *at != p) w.keys.insert(at, p);
        }
    const int64_t num_keys = w.keys.size();
    const int64_t* table = s.block_tables + seq * s.max_blocks;
    w.slots.resize(num_keys);
    for (int64_t i = 0, block = 0; i < max_prefix; ++block)  // block by block: no division per key
        for (int64_t j = 0, base = table[block] * s.block_size; j < s.block_size && i < max_prefix; ++j, ++i)
            w.slots[i] = (base + j) * s.kv_heads + kvh;
    for (int64_t i = max_prefix; i < num_keys; ++i) {
        const int64_t p = w.keys[i];
        w.slots[i] = (table[p / s.block_size] * s.block_size + p % s.block_size) * s.kv_heads + kvh;
    }

    for (int64_t i = 0; i < std::min(num_keys, AHEAD); ++i) {  // the first rows, while the queries are laid out
        prefetch(k_cache + w.slots[i] * dim, dim);
        prefetch(v_cache + w.slots[i] * dim, dim);
    }
    const int64_t groups = (count + 3) / 4;
    w.queries.assign(groups * quads, vf{});
    for (int64_t l = 0; l < count; ++l) {
        const T* query = q + (rows[l] * s.heads + heads[l]) * dim;
        for (int64_t d = 0; d < dim; ++d) w.queries[(l / 4) * quads + d / 4][4 * (l % 4) + d % 4] = to_float(query[d]);
    }
    w.stride = (num_keys + LANES - 1) / LANES * LANES;
    w.scores.resize(count * w.stride);
    w.converted.resize(4 * dim);
    switch (groups) {
        case 1: score<1>(k_cache, s, count, w); break;
        case 2: score<2>(k_cache, s, count, w); break;
        case 3: score<3>(k_cache, s, count, w); break;
        default: score<4>(k_cache, s, count, w); break;
    }

    // Each query's softmax over its own keys; its weights go back in place, 0 where it does not see the key.
    w.row.resize(num_keys + LANES);
    for (int64_t l = 0; l < count; ++l) {
        const int64_t t = rows[l], prefix = s.row_keys[t];
        float* scores = &w.scores[l * w.stride];
        const int32_t *extra = s.extra_keys + s.extra_start[t], *extra_end = s.extra_keys + s.extra_start[t + 1];
        if (extra == extra_end) {  // a causal row: its keys are the first `prefix`
            softmax(scores, prefix);
            std::fill(scores + prefix, scores + num_keys, 0.0f);
            continue;
        }
        int64_t n = 0;
        for (int64_t i = 0; i < num_keys; ++i) {
            const int32_t p = w.keys[i];
            const bool sees = p < prefix || (extra != extra_end && *extra == p);
            if (p >= prefix && sees) ++extra;
            if (sees) w.row[n++] = scores[i];
        }
        softmax(w.row.data(), n);
        extra = s.extra_keys + s.extra_start[t];
        for (int64_t i = 0, m = 0; i < num_keys; ++i) {
            const int32_t p = w.keys[i];
            const bool sees = p < prefix || (extra != extra_end && *extra == p);
            if (p >= prefix && sees) ++extra;
            scores[i] = sees ? w.row[m++] : 0.0f;
        }
    }
    weigh<CHUNKS>(v_cache, out, s, rows, heads, count, w);
}

template <typename T>
void attend(const T* q, const T* k_cache, const T* v_cache, T* out, const Step& s, int64_t num_seqs, int threads) {
    const int64_t group = s.heads / s.kv_heads;
    std::vector<int64_t> task_start(num_seqs + 1, 0);  // tasks: (sequence, KV head, block of 16 queries)
    for (int64_t b = 0; b < num_seqs; ++b) {
        const int64_t blocks = ((s.seq_start[b + 1] - s.seq_start[b]) * group + LANES - 1) / LANES;
        task_start[b + 1] = task_start[b] + blocks * s.kv_heads;
    }
#pragma omp parallel num_threads(threads)
    {
        Scratch scratch;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < task_start[num_seqs]; ++task) {
            const int64_t b = std::upper_bound(task_start.begin(), task_start.end(), task) - task_start.begin() - 1;
            const int64_t local = task - task_start[b], kvh = local % s.kv_heads, block = local / s.kv_heads;
            const int64_t queries = (s.seq_start[b + 1] - s.seq_start[b]) * group;
            const int64_t first = block * LANES, count = std::min<int64_t>(LANES, queries - first);
            switch (s.dim / LANES) {  // the head sizes cpu_attention.supports lets through
                case 1: attend_block<1>(q, k_cache, v_cache, out, s, b, kvh, first, count, scratch); break;
                case 2: attend_block<2>(q, k_cache, v_cache, out, s, b, kvh, first, count, scratch); break;
                case 4: attend_block<4>(q, k_cache, v_cache, out, s, b, kvh, first, count, scratch); break;
                case 6: attend_block<6>(q, k_cache, v_cache, out, s, b, kvh, first, count, scratch); break;
                case 8: attend_block<8>(q, k_cache, v_cache, out, s, b, kvh, first, count, scratch); break;
                case 16: attend_block<16>(q, k_cache, v_cache, out, s, b, kvh, first, count, scratch); break;
            }
        }
    }
}

}  // namespace

extern "C" {

#define SPECDEC_ATTENTION(NAME, T)                                                                                  \
    void NAME(const T* q, const T* k_cache, const T* v_cache, T* out, const int64_t* block_tables,                \
              int64_t max_blocks, const int32_t* seq_start, const int32_t* row_keys, const int32_t* extra_start,   \
              const int32_t* extra_keys, int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t dim,           \
              int64_t block_size, float scale, int threads) {                                                      \
        const Step step{block_tables, max_blocks, seq_start, row_keys, extra_start, extra_keys,                    \
                        heads,        kv_heads,   dim,       block_size, scale};                                   \
        attend(q, k_cache, v_cache, out, step, num_seqs, threads);                                                  \
    }

SPECDEC_ATTENTION(specdec_paged_attention_f32, float)
SPECDEC_ATTENTION(specdec_paged_attention_bf16, uint16_t)
}
