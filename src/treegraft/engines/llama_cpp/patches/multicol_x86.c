
// ---- treegraft: batch-invariant multi-column dot products (appended to ggml-cpu/arch/x86/quants.c) ----
//
// For the 32-value block types (Q8_0, Q5_0, Q4_1: the small models' tensors whose rows are not a multiple
// of 256; the K-quants have their own products in bi_kquants_x86.c).
// ggml_vec_dot_<type>_multi computes the dot products of ONE weight row with up to 16 activation
// columns at once. Every column's result is bit for bit what ggml_vec_dot_<type>_q8_K returns for that
// column alone: the integer partial sums are the same numbers in the same SIMD lanes (integer addition
// is exact, so the order they are summed in does not matter), and every float operation (the per
// super-block fmadd into the lane accumulators, the mins term, the final horizontal sum) is the same
// operation in the same order. What the columns share is the work that does not depend on them:
// loading and unpacking the weight nibbles and decoding the block scales, once per super-block instead
// of once per column. A matrix product that calls this for column groups of any size therefore gives
// each output the bits of one-token decoding: batch-invariant, and faster per column than vec_dot.
//
// Only the AVX2 paths are mirrored (they are also what AVX-512 builds run for these types); elsewhere
// ggml_vec_dot_multi_for returns NULL and the caller keeps calling vec_dot per column.

#if defined(__AVX2__)

#define TG_MAXC 16   // columns per call (ggml's column block)

// The 32-value block types: one block unpacked is its 32 weights as bytes and its float scales.
typedef struct {
    __m256i q;
    float d, m;
} tg_b32_unpacked;

#define TG_B32_CHUNK 64  // blocks unpacked at a time (3 KiB)
// the weight stream is memory-bound at small batches: see TG_PREFETCH_AHEAD in bi_kquants_x86.c
#define TG_B32_PREFETCH_AHEAD 4096

static inline void tg_unpack_q8_0(tg_b32_unpacked * u, const block_q8_0 * x) {
    u->q = _mm256_loadu_si256((const __m256i *)x->qs);
    u->d = GGML_CPU_FP16_TO_FP32(x->d);
}

static inline void tg_unpack_q5_0(tg_b32_unpacked * u, const block_q5_0 * x) {
    __m256i qx = bytes_from_nibbles_32(x->qs);
    __m256i bxhi = bytes_from_bits_32(x->qh);
    bxhi = _mm256_andnot_si256(bxhi, _mm256_set1_epi8((char)0xF0));
    u->q = _mm256_or_si256(qx, bxhi);
    u->d = GGML_CPU_FP16_TO_FP32(x->d);
}

static inline void tg_unpack_q4_1(tg_b32_unpacked * u, const block_q4_1 * x) {
    u->q = bytes_from_nibbles_32(x->qs);
    u->d = GGML_CPU_FP16_TO_FP32(x->d);
    u->m = GGML_CPU_FP16_TO_FP32(x->m);
}

// vec_dot_q8_0_q8_0 / vec_dot_q5_0_q8_0 (the same loop once the weights are bytes)
static inline void tg_x_q8_0_col(const tg_b32_unpacked * u, const block_q8_0 * y, int nb, __m256 * acc_io) {
    __m256 acc = *acc_io;
    for (int i = 0; i < nb; ++i) {
        const __m256 d = _mm256_set1_ps(u[i].d * GGML_CPU_FP16_TO_FP32(y[i].d));
        const __m256i qy = _mm256_loadu_si256((const __m256i *)y[i].qs);
        const __m256 q = mul_sum_i8_pairs_float(u[i].q, qy);
        acc = _mm256_fmadd_ps(d, q, acc);
    }
    *acc_io = acc;
}

// vec_dot_q4_1_q8_1
static inline void tg_q4_1_col(const tg_b32_unpacked * u, const block_q8_1 * y, int nb, __m256 * acc_io, float * summs_io) {
    __m256 acc = *acc_io;
    float summs = *summs_io;
    for (int i = 0; i < nb; ++i) {
        const float d1 = GGML_CPU_FP16_TO_FP32(y[i].d);
        summs += u[i].m * GGML_CPU_FP16_TO_FP32(y[i].s);
        const __m256 d0d1 = _mm256_mul_ps(_mm256_set1_ps(u[i].d), _mm256_set1_ps(d1));
        const __m256i qy = _mm256_loadu_si256((const __m256i *)y[i].qs);
        const __m256 xy = mul_sum_us8_pairs_float(u[i].q, qy);
        acc = _mm256_fmadd_ps(d0d1, xy, acc);
    }
    *acc_io = acc;
    *summs_io = summs;
}

#define TG_MULTI_B32(NAME, BLOCK, YBLOCK, UNPACK, COL_CALL, SINGLE, RESULT)                                   \
static void NAME(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx,                   \
                 const void * GGML_RESTRICT vy, size_t by, int nc) {                                          \
    /* rows are short (a 896-wide Q5_0 row is 616 B) and come one call at a time: prefetch the stretch    */  \
    /* of weights a row's length, TG_B32_PREFETCH_AHEAD bytes ahead (a no-op past the matrix's end)       */  \
    for (size_t off = 0; off < (size_t) (n / 32) * sizeof(BLOCK); off += 64) {                               \
        _mm_prefetch((const char *) vx + TG_B32_PREFETCH_AHEAD + off, _MM_HINT_T0);                          \
    }                                                                                                         \
    if (nc == 1) {                                                                                            \
        SINGLE(n, s, 0, vx, 0, vy, 0, 1);                                                                     \
        return;                                                                                               \
    }                                                                                                         \
    const BLOCK * x = (const BLOCK *) vx;                                                                     \
    const int nb = n / 32;                                                                                    \
    tg_b32_unpacked u[TG_B32_CHUNK];                                                                          \
    __m256 acc[TG_MAXC];                                                                                      \
    float summs[TG_MAXC];                                                                                     \
    for (int c = 0; c < nc; ++c) {                                                                            \
        acc[c] = _mm256_setzero_ps();                                                                         \
        summs[c] = 0.0f;                                                                                      \
    }                                                                                                         \
    (void) summs;                                                                                             \
    for (int i0 = 0; i0 < nb; i0 += TG_B32_CHUNK) {                                                          \
        const int m = nb - i0 < TG_B32_CHUNK ? nb - i0 : TG_B32_CHUNK;                                        \
        for (int i = 0; i < m; ++i) {                                                                         \
            UNPACK(&u[i], x + i0 + i);                                                                        \
        }                                                                                                     \
        for (int c = 0; c < nc; ++c) {                                                                        \
            const YBLOCK * y = (const YBLOCK *) ((const char *) vy + c*by) + i0;                              \
            COL_CALL;                                                                                         \
        }                                                                                                     \
    }                                                                                                         \
    for (int c = 0; c < nc; ++c) {                                                                            \
        *(float *) ((char *) s + c*bs) = RESULT;                                                              \
    }                                                                                                         \
}

TG_MULTI_B32(ggml_vec_dot_q8_0_q8_0_multi, block_q8_0, block_q8_0, tg_unpack_q8_0,
             tg_x_q8_0_col(u, y, m, &acc[c]), ggml_vec_dot_q8_0_q8_0, hsum_float_8(acc[c]))
TG_MULTI_B32(ggml_vec_dot_q5_0_q8_0_multi, block_q5_0, block_q8_0, tg_unpack_q5_0,
             tg_x_q8_0_col(u, y, m, &acc[c]), ggml_vec_dot_q5_0_q8_0, hsum_float_8(acc[c]))
TG_MULTI_B32(ggml_vec_dot_q4_1_q8_1_multi, block_q4_1, block_q8_1, tg_unpack_q4_1,
             tg_q4_1_col(u, y, m, &acc[c], &summs[c]), ggml_vec_dot_q4_1_q8_1, hsum_float_8(acc[c]) + summs[c])

ggml_vec_dot_multi_t ggml_vec_dot_multi_for(enum ggml_type type) {
    switch (type) {
        case GGML_TYPE_Q8_0: return ggml_vec_dot_q8_0_q8_0_multi;
        case GGML_TYPE_Q5_0: return ggml_vec_dot_q5_0_q8_0_multi;
        case GGML_TYPE_Q4_1: return ggml_vec_dot_q4_1_q8_1_multi;
        default: return NULL;
    }
}


// Self-check for the test suite: `rows` random weight rows of `type` against nc random columns through the
// batch-invariant product the matrix multiplication takes for `type` (the K-quant products, else the
// multi-column kernel). Returns the number of outputs whose bits differ from the same product computed one
// column at a time (for the multi-column kernels: from vec_dot), -1 when the type has neither here, -2 when
// every product came out 0 (a broken setup). *deviation (if not NULL): the largest |one-column result -
// vec_dot| over the rms of vec_dot's results, i.e. how far the product's own arithmetic is from ggml's.
int ggml_cpu_treegraft_multicol_check(enum ggml_type type, int n, int rows, int nc, uint32_t seed, float * deviation) {
    ggml_bi_mul_mat_t bi = ggml_bi_mul_mat_for(type);
    ggml_vec_dot_multi_t multi = ggml_vec_dot_multi_for(type);
    if ((bi == NULL && multi == NULL) || nc < 1 || nc > TG_MAXC || rows < 1 || n % ggml_blck_size(type) != 0) {
        return -1;
    }
    ggml_cpu_init();  // the fp16 tables the kernels read (idempotent)
    const struct ggml_type_traits_cpu * tt = ggml_get_type_traits_cpu(type);
    const enum ggml_type vt = tt->vec_dot_type;
    const size_t wrow = ggml_row_size(type, n), yrow = ggml_row_size(vt, n);
    float * f = (float *) malloc(sizeof(float) * n);
    char * w = (char *) malloc(wrow * rows);
    char * y = (char *) malloc(yrow * nc);
    float * out = (float *) malloc(sizeof(float) * rows * nc);
    float * one = (float *) malloc(sizeof(float) * rows);
    uint32_t state = seed * 2654435761u + 1u;
    for (int r = 0; r < rows + nc; ++r) {
        for (int k = 0; k < n; ++k) {
            state = state * 1664525u + 1013904223u;
            const float u = (float) (state >> 8) / 16777216.0f - 0.5f;  // [-0.5, 0.5)
            f[k] = (state & 0x3f) == 0 ? 8.0f * u : u;  // a few outliers: varied block scales
        }
        if (r < rows) {
            tt->from_float(f, w + r * wrow, n);
        } else {
            ggml_get_type_traits_cpu(vt)->from_float(f, y + (r - rows) * yrow, n);
        }
    }
    if (bi) {
        bi(n, w, wrow, rows, y, yrow, nc, out, sizeof(float) * rows);
    } else {
        for (int r = 0; r < rows; ++r) {
            multi(n, out + r, sizeof(float) * rows, w + r * wrow, y, yrow, nc);
        }
    }
    int differ = 0, nonzero = 0;
    double dev = 0.0, sq = 0.0;
    for (int c = 0; c < nc; ++c) {
        if (bi) {
            bi(n, w, wrow, rows, y + c * yrow, yrow, 1, one, sizeof(float) * rows);
        }
        for (int r = 0; r < rows; ++r) {
            float ref;
            tt->vec_dot(n, &ref, 0, w + r * wrow, 0, y + c * yrow, 0, 1);
            const float single = bi ? one[r] : ref;
            differ += memcmp(&single, out + c * rows + r, sizeof(float)) != 0;
            nonzero += ref != 0.0f;
            dev = fmax(dev, fabs((double) single - (double) ref));
            sq += (double) ref * (double) ref;
        }
    }
    if (deviation) {
        *deviation = sq > 0.0 ? (float) (dev / sqrt(sq / (rows * nc))) : 0.0f;
    }
    free(f); free(w); free(y); free(out); free(one);
    return nonzero ? differ : -2;  // -2: the data came out all zero (nothing was compared)
}
#else

ggml_vec_dot_multi_t ggml_vec_dot_multi_for(enum ggml_type type) {
    (void) type;
    return NULL;
}

int ggml_cpu_treegraft_multicol_check(enum ggml_type type, int n, int rows, int nc, uint32_t seed, float * deviation) {
    (void) type; (void) n; (void) rows; (void) nc; (void) seed; (void) deviation;
    return -1;
}

#endif
