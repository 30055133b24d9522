// ---- treegraft: batch-invariant K-quant matrix products, Q4_K and Q6_K (appended to ggml-cpu/arch/x86/quants.c) ----
//
// Why: a speculative decoder verifies many tokens in one batch, and its output must be the bits of one-token
// decoding. ggml's own fast paths are not batch-invariant (the repacked gemm/gemv and the tiled matmul take
// other reductions at other batch sizes), and vec_dot's arithmetic (float accumulators in SIMD lanes that each
// hold a slice of every super-block) can only be shared across columns at vec_dot's own cost per column.
//
// So these products define their own arithmetic, chosen so that any vectorisation gives the same bits:
//   for each super-block b of a weight row and an activation column,
//     isum[b] = the exact integer sum of scale(sub-block) * w * a (and msum[b], the mins / offset term) --
//               integer addition is exact, so a kernel may sum these in any order, in any SIMD lanes;
//     z[b]    = (float) isum[b] * (d_w * d_a) - (float) msum[b] * (dmin_w * d_a)   (one fmsub, Q4_K)
//             = (float) isum[b] * (d_w * d_a)                                        (Q6_K)
//   result = ((0 + z[0]) + z[1]) + ... + z[nb-1], in super-block order.
// Two kernels compute it. Up to 5 columns, tg_*_gemvn: each super-block's weights unpacked once and
// multiplied into every column (ggml's AVX2 maddubs/madd pattern, 8 super-blocks' integer sums reduced at
// once). From 6 columns, tg_*_z8: 8 columns in the 8 lanes of a register (activations interleaved once per
// chunk and biased by +128 to be unsigned, the bias taken off as an exact integer; 4 weights broadcast into
// dpbusd; each sub-block's scale applied once per 8 columns). Rows are streamed in order, with software
// prefetch TG_PREFETCH_AHEAD bytes ahead. Both kernels give every output the same bits: a row's result does
// not depend on its batch.
// The result differs from vec_dot's in the last bits (a different float summation order), not in value:
// ggml_cpu_treegraft_multicol_check checks every column count against one column bit for bit, and the
// distance from vec_dot (about 1e-7 of the outputs' rms on random blocks).

#if defined(__AVX2__) && defined(__FMA__)

// the arithmetic above is the contract: no compiler may fuse a multiply and an add of it into one fma
// (GCC fuses vector intrinsics too under its default -ffp-contract=fast)
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif

typedef int32_t __attribute__((may_alias)) tg_i32;  // 4 unpacked weight bytes, read as one broadcast

// the hardware prefetcher alone leaves a row stream waiting on memory: fetch the weights 4 KiB ahead. On the
// Xeon model 207 a one-column Q4_K product streaming from memory took 22 ns a super-block without it, 13
// with it (9.5 from cache; 2-8 KiB ahead within noise, 0.5 KiB half the gain). 4 lines cover a Q4_K
// (144 B) or Q6_K (210 B) super-block wherever it starts; past the matrix's end a prefetch is a no-op.
#define TG_PREFETCH_AHEAD 4096
// the most columns tg_*_gemvn takes at once; from 6 columns the 8-lane kernel was measured cheaper per column
#define TG_GEMVN_MAX 5
#define TG_PREFETCH(p) do {                                                                  \
    const char * tg_pf_ = (const char *) (p) + TG_PREFETCH_AHEAD;                            \
    _mm_prefetch(tg_pf_, _MM_HINT_T0);       _mm_prefetch(tg_pf_ + 64, _MM_HINT_T0);          \
    _mm_prefetch(tg_pf_ + 128, _MM_HINT_T0); _mm_prefetch(tg_pf_ + 192, _MM_HINT_T0);         \
} while (0)

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TG_DPBUSD(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#define TG_DPWSSD(acc, a, b) _mm256_dpwssd_epi32((acc), (a), (b))
// acc += u . (4 bytes at w, broadcast): the broadcast folded into the instruction ({1to8}); compilers
// otherwise hoist the 64 broadcasts of a super-block out of the column loop and spill them
static inline __m256i tg_dpbusd_bcst(__m256i acc, __m256i u, const tg_i32 * w) {
    __asm__("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*w));
    return acc;
}
#define TG_DPBUSD_BCST(acc, u, w) tg_dpbusd_bcst((acc), (u), (w))
#elif defined(__AVXVNNI__)
#define TG_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32((acc), (u), (s))
#define TG_DPWSSD(acc, a, b) _mm256_dpwssd_avx_epi32((acc), (a), (b))
#define TG_DPBUSD_BCST(acc, u, w) TG_DPBUSD((acc), (u), _mm256_set1_epi32(*(w)))
#else
// the same integers without VNNI (no int16 saturation: u <= 255, s <= 63, pairs <= 32130)
#define TG_DPBUSD(acc, u, s) _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1)))
#define TG_DPWSSD(acc, a, b) _mm256_add_epi32((acc), _mm256_madd_epi16((a), (b)))
#define TG_DPBUSD_BCST(acc, u, w) TG_DPBUSD((acc), (u), _mm256_set1_epi32(*(w)))
#endif


// lane j of the result = the sum of the 8 lanes of v[j] (exact: integers)
static inline __m256i tg_hsum8x8(const __m256i * v) {
    const __m256i a0 = _mm256_hadd_epi32(v[0], v[1]);
    const __m256i a1 = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i a2 = _mm256_hadd_epi32(v[4], v[5]);
    const __m256i a3 = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i b0 = _mm256_hadd_epi32(a0, a1);
    const __m256i b1 = _mm256_hadd_epi32(a2, a3);
    return _mm256_add_epi32(_mm256_permute2x128_si256(b0, b1, 0x20), _mm256_permute2x128_si256(b0, b1, 0x31));
}

// the sum of the 8 lanes of v (exact: integers)
static inline int32_t tg_hsum_epi32(__m256i v) {
    __m128i c = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    c = _mm_add_epi32(c, _mm_shuffle_epi32(c, 0x4e));
    c = _mm_add_epi32(c, _mm_shuffle_epi32(c, 0xb1));
    return _mm_cvtsi128_si32(c);
}

// *acc + z[0] + ... + z[m-1], one add at a time in lane order: the result's super-block order
static inline void tg_add_in_order(float * acc, __m256 z, int m) {
    float zz[8];
    _mm256_storeu_ps(zz, z);
    for (int k = 0; k < m; ++k) {
        *acc += zz[k];
    }
}

// r[i] := the i-th dword of each of r[0..7]
static inline void tg_transpose8(__m256i * r) {
    const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
    const __m256i t4 = _mm256_unpacklo_epi32(r[4], r[5]), t5 = _mm256_unpackhi_epi32(r[4], r[5]);
    const __m256i t6 = _mm256_unpacklo_epi32(r[6], r[7]), t7 = _mm256_unpackhi_epi32(r[6], r[7]);
    const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
    const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
    const __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
    const __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
    r[0] = _mm256_permute2x128_si256(u0, u4, 0x20);
    r[1] = _mm256_permute2x128_si256(u1, u5, 0x20);
    r[2] = _mm256_permute2x128_si256(u2, u6, 0x20);
    r[3] = _mm256_permute2x128_si256(u3, u7, 0x20);
    r[4] = _mm256_permute2x128_si256(u0, u4, 0x31);
    r[5] = _mm256_permute2x128_si256(u1, u5, 0x31);
    r[6] = _mm256_permute2x128_si256(u2, u6, 0x31);
    r[7] = _mm256_permute2x128_si256(u3, u7, 0x31);
}

// 8 activation columns of one super-block, lanes = columns
typedef struct {
    __m256i qa[64];  // [g]: each column's 4 values at positions 4g..4g+3, + 128 (unsigned bytes)
    __m256i bs[8];   // [p]: each column's bsums[2p] | bsums[2p+1] << 16
    __m256 d;        // each column's scale
} tg_act8;

// columns y[0..nc) (nc <= 8; the missing ones are zero) -> act[0..nb)
static void tg_interleave8(tg_act8 * act, const block_q8_K * const * y, int nc, int nb) {
    const __m256i bias = _mm256_set1_epi8((char) 0x80);
    for (int i = 0; i < nb; ++i) {
        for (int t = 0; t < 8; ++t) {
            __m256i r[8];
            for (int c = 0; c < 8; ++c) {
                r[c] = c < nc ? _mm256_xor_si256(_mm256_loadu_si256((const __m256i *) (y[c][i].qs + 32*t)), bias) : bias;
            }
            tg_transpose8(r);
            for (int k = 0; k < 8; ++k) {
                act[i].qa[8*t + k] = r[k];
            }
        }
        __m256i r[8];
        float d[8];
        for (int c = 0; c < 8; ++c) {
            r[c] = c < nc ? _mm256_loadu_si256((const __m256i *) y[c][i].bsums) : _mm256_setzero_si256();
            d[c] = c < nc ? y[c][i].d : 0.0f;
        }
        tg_transpose8(r);
        for (int k = 0; k < 8; ++k) {
            act[i].bs[k] = r[k];
        }
        act[i].d = _mm256_loadu_ps(d);
    }
}

// ---------------------------------------------------------------- Q4_K

// one Q4_K super-block unpacked for the gemm
typedef struct {
    uint8_t w[256];      // the 4-bit values in position order
    int32_t scale[8];    // sub-block scales
    int32_t minpair[8];  // (min_p, min_p) as two int16: the dpwssd partner of bsums[2p], bsums[2p+1]
    int32_t corr[1];     // 128 * sum_p scale_p * sum(w in sub-block p): the +128 activation bias, taken off
    float d[1], dmin[1];
} tg_w_q4_K;

static inline void tg_q4_K_scales(const block_q4_K * x, uint32_t * utmp) {
    static const uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
    memcpy(utmp, x->scales, 12);
    utmp[3] = ((utmp[2] >> 4) & kmask2) | (((utmp[1] >> 6) & kmask3) << 4);
    const uint32_t uaux = utmp[1] & kmask1;
    utmp[1] = (utmp[2] & kmask2) | (((utmp[0] >> 6) & kmask3) << 4);
    utmp[2] = uaux;
    utmp[0] &= kmask1;
    // bytes 0..7: scales, 8..15: mins
}

static inline void tg_unpack_w_q4_K(tg_w_q4_K * u, const block_q4_K * x) {
    uint32_t utmp[4];
    tg_q4_K_scales(x, utmp);
    const uint8_t * sc = (const uint8_t *) utmp;
    const __m256i m4 = _mm256_set1_epi8(0xF);
    __m256i c16 = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
        const __m256i bits = _mm256_loadu_si256((const __m256i *) (x->qs + 32*j));
        const __m256i lo = _mm256_and_si256(bits, m4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
        _mm256_storeu_si256((__m256i *) (u->w + 64*j), lo);
        _mm256_storeu_si256((__m256i *) (u->w + 64*j + 32), hi);
        c16 = _mm256_add_epi16(c16, _mm256_maddubs_epi16(lo, _mm256_set1_epi8((char) sc[2*j])));
        c16 = _mm256_add_epi16(c16, _mm256_maddubs_epi16(hi, _mm256_set1_epi8((char) sc[2*j + 1])));
    }
    // c16 lanes <= 8 * 2 * 15 * 63: no int16 overflow
    const __m256i c32 = _mm256_madd_epi16(c16, _mm256_set1_epi16(1));
    u->corr[0] = 128 * tg_hsum_epi32(c32);
    _mm256_storeu_si256((__m256i *) u->scale, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) sc)));
    const __m256i mn32 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) (sc + 8)));
    _mm256_storeu_si256((__m256i *) u->minpair, _mm256_or_si256(mn32, _mm256_slli_epi32(mn32, 16)));
    u->d[0] = GGML_CPU_FP16_TO_FP32(x->d);
    u->dmin[0] = GGML_CPU_FP16_TO_FP32(x->dmin);
}

// the 4 weights of group g broadcast from memory into dpbusd; a row's p-th integer / its float broadcast
#define TG_DOT(acc, av, u, g) TG_DPBUSD_BCST((acc), (av), (const tg_i32 *) (u)->w + (g))
#define TG_BI(f, p) _mm256_set1_epi32((f)[p])
#define TG_BF(f) _mm256_set1_ps((f)[0])

// z[b] of one weight row for 8 columns (lane c = column c)
static inline __m256 tg_q4_K_z8(const tg_w_q4_K * u, const tg_act8 * a) {
    __m256i isum = _mm256_setzero_si256();
    for (int p = 0; p < 8; ++p) {
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
        for (int g = 0; g < 8; g += 2) {
            s0 = TG_DOT(s0, a->qa[8*p + g], u, 8*p + g);
            s1 = TG_DOT(s1, a->qa[8*p + g + 1], u, 8*p + g + 1);
        }
        isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(_mm256_add_epi32(s0, s1), TG_BI(u->scale, p)));
    }
    isum = _mm256_sub_epi32(isum, TG_BI(u->corr, 0));
    __m256i msum = _mm256_setzero_si256();
    for (int p = 0; p < 8; ++p) {
        msum = TG_DPWSSD(msum, a->bs[p], TG_BI(u->minpair, p));
    }
    const __m256 x1 = _mm256_mul_ps(TG_BF(u->d), a->d);
    const __m256 x2 = _mm256_mul_ps(TG_BF(u->dmin), a->d);
    return _mm256_fmsub_ps(_mm256_cvtepi32_ps(isum), x1, _mm256_mul_ps(_mm256_cvtepi32_ps(msum), x2));
}

// the one-column product for NC columns at once (NC a constant at every call): each super-block's weights
// unpacked once, each column's integer sums and float expression exactly those of the one-column product
static inline __attribute__((always_inline)) void tg_q4_K_gemvn(int n, float * GGML_RESTRICT s, size_t s_stride,
        const void * GGML_RESTRICT vx, const void * GGML_RESTRICT vy, size_t y_stride, const int NC) {
    const block_q4_K * x = (const block_q4_K *) vx;
    const int nb = n / QK_K;
    const __m256i m4 = _mm256_set1_epi8(0xF);
    float acc[TG_GEMVN_MAX] = {0.0f};
    for (int i0 = 0; i0 < nb; i0 += 8) {
        const int m = nb - i0 < 8 ? nb - i0 : 8;
        __m256i I[TG_GEMVN_MAX][8], M[TG_GEMVN_MAX][8];
        float dw[8], dm[8], da[TG_GEMVN_MAX][8];
        for (int k = 0; k < 8; ++k) {
            if (k >= m) {
                for (int c = 0; c < NC; ++c) { I[c][k] = M[c][k] = _mm256_setzero_si256(); da[c][k] = 0.0f; }
                dw[k] = dm[k] = 0.0f;
                continue;
            }
            const block_q4_K * xb = x + i0 + k;
            TG_PREFETCH(xb);
            uint32_t utmp[4];
            tg_q4_K_scales(xb, utmp);
            const __m256i mins_and_scales = _mm256_cvtepu8_epi16(_mm_set_epi32(utmp[3], utmp[2], utmp[1], utmp[0]));
            const __m128i sc128 = _mm256_castsi256_si128(mins_and_scales);
            const __m256i scales = MM256_SET_M128I(sc128, sc128);
            const __m128i mn128 = _mm256_extracti128_si256(mins_and_scales, 1);
            // (min_p, min_p) for bsums[2p], bsums[2p+1]
            const __m256i mins2 = _mm256_cvtepu16_epi32(mn128);
            const __m256i minpair = _mm256_or_si256(mins2, _mm256_slli_epi32(mins2, 16));
            __m256i sumi[TG_GEMVN_MAX];
            for (int c = 0; c < NC; ++c) sumi[c] = _mm256_setzero_si256();
            for (int j = 0; j < 4; ++j) {
                const __m256i bits = _mm256_loadu_si256((const __m256i *) (xb->qs + 32*j));
                const __m256i lo = _mm256_and_si256(bits, m4);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
                const __m256i sl = _mm256_shuffle_epi8(scales, get_scale_shuffle_k4(2*j + 0));
                const __m256i sh = _mm256_shuffle_epi8(scales, get_scale_shuffle_k4(2*j + 1));
                for (int c = 0; c < NC; ++c) {
                    const block_q8_K * yb = (const block_q8_K *) ((const char *) vy + c*y_stride) + i0 + k;
                    const __m256i pl = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *) (yb->qs + 64*j)));
                    const __m256i ph = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *) (yb->qs + 64*j + 32)));
                    sumi[c] = TG_DPWSSD(sumi[c], pl, sl);
                    sumi[c] = TG_DPWSSD(sumi[c], ph, sh);
                }
            }
            for (int c = 0; c < NC; ++c) {
                const block_q8_K * yb = (const block_q8_K *) ((const char *) vy + c*y_stride) + i0 + k;
                I[c][k] = sumi[c];
                M[c][k] = TG_DPWSSD(_mm256_setzero_si256(), _mm256_loadu_si256((const __m256i *) yb->bsums), minpair);
                da[c][k] = yb->d;
            }
            dw[k] = GGML_CPU_FP16_TO_FP32(xb->d);
            dm[k] = GGML_CPU_FP16_TO_FP32(xb->dmin);
        }
        for (int c = 0; c < NC; ++c) {
            const __m256 dav = _mm256_loadu_ps(da[c]);
            const __m256 x1 = _mm256_mul_ps(_mm256_loadu_ps(dw), dav);
            const __m256 x2 = _mm256_mul_ps(_mm256_loadu_ps(dm), dav);
            const __m256 z = _mm256_fmsub_ps(_mm256_cvtepi32_ps(tg_hsum8x8(I[c])), x1,
                                             _mm256_mul_ps(_mm256_cvtepi32_ps(tg_hsum8x8(M[c])), x2));
            tg_add_in_order(&acc[c], z, m);
        }
    }
    for (int c = 0; c < NC; ++c) *(float *) ((char *) s + c*s_stride) = acc[c];
}

// ---------------------------------------------------------------- Q6_K

typedef struct {
    uint8_t w[256];       // the 6-bit values (0..63, before the -32 offset) in position order
    int32_t scale[16];    // sub-block (16 values) scales
    int32_t scalepair[8]; // (scale_2p, scale_2p+1) as two int16: the dpwssd partner of bsums[2p], bsums[2p+1]
    int32_t corr[1];      // 128 * sum_p scale_p * sum(w in sub-block p)
    float d[1];
} tg_w_q6_K;

static inline void tg_q6_K_values(const block_q6_K * x, __m256i * q) {
    const __m256i m3 = _mm256_set1_epi8(3), m15 = _mm256_set1_epi8(15);
    for (int j = 0; j < 2; ++j) {
        const __m256i l1 = _mm256_loadu_si256((const __m256i *) (x->ql + 64*j));
        const __m256i l2 = _mm256_loadu_si256((const __m256i *) (x->ql + 64*j + 32));
        const __m256i h = _mm256_loadu_si256((const __m256i *) (x->qh + 32*j));
        q[4*j + 0] = _mm256_or_si256(_mm256_and_si256(l1, m15), _mm256_slli_epi16(_mm256_and_si256(h, m3), 4));
        q[4*j + 1] = _mm256_or_si256(_mm256_and_si256(l2, m15), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m3), 4));
        q[4*j + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m15), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m3), 4));
        q[4*j + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l2, 4), m15), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m3), 4));
    }
}

static inline void tg_unpack_w_q6_K(tg_w_q6_K * u, const block_q6_K * x) {
    __m256i q[8];
    tg_q6_K_values(x, q);
    __m256i c32 = _mm256_setzero_si256();
    for (int k = 0; k < 8; ++k) {
        _mm256_storeu_si256((__m256i *) (u->w + 32*k), q[k]);
        // the two sub-blocks of these 32 values: scale bytes [2k] x16, [2k+1] x16
        const __m256i sc = MM256_SET_M128I(_mm_set1_epi8(x->scales[2*k + 1]), _mm_set1_epi8(x->scales[2*k]));
        c32 = _mm256_add_epi32(c32, _mm256_madd_epi16(_mm256_maddubs_epi16(q[k], sc), _mm256_set1_epi16(1)));
    }
    u->corr[0] = 128 * tg_hsum_epi32(c32);
    const __m128i sc8 = _mm_loadu_si128((const __m128i *) x->scales);
    _mm256_storeu_si256((__m256i *) u->scale, _mm256_cvtepi8_epi32(sc8));
    _mm256_storeu_si256((__m256i *) (u->scale + 8), _mm256_cvtepi8_epi32(_mm_srli_si128(sc8, 8)));
    _mm256_storeu_si256((__m256i *) u->scalepair, _mm256_cvtepi8_epi16(sc8));  // (scale_2p, scale_2p+1) pairs
    u->d[0] = GGML_CPU_FP16_TO_FP32(x->d);
}

// as tg_q4_K_z8
static inline __m256 tg_q6_K_z8(const tg_w_q6_K * u, const tg_act8 * a) {
    __m256i isum = _mm256_setzero_si256();
    for (int p = 0; p < 16; ++p) {
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
        s0 = TG_DOT(s0, a->qa[4*p + 0], u, 4*p + 0);
        s1 = TG_DOT(s1, a->qa[4*p + 1], u, 4*p + 1);
        s0 = TG_DOT(s0, a->qa[4*p + 2], u, 4*p + 2);
        s1 = TG_DOT(s1, a->qa[4*p + 3], u, 4*p + 3);
        isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(_mm256_add_epi32(s0, s1), TG_BI(u->scale, p)));
    }
    __m256i msum = _mm256_setzero_si256();
    for (int p = 0; p < 8; ++p) {
        msum = TG_DPWSSD(msum, a->bs[p], TG_BI(u->scalepair, p));
    }
    isum = _mm256_sub_epi32(_mm256_sub_epi32(isum, TG_BI(u->corr, 0)), _mm256_slli_epi32(msum, 5));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(TG_BF(u->d), a->d));                                 \
}


// as tg_q4_K_gemvn
static inline __attribute__((always_inline)) void tg_q6_K_gemvn(int n, float * GGML_RESTRICT s, size_t s_stride,
        const void * GGML_RESTRICT vx, const void * GGML_RESTRICT vy, size_t y_stride, const int NC) {
    const block_q6_K * x = (const block_q6_K *) vx;
    const int nb = n / QK_K;
    float acc[TG_GEMVN_MAX] = {0.0f};
    for (int i0 = 0; i0 < nb; i0 += 8) {
        const int m = nb - i0 < 8 ? nb - i0 : 8;
        __m256i I[TG_GEMVN_MAX][8];
        float dw[8], da[TG_GEMVN_MAX][8];
        for (int k = 0; k < 8; ++k) {
            if (k >= m) {
                for (int c = 0; c < NC; ++c) { I[c][k] = _mm256_setzero_si256(); da[c][k] = 0.0f; }
                dw[k] = 0.0f;
                continue;
            }
            const block_q6_K * xb = x + i0 + k;
            TG_PREFETCH(xb);
            __m256i q[8];
            tg_q6_K_values(xb, q);
            const __m128i scales = _mm_loadu_si128((const __m128i *) xb->scales);
            __m256i sumi[TG_GEMVN_MAX];
            for (int c = 0; c < NC; ++c) sumi[c] = _mm256_setzero_si256();
            for (int j = 0; j < 8; ++j) {
                const __m256i sj = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, get_scale_shuffle(j)));
                for (int c = 0; c < NC; ++c) {
                    const block_q8_K * yb = (const block_q8_K *) ((const char *) vy + c*y_stride) + i0 + k;
                    const __m256i p = _mm256_maddubs_epi16(q[j], _mm256_loadu_si256((const __m256i *) (yb->qs + 32*j)));
                    sumi[c] = TG_DPWSSD(sumi[c], p, sj);
                }
            }
            const __m256i sc16 = _mm256_cvtepi8_epi16(scales);
            for (int c = 0; c < NC; ++c) {
                const block_q8_K * yb = (const block_q8_K *) ((const char *) vy + c*y_stride) + i0 + k;
                const __m256i msum = TG_DPWSSD(_mm256_setzero_si256(), _mm256_loadu_si256((const __m256i *) yb->bsums), sc16);
                I[c][k] = _mm256_sub_epi32(sumi[c], _mm256_slli_epi32(msum, 5));
                da[c][k] = yb->d;
            }
            dw[k] = GGML_CPU_FP16_TO_FP32(xb->d);
        }
        for (int c = 0; c < NC; ++c) {
            const __m256 z = _mm256_mul_ps(_mm256_cvtepi32_ps(tg_hsum8x8(I[c])), _mm256_mul_ps(_mm256_loadu_ps(dw), _mm256_loadu_ps(da[c])));
            tg_add_in_order(&acc[c], z, m);
        }
    }
    for (int c = 0; c < NC; ++c) *(float *) ((char *) s + c*s_stride) = acc[c];
}

// ---------------------------------------------------------------- the matrix product

// per-thread scratch for the interleaved activations (grown as needed, kept for the thread's life)
static __thread tg_act8 * tg_act_buf = NULL;
static __thread size_t tg_act_cap = 0;

static tg_act8 * tg_act_scratch(size_t count) {
    if (count > tg_act_cap) {
        free(tg_act_buf);
        tg_act_buf = (tg_act8 *) aligned_alloc(64, count * sizeof(tg_act8));
        tg_act_cap = tg_act_buf ? count : 0;
    }
    return tg_act_buf;
}

// rows [0, nr) of K columns (K a constant: the compiler unrolls each count's column loops)
#define TG_GEMVN_ROWS(TYPE, K) \
    for (int r = 0; r < nr; ++r) tg_##TYPE##_gemvn(n, d + r, dst_stride, w + r*w_stride, y, y_stride, K)

#define TG_GEMM(TYPE, BLOCK, WTYPE, UNPACK, Z8)                                                                        \
static void tg_##TYPE##_mul_mat(int n, const char * GGML_RESTRICT w, size_t w_stride, int nr,                          \
                                const char * GGML_RESTRICT vy, size_t y_stride, int nc,                                \
                                float * GGML_RESTRICT dst, size_t dst_stride) {                                        \
    const int nb = n / QK_K;                                                                                           \
    tg_act8 * act = nc > TG_GEMVN_MAX && nc <= 16 ? tg_act_scratch((size_t) nb * ((nc + 7) / 8)) : NULL;             \
    if (act == NULL) {  /* 1-5 columns (or no scratch): a row at a time, 5 columns at most per pass */             \
        for (int c0 = 0; c0 < nc; c0 += TG_GEMVN_MAX) {                                                                \
            float * d = (float *) ((char *) dst + c0*dst_stride);                                                      \
            const char * y = vy + c0*y_stride;                                                                         \
            switch (nc - c0 < TG_GEMVN_MAX ? nc - c0 : TG_GEMVN_MAX) {                                                 \
                case 1: TG_GEMVN_ROWS(TYPE, 1); break;                                                                 \
                case 2: TG_GEMVN_ROWS(TYPE, 2); break;                                                                 \
                case 3: TG_GEMVN_ROWS(TYPE, 3); break;                                                                 \
                case 4: TG_GEMVN_ROWS(TYPE, 4); break;                                                                 \
                default: TG_GEMVN_ROWS(TYPE, 5); break;                                                                \
            }                                                                                                          \
        }                                                                                                              \
        return;                                                                                                        \
    }                                                                                                                  \
    const int ng = (nc + 7) / 8;                                                                                       \
    for (int g = 0; g < ng; ++g) {                                                                                     \
        const block_q8_K * cols[8];                                                                                    \
        for (int c = 0; c < 8 && 8*g + c < nc; ++c) {                                                                  \
            cols[c] = (const block_q8_K *) (vy + (8*g + c) * y_stride);                                                \
        }                                                                                                              \
        tg_interleave8(act + (size_t) g * nb, cols, nc - 8*g < 8 ? nc - 8*g : 8, nb);                                  \
    }                                                                                                                  \
    /* a row at a time, its super-blocks in order: one sequential stream of weights (measured faster than      */  \
    /* blocks of rows), the interleaved columns re-read from L2 */                                                     \
    for (int r = 0; r < nr; ++r) {                                                                                     \
        const BLOCK * x = (const BLOCK *) (w + r*w_stride);                                                            \
        __m256 acc[2] = { _mm256_setzero_ps(), _mm256_setzero_ps() };                                                  \
        for (int i = 0; i < nb; ++i) {                                                                                 \
            WTYPE u;                                                                                                   \
            TG_PREFETCH(x + i);                                                                                        \
            UNPACK(&u, x + i);                                                                                         \
            for (int g = 0; g < ng; ++g) {                                                                             \
                acc[g] = _mm256_add_ps(acc[g], Z8(&u, act + (size_t) g * nb + i));                                     \
            }                                                                                                          \
        }                                                                                                              \
        for (int g = 0; g < ng; ++g) {                                                                                 \
            float out[8];                                                                                              \
            _mm256_storeu_ps(out, acc[g]);                                                                             \
            for (int c = 0; c < 8 && 8*g + c < nc; ++c) {                                                              \
                ((float *) ((char *) dst + (8*g + c)*dst_stride))[r] = out[c];                                         \
            }                                                                                                          \
        }                                                                                                              \
    }                                                                                                                  \
}

TG_GEMM(q4_K, block_q4_K, tg_w_q4_K, tg_unpack_w_q4_K, tg_q4_K_z8)
TG_GEMM(q6_K, block_q6_K, tg_w_q6_K, tg_unpack_w_q6_K, tg_q6_K_z8)

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

ggml_bi_mul_mat_t ggml_bi_mul_mat_for(enum ggml_type type) {
    switch (type) {
        case GGML_TYPE_Q4_K: return tg_q4_K_mul_mat;
        case GGML_TYPE_Q6_K: return tg_q6_K_mul_mat;
        default: return NULL;
    }
}

#else

ggml_bi_mul_mat_t ggml_bi_mul_mat_for(enum ggml_type type) {
    (void) type;
    return NULL;
}

#endif
