
// ---- treegraft: batch-invariant multi-column dot products (appended to ggml-cpu/arch/x86/quants.c) ----
//
// ggml_vec_dot_<type>_q8_K_multi computes the dot products of ONE weight row with up to 4 activation
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
#define TG_CHUNK 16  // super-blocks unpacked at a time (8 KiB of unpacked weights: stays in L1)

// One super-block of q4_K unpacked for the dot products: per 64-value group j, the low and high nibbles
// as bytes and their sub-block scales broadcast as ggml's AVX2 vec_dot builds them; the mins and the
// two super-block scales.
typedef struct {
    __m256i q[8];   // q4l(j), q4h(j) for j = 0..3
    __m256i sc[8];  // scale_l(j), scale_h(j)
    __m128i mins;
    float d, dmin;
} tg_q4_K_unpacked;

static inline void tg_unpack_q4_K(tg_q4_K_unpacked * u, const block_q4_K * x) {
    static const uint32_t kmask1 = 0x3f3f3f3f;
    static const uint32_t kmask2 = 0x0f0f0f0f;
    static const uint32_t kmask3 = 0x03030303;
    uint32_t utmp[4];
    memcpy(utmp, x->scales, 12);
    utmp[3] = ((utmp[2] >> 4) & kmask2) | (((utmp[1] >> 6) & kmask3) << 4);
    const uint32_t uaux = utmp[1] & kmask1;
    utmp[1] = (utmp[2] & kmask2) | (((utmp[0] >> 6) & kmask3) << 4);
    utmp[2] = uaux;
    utmp[0] &= kmask1;
    const __m256i mins_and_scales = _mm256_cvtepu8_epi16(_mm_set_epi32(utmp[3], utmp[2], utmp[1], utmp[0]));
    u->mins = _mm256_extracti128_si256(mins_and_scales, 1);
    const __m128i sc128 = _mm256_extracti128_si256(mins_and_scales, 0);
    const __m256i scales = MM256_SET_M128I(sc128, sc128);
    const __m256i m4 = _mm256_set1_epi8(0xF);
    for (int j = 0; j < QK_K/64; ++j) {
        const __m256i q4bits = _mm256_loadu_si256((const __m256i*)(x->qs + 32*j));
        u->q[2*j+0] = _mm256_and_si256(q4bits, m4);
        u->q[2*j+1] = _mm256_and_si256(_mm256_srli_epi16(q4bits, 4), m4);
        u->sc[2*j+0] = _mm256_shuffle_epi8(scales, get_scale_shuffle_k4(2*j+0));
        u->sc[2*j+1] = _mm256_shuffle_epi8(scales, get_scale_shuffle_k4(2*j+1));
    }
    u->d = GGML_CPU_FP16_TO_FP32(x->d);
    u->dmin = GGML_CPU_FP16_TO_FP32(x->dmin);
}

// vec_dot_q4_K_q8_K's arithmetic for one column over nb unpacked super-blocks, continuing its accumulators
static inline void tg_q4_K_col(const tg_q4_K_unpacked * u, const block_q8_K * y, int nb, __m256 * acc_io, __m128 * accm_io) {
    __m256 acc = *acc_io;
    __m128 acc_m = *accm_io;
    for (int i = 0; i < nb; ++i) {
        const float dmin = -y[i].d * u[i].dmin;
        const __m256i q8sums = _mm256_loadu_si256((const __m256i*)y[i].bsums);
        const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0), _mm256_extracti128_si256(q8sums, 1));
        const __m128i prod = _mm_madd_epi16(u[i].mins, q8s);
        acc_m = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m);
        const int8_t * q8 = y[i].qs;
        __m256i sumi = _mm256_setzero_si256();
        for (int k = 0; k < 8; k += 2) {
            const __m256i pl = _mm256_madd_epi16(u[i].sc[k+0], _mm256_maddubs_epi16(u[i].q[k+0], _mm256_loadu_si256((const __m256i*)(q8 + 32*k))));
            const __m256i ph = _mm256_madd_epi16(u[i].sc[k+1], _mm256_maddubs_epi16(u[i].q[k+1], _mm256_loadu_si256((const __m256i*)(q8 + 32*k + 32))));
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(pl, ph));
        }
        const float d = y[i].d * u[i].d;
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    *acc_io = acc;
    *accm_io = acc_m;
}

static void ggml_vec_dot_q4_K_q8_K_multi(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx,
                                         const void * GGML_RESTRICT vy, size_t by, int nc) {
    if (nc == 1) {  // one column: vec_dot itself
        ggml_vec_dot_q4_K_q8_K(n, s, 0, vx, 0, vy, 0, 1);
        return;
    }
    const block_q4_K * x = (const block_q4_K *) vx;
    const int nb = n / QK_K;
    tg_q4_K_unpacked u[TG_CHUNK];
    __m256 acc[TG_MAXC];
    __m128 acc_m[TG_MAXC];
    for (int c = 0; c < nc; ++c) {
        acc[c] = _mm256_setzero_ps();
        acc_m[c] = _mm_setzero_ps();
    }
    for (int i0 = 0; i0 < nb; i0 += TG_CHUNK) {
        const int m = nb - i0 < TG_CHUNK ? nb - i0 : TG_CHUNK;
        for (int i = 0; i < m; ++i) {
            tg_unpack_q4_K(&u[i], x + i0 + i);
        }
        for (int c = 0; c < nc; ++c) {
            const block_q8_K * y = (const block_q8_K *) ((const char *) vy + c*by);
            tg_q4_K_col(u, y + i0, m, &acc[c], &acc_m[c]);
        }
    }
    for (int c = 0; c < nc; ++c) {
        __m128 am = acc_m[c];
        am = _mm_add_ps(am, _mm_movehl_ps(am, am));
        am = _mm_add_ss(am, _mm_movehdup_ps(am));
        *(float *) ((char *) s + c*bs) = hsum_float_8(acc[c]) + _mm_cvtss_f32(am);
    }
}

// One super-block of q6_K unpacked: the 16 groups of 6-bit values as bytes and their scales as vec_dot
// widens them; the scales for the bsums correction and the super-block scale.
typedef struct {
    __m256i q[8];
    __m256i sc[8];
    __m256i scales_16;
    float d;
} tg_q6_K_unpacked;

static inline void tg_unpack_q6_K(tg_q6_K_unpacked * u, const block_q6_K * x) {
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m256i m15 = _mm256_set1_epi8(15);
    const uint8_t * q4 = x->ql;
    const uint8_t * qh = x->qh;
    const __m128i scales = _mm_loadu_si128((const __m128i*)x->scales);
    u->scales_16 = _mm256_cvtepi8_epi16(scales);
    int is = 0;
    for (int j = 0; j < QK_K/128; ++j) {
        const __m256i q4bits1 = _mm256_loadu_si256((const __m256i*)q4); q4 += 32;
        const __m256i q4bits2 = _mm256_loadu_si256((const __m256i*)q4); q4 += 32;
        const __m256i q4bitsH = _mm256_loadu_si256((const __m256i*)qh); qh += 32;
        const __m256i q4h_0 = _mm256_slli_epi16(_mm256_and_si256(q4bitsH, m3), 4);
        const __m256i q4h_1 = _mm256_slli_epi16(_mm256_and_si256(q4bitsH, _mm256_set1_epi8(12)), 2);
        const __m256i q4h_2 = _mm256_and_si256(q4bitsH, _mm256_set1_epi8(48));
        const __m256i q4h_3 = _mm256_srli_epi16(_mm256_and_si256(q4bitsH, _mm256_set1_epi8(-64)), 2);
        u->q[4*j+0] = _mm256_or_si256(_mm256_and_si256(q4bits1, m15), q4h_0);
        u->q[4*j+1] = _mm256_or_si256(_mm256_and_si256(q4bits2, m15), q4h_1);
        u->q[4*j+2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4bits1, 4), m15), q4h_2);
        u->q[4*j+3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4bits2, 4), m15), q4h_3);
        for (int k = 0; k < 4; ++k) {
            u->sc[4*j+k] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, get_scale_shuffle(is + k)));
        }
        is += 4;
    }
    u->d = GGML_CPU_FP16_TO_FP32(x->d);
}

static inline void tg_q6_K_col(const tg_q6_K_unpacked * u, const block_q8_K * y, int nb, __m256 * acc_io) {
    __m256 acc = *acc_io;
    for (int i = 0; i < nb; ++i) {
        const int8_t * q8 = y[i].qs;
        __m256i sumi = _mm256_setzero_si256();
        for (int k = 0; k < 8; k += 4) {
            const __m256i p0 = _mm256_madd_epi16(u[i].sc[k+0], _mm256_maddubs_epi16(u[i].q[k+0], _mm256_loadu_si256((const __m256i*)(q8 + 32*k))));
            const __m256i p1 = _mm256_madd_epi16(u[i].sc[k+1], _mm256_maddubs_epi16(u[i].q[k+1], _mm256_loadu_si256((const __m256i*)(q8 + 32*k + 32))));
            const __m256i p2 = _mm256_madd_epi16(u[i].sc[k+2], _mm256_maddubs_epi16(u[i].q[k+2], _mm256_loadu_si256((const __m256i*)(q8 + 32*k + 64))));
            const __m256i p3 = _mm256_madd_epi16(u[i].sc[k+3], _mm256_maddubs_epi16(u[i].q[k+3], _mm256_loadu_si256((const __m256i*)(q8 + 32*k + 96))));
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(_mm256_add_epi32(p0, p1), _mm256_add_epi32(p2, p3)));
        }
        const __m256i q8sums = _mm256_loadu_si256((const __m256i*)y[i].bsums);
        const __m256i q8sclsub = _mm256_slli_epi32(_mm256_madd_epi16(q8sums, u[i].scales_16), 5);
        const float d = y[i].d * u[i].d;
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_sub_epi32(sumi, q8sclsub)), acc);
    }
    *acc_io = acc;
}

static void ggml_vec_dot_q6_K_q8_K_multi(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx,
                                         const void * GGML_RESTRICT vy, size_t by, int nc) {
    if (nc == 1) {
        ggml_vec_dot_q6_K_q8_K(n, s, 0, vx, 0, vy, 0, 1);
        return;
    }
    const block_q6_K * x = (const block_q6_K *) vx;
    const int nb = n / QK_K;
    tg_q6_K_unpacked u[TG_CHUNK];
    __m256 acc[TG_MAXC];
    for (int c = 0; c < nc; ++c) {
        acc[c] = _mm256_setzero_ps();
    }
    for (int i0 = 0; i0 < nb; i0 += TG_CHUNK) {
        const int m = nb - i0 < TG_CHUNK ? nb - i0 : TG_CHUNK;
        for (int i = 0; i < m; ++i) {
            tg_unpack_q6_K(&u[i], x + i0 + i);
        }
        for (int c = 0; c < nc; ++c) {
            const block_q8_K * y = (const block_q8_K *) ((const char *) vy + c*by);
            tg_q6_K_col(u, y + i0, m, &acc[c]);
        }
    }
    for (int c = 0; c < nc; ++c) {
        *(float *) ((char *) s + c*bs) = hsum_float_8(acc[c]);
    }
}

// The 32-value block types: one block unpacked is its 32 weights as bytes and its float scales.
typedef struct {
    __m256i q;
    float d, m;
} tg_b32_unpacked;

#define TG_B32_CHUNK 64  // blocks unpacked at a time (3 KiB)

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
        case GGML_TYPE_Q4_K: return ggml_vec_dot_q4_K_q8_K_multi;
        case GGML_TYPE_Q6_K: return ggml_vec_dot_q6_K_q8_K_multi;
        case GGML_TYPE_Q8_0: return ggml_vec_dot_q8_0_q8_0_multi;
        case GGML_TYPE_Q5_0: return ggml_vec_dot_q5_0_q8_0_multi;
        case GGML_TYPE_Q4_1: return ggml_vec_dot_q4_1_q8_1_multi;
        default: return NULL;
    }
}


// Self-check for the test suite: `rows` random weight rows of `type` against nc random columns, each output
// of the multi-column kernel compared bit for bit with vec_dot's; returns the count that differ, -1 when
// the type has no multi-column kernel here, -2 when every product came out 0 (a broken setup).
int ggml_cpu_treegraft_multicol_check(enum ggml_type type, int n, int rows, int nc, uint32_t seed) {
    ggml_vec_dot_multi_t multi = ggml_vec_dot_multi_for(type);
    if (multi == NULL || nc < 1 || nc > TG_MAXC || rows < 1 || n % ggml_blck_size(type) != 0) {
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
    for (int r = 0; r < rows; ++r) {
        multi(n, out + r, sizeof(float) * rows, w + r * wrow, y, yrow, nc);
    }
    int differ = 0, nonzero = 0;
    for (int r = 0; r < rows; ++r) {
        for (int c = 0; c < nc; ++c) {
            float ref;
            tt->vec_dot(n, &ref, 0, w + r * wrow, 0, y + c * yrow, 0, 1);
            differ += memcmp(&ref, out + c * rows + r, sizeof(float)) != 0;
            nonzero += ref != 0.0f;
        }
    }
    free(f); free(w); free(y); free(out);
    return nonzero ? differ : -2;  // -2: the data came out all zero (nothing was compared)
}
#else

ggml_vec_dot_multi_t ggml_vec_dot_multi_for(enum ggml_type type) {
    (void) type;
    return NULL;
}

int ggml_cpu_treegraft_multicol_check(enum ggml_type type, int n, int rows, int nc, uint32_t seed) {
    (void) type; (void) n; (void) rows; (void) nc; (void) seed;
    return -1;
}

#endif
