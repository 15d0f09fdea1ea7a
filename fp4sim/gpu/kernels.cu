// fp4sim GPU kernels (compiled by CuPy/NVRTC; the same source is compiled for the host in the tests through a
// thin shim, so every kernel's logic is checked against the Numba backend without a GPU).
// Every fl(.) of SPEC is one IEEE float32 operation. CuPy compiles with --ftz=true, which would flush float32
// subnormals, so float32 values are carried in double precision (exact: float32 -> float64 by its bits) and
// every float32 operation is done in float64 and rounded back to float32 by integer code (r32): for + - * /
// that equals the float32 operation itself, subnormal results included, because float64 keeps more than
// 2*24 + 2 bits (double rounding is innocuous). Compile without FMA contraction (--fmad=false).

#ifndef FP4SIM_HOST_SHIM
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;
#endif

#ifndef FP4SIM_IDS
#error "compile kernels.cu with the ids of fp4sim/ids.py prepended (fp4sim.ids.cuda_defines())"
#endif

#define FLT_MAX_F 3.40282346638528859812e+38f

__device__ __forceinline__ u32 fbits(float f) { return __float_as_uint(f); }
__device__ __forceinline__ double dmin_py(double a, double b) { return b < a ? b : a; }  // Python min(a, b)
__device__ __forceinline__ double dmax_py(double a, double b) { return b > a ? b : a; }

// Exact float32 -> float64 from the bit pattern (no float32 instruction, so FTZ cannot touch subnormals).
__device__ double f2d(u32 u) {
    u32 E = (u >> 23) & 0xFFu, M = u & 0x7FFFFFu;
    u64 sgn = (u64)(u >> 31) << 63;
    if (E == 0) {
        double v = (double)M * 1.4012984643248171e-45;  // M * 2^-149, exact
        return sgn ? -v : v;
    }
    if (E == 255) return __longlong_as_double((long long)(sgn | 0x7FF0000000000000ull | ((u64)M << 29)));
    return __longlong_as_double((long long)(sgn | ((u64)(E - 127 + 1023) << 52) | ((u64)M << 29)));
}

// Round a float64 to nearest-even in a binary format (mbits, emin, bias) by integer arithmetic: the code of
// the result, IEEE overflow to infcode, NaN to nancode. For float32 (23, -126, 127) the code is its bit pattern.
__device__ u32 round_f64(double v, int mbits, int emin, int bias, u64 maxmag, u32 infcode, u32 nancode,
                         u32 signbit) {
    u64 b = (u64)__double_as_longlong(v);
    u32 sgn = (b >> 63) ? signbit : 0u;
    u64 a = b & 0x7FFFFFFFFFFFFFFFull;
    if (a > 0x7FF0000000000000ull) return nancode;
    if (a == 0x7FF0000000000000ull) return infcode | sgn;
    int E = (int)(a >> 52);
    u64 sig = (a & 0xFFFFFFFFFFFFFull) | ((u64)(E != 0) << 52);
    int e = (E > 1 ? E : 1) - 1023;
    int eT = e > emin ? e : emin;
    int s = eT - e + 52 - mbits;
    if (s > 60) s = 60;
    u64 q = sig >> s, rem = sig - (q << s), half = 1ull << (s - 1);
    bool up = rem > half || (rem == half && (q & 1));
    i64 code = (((i64)eT + bias - 1) << mbits) + (i64)q + (up ? 1 : 0);
    if (code > (i64)maxmag) return infcode | sgn;
    return (u32)code | sgn;
}

__device__ __forceinline__ u32 d2f_bits(double v) {
    return round_f64(v, 23, -126, 127, 0x7F7FFFFFull, 0x7F800000u, 0x7FC00000u, 0x80000000u);
}
// fl(v): v rounded to float32, kept as a double
__device__ __forceinline__ double r32(double v) { return f2d(d2f_bits(v)); }

// ------------------------------------------------------------------------------------------ elements
// Magnitude code of |x| (float32 bits a, finite) in a format with mbits/emin/bias; may exceed the max code.
// The random integer and bit count of an SR decision: nsr is the bit count n, plus SR_MIDPOINT (16) for the
// midpoint rule (up iff delta + (2r + 1) / 2^(n+1) >= 1), the truncating rule with n + 1 bits and 2r + 1.
__device__ __forceinline__ void sr_bits(int& r, int& nsr) {
    int mid = (nsr >> 4) & 1;
    r = r * (1 + mid) + mid;
    nsr = (nsr & 15) + mid;
}

__device__ int round_magnitude(u32 a, bool neg, int mode, int r, int nsr, int mbits, int emin, int bias) {
    sr_bits(r, nsr);
    int E = (int)(a >> 23);
    i64 sig = (i64)(a & 0x7FFFFFu) | ((i64)(E != 0) << 23);
    int e = (E > 1 ? E : 1) - 127;
    int eT = e > emin ? e : emin;
    int s = eT - e + 23 - mbits;
    if (s > 40) s = 40;
    i64 q = sig >> s;
    i64 rem = sig - (q << s);
    i64 half = (i64)1 << (s - 1);
    bool inexact = rem != 0;
    bool up;
    if (mode == MODE_RNE) up = (rem > half) || (rem == half && (q & 1));
    else if (mode == MODE_RZ) up = false;
    else if (mode == MODE_RU) up = inexact && !neg;
    else if (mode == MODE_RD) up = inexact && neg;
    else up = ((rem >> (s - nsr)) + r) >= ((i64)1 << nsr);
    return (int)((((i64)eT + bias - 1) << mbits) + q + (up ? 1 : 0));
}

__device__ int encode_one(u32 u, int mode, int r, int nsr, int mbits, int emin, int bias, int maxmag, bool sat,
                          int nosat, int nanc, int signbit) {
    u32 a = u & 0x7FFFFFFFu;
    bool neg = (u >> 31) != 0;
    if (a > 0x7F800000u) return nanc;
    int mag = a == 0x7F800000u ? maxmag + 1 : round_magnitude(a, neg, mode, r, nsr, mbits, emin, bias);
    int m = mag > maxmag ? ((sat || mode == MODE_SR) ? maxmag : nosat) : mag;
    // signbit > 0: ORed in, except on a zero where the NaN is that bit alone (FNUZ, P3109: no -0);
    // signbit = -b: the two's complement of the magnitude modulo 2b (INT8)
    if (!neg || (m == 0 && nanc == signbit)) return m;
    return signbit < 0 ? (-m) & (-2 * signbit - 1) : m | signbit;
}

__device__ int encode_ue8m0(u32 u, int mode, bool sat) {
    u32 a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return 0xFF;
    int E = (int)(a >> 23);
    u32 M = a & 0x7FFFFFu;
    int c;
    if (E == 0) c = mode == MODE_RU ? (a > 0x00400000u) : (mode == MODE_RNE ? (a > 0x00600000u) : 0);
    else if (E == 255) c = 255;
    else if (mode == MODE_RU) c = E + (M != 0);
    else if (mode == MODE_RNE) c = E + ((M > 0x400000u) || (M == 0x400000u && (E & 1)));
    else c = E;
    if (c > 254) return sat ? 0xFE : 0xFF;
    return c;
}

__device__ __constant__ double E2M1_MAGS[8] = {0., 0.5, 1., 1.5, 2., 3., 4., 6.};
__device__ __constant__ double E2M1_STEPS[8] = {0.5, 0.5, 0.5, 0.5, 1., 1., 2., 0.};
__device__ __constant__ double E2M1_VALUES[16] = {0., 0.5, 1., 1.5, 2., 3., 4., 6.,
                                                  -0., -0.5, -1., -1.5, -2., -3., -4., -6.};

// E2M1 code of a float32 value y (held in a double) in any mode (0 rne, 1 rz, 2 ru, 3 rd, 4 sr with random
// integer r of nsr bits); NaN -> 0x7, -0 -> 0x8, satfinite.
__device__ int e2m1_code(double y, int mode, int r, int nsr) {
    sr_bits(r, nsr);
    double ax = fabs(y);
    if (ax != ax) return 7;
    int neg = (int)((u64)__double_as_longlong(y) >> 63);
    int rne = (ax > 0.25) + (ax >= 0.75) + (ax > 1.25) + (ax >= 1.75) + (ax > 2.5) + (ax >= 3.5) + (ax > 5.0);
    if (mode == MODE_RNE) return rne | (neg << 3);
    int lo = (ax >= 0.5) + (ax >= 1.0) + (ax >= 1.5) + (ax >= 2.0) + (ax >= 3.0) + (ax >= 4.0) + (ax >= 6.0);
    double lov = E2M1_MAGS[lo];
    bool inexact = (ax > lov) && lo < 7;
    bool up_sr = (ax - lov) >= (double)((1 << nsr) - r) * ((double)E2M1_STEPS[lo] / (double)(1 << nsr));
    bool up = (mode == MODE_RU && inexact && !neg) || (mode == MODE_RD && inexact && neg) || (mode == MODE_SR && inexact && up_sr);
    return (lo + up) | (neg << 3);
}

// Fast path for RNE in float32 hardware arithmetic, for factors in [2^-100, 2^100] (normal, so FTZ leaves them be).
// FTZ cannot change a code then: the thresholds are >= 0.25,
// so a flushed subnormal y, or y from a flushed subnormal x times a factor <= 2^100, codes as the exact value.
__device__ __forceinline__ int e2m1_rne_f(float y) {
    float ax = fabsf(y);
    if (ax != ax) return 7;
    int rne = (ax > 0.25f) + (ax >= 0.75f) + (ax > 1.25f) + (ax >= 1.75f) + (ax > 2.5f) + (ax >= 3.5f) + (ax > 5.0f);
    return rne | (int)((fbits(y) >> 31) << 3);
}

// ------------------------------------------------------------------------------------------ Philox4x32-10
__device__ void philox(u32 c0, u32 c1, u32 c2, u32 c3, u32 k0, u32 k1, u32 out[4]) {
    for (int i = 0; i < 10; ++i) {
        u32 hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        u32 hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        u32 n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
        k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
    }
    out[0] = c0; out[1] = c1; out[2] = c2; out[3] = c3;
}

// Random bytes of elements start .. start+n-1 (SPEC §1.3); one thread per 16 elements.
extern "C" __global__ void philox_bytes(u64 start, i64 n, u32 k0, u32 k1, u32 stream, u8* out) {
    i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    i64 lo = t * 16;
    if (lo >= n) return;
    u64 b = (start + (u64)lo) >> 4;
    u32 w[4];
    philox((u32)b, (u32)(b >> 32), stream, 0u, k0, k1, w);
    for (i64 i = lo; i < lo + 16 && i < n; ++i) {
        u64 gi = start + (u64)i;
        out[i] = (u8)(w[(gi >> 2) & 3] >> (8 * (gi & 3)));
    }
}

// Stochastic-rounding bytes of the block kernels: ph 0 from rb (one byte per element of the (R, K) rows, none when
// use_rb is 0); ph 1 and 2 generated here from Philox (key k0/k1, stream, masked by mask), element (r, k) being
// the original tensor's flat index r*K + k (ph 1) or, when the block axis had stride `stride` (a multiple of 16)
// in C order, (r / stride)*K*stride + k*stride + r % stride (ph 2); consecutive elements share a Philox call.
struct SrSource {
    const u8* rb;
    int use_rb, ph;
    u32 k0, k1, stream, mask;
    i64 stride;
    u64 ctr;
    u32 w[4];
};

__device__ __forceinline__ SrSource sr_source(const u8* rb, int use_rb, int ph, u32 k0, u32 k1, u32 stream, u32 mask,
                                              i64 stride) {
    SrSource s;
    s.rb = rb; s.use_rb = use_rb; s.ph = ph; s.k0 = k0; s.k1 = k1; s.stream = stream; s.mask = mask;
    s.stride = stride; s.ctr = ~0ull;
    s.w[0] = s.w[1] = s.w[2] = s.w[3] = 0u;
    return s;
}

__device__ __forceinline__ int sr_byte(SrSource& s, i64 r, i64 k, i64 K) {
    if (s.ph == 0) return s.use_rb ? (int)s.rb[r * K + k] : 0;
    u64 gi = s.ph == 1 ? (u64)(r * K + k) : (u64)((r / s.stride) * K * s.stride + k * s.stride + r % s.stride);
    u64 c = gi >> 4;
    if (c != s.ctr) {
        philox((u32)c, (u32)(c >> 32), s.stream, 0u, s.k0, s.k1, s.w);
        s.ctr = c;
    }
    return (int)((s.w[(gi >> 2) & 3] >> (8 * (gi & 3))) & s.mask);
}

// ------------------------------------------------------------------------------------------ inputs
// The block kernels read float32, bfloat16 (16-bit patterns) and float16 inputs directly (in_kind IN_F32,
// IN_BF16, IN_F16) as float32 bit patterns: a bfloat16 is the upper half of a float32, and a float16 widens
// exactly by integer code (its subnormals are float32 normals), so no input copy and no FTZ question.
__device__ __forceinline__ u32 f16_to_f32_bits(u32 h) {
    u32 s = (h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0x1Fu) return s | 0x7F800000u | (m << 13);
    if (e != 0) return s | ((e + 112u) << 23) | (m << 13);
    if (m == 0) return s;
    int p = 9;
    while (!((m >> p) & 1u)) --p;                    // m * 2^-24 = 2^(p - 24) * (m / 2^p)
    return s | ((u32)(p + 103) << 23) | ((m << (23 - p)) & 0x7FFFFFu);
}

__device__ __forceinline__ u32 load1(const void* x, i64 i, int kind) {
    if (kind == IN_F32) return ((const u32*)x)[i];
    u32 h = ((const u16*)x)[i];
    return kind == IN_BF16 ? h << 16 : f16_to_f32_bits(h);
}

// Elements i .. i+3 (i a multiple of 4 and vec_ok) with one 16-byte (float32) or 8-byte (16-bit) load.
__device__ __forceinline__ void load4(const void* x, i64 i, int kind, u32 v[4]) {
    if (kind == IN_F32) {
        uint4 q = ((const uint4*)x)[i >> 2];
        v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
        return;
    }
    uint2 q = ((const uint2*)x)[i >> 2];
    u32 h[4] = {q.x & 0xFFFFu, q.x >> 16, q.y & 0xFFFFu, q.y >> 16};
    for (int e = 0; e < 4; ++e) v[e] = kind == IN_BF16 ? h[e] << 16 : f16_to_f32_bits(h[e]);
}

// Whether rows of K elements from x can be read four at a time (K a multiple of 4, x aligned to the load).
__device__ __forceinline__ bool vec_ok(const void* x, i64 K, int kind) {
    return (K & 3) == 0 && (((u64)x) & (kind == IN_F32 ? 15u : 7u)) == 0;
}

// Four float32 bit patterns to dst (16-byte aligned) with one store.
__device__ __forceinline__ void store4(u32* dst, const u32* v) {
    uint4 o;
    o.x = v[0]; o.y = v[1]; o.z = v[2]; o.w = v[3];
    *(uint4*)dst = o;
}

// max |x| over bit patterns, NaN excluded (a NaN pattern is above Inf's)
__device__ __forceinline__ u32 fold_amax(u32 m, u32 u) {
    u32 a = u & 0x7FFFFFFFu;
    return (a > 0x7F800000u || a <= m) ? m : a;
}

// The 16-point RHT of one chunk in place, as the rht kernel computes it: y_j = round(scale * sum_i x_i sh[i, j]),
// the sum in float64 in the order of i, rounded once to bfloat16 (to_bf16) or float32; bit patterns in and out.
__device__ void rht16(u32 v[16], const double* sh, double scale, int to_bf16) {
    double xv[16];
    for (int i = 0; i < 16; ++i) xv[i] = f2d(v[i]);
    for (int j = 0; j < 16; ++j) {
        double acc = 0.0;
        for (int i = 0; i < 16; ++i) acc += xv[i] * sh[i * 16 + j];
        double y = acc * scale;
        v[j] = to_bf16 ? (round_f64(y, 7, -126, 127, 0x7F7Full, 0x7F80u, 0x7FFFu, 0x8000u) << 16) : d2f_bits(y);
    }
}

// Where element k of row r lies in x: rows r*K .. r*K+K-1 (S = 1), or, read in place from a C-contiguous tensor
// blocked along an axis of stride S (the other axes flattened in C order are the rows), (r/S)*K*S + k*S + r%S.
__device__ __forceinline__ i64 xoff(i64 r, i64 k, i64 K, i64 S) {
    return S == 1 ? r * K + k : (r / S) * K * S + k * S + r % S;
}

// Elements k0 .. k0+15 of row r into v (16- or 8-byte loads when vec), rotated by the 16-point RHT when sh is set.
__device__ __forceinline__ void load16(const void* x, int in_kind, i64 r, i64 K, i64 S, i64 k0, bool vec, u32 v[16],
                                       const double* sh, double scale, int to_bf16) {
    if (vec)
        for (int q = 0; q < 4; ++q) load4(x, r * K + k0 + 4 * q, in_kind, v + 4 * q);
    else
        for (int e = 0; e < 16; ++e) v[e] = load1(x, xoff(r, k0 + e, K, S), in_kind);
    if (sh) rht16(v, sh, scale, to_bf16);
}

// ------------------------------------------------------------------------------------------ element kernels
extern "C" __global__ void encode_elements(const float* x, u8* out, i64 n, int wide, int mode, const u8* rb,
                                           int use_rb, int nsr, int sat, int mbits, int emin, int bias, int maxmag,
                                           int nosat, int nanc, int signbit, int ue8m0, int e2m1) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int r = use_rb ? (int)(rb[i] & ((1 << (nsr & 15)) - 1)) : 0;
    int c;
    if (ue8m0) c = encode_ue8m0(fbits(x[i]), mode, sat);
    else if (e2m1) c = e2m1_code(f2d(fbits(x[i])), mode, r, nsr);
    else c = encode_one(fbits(x[i]), mode, r, nsr, mbits, emin, bias, maxmag, sat, nosat, nanc, signbit);
    if (wide) ((u16*)out)[i] = (u16)c;
    else out[i] = (u8)c;
}

// A thread's amax and NaN flag into the tensor's (amax, has_nan): on the device reduced over the warp first (every
// lane must reach this call), then one atomic per warp; on the host build one per thread.
__device__ __forceinline__ void publish_amax(u32 m, u32 nn, u32* amax, u32* has_nan) {
#ifdef FP4SIM_HOST_SHIM
    atomicMax(amax, m);
    if (nn) atomicMax(has_nan, 1u);
#else
    for (int o = 16; o > 0; o >>= 1) {
        u32 mo = __shfl_xor_sync(0xFFFFFFFFu, m, o);
        m = mo > m ? mo : m;
        nn |= __shfl_xor_sync(0xFFFFFFFFu, nn, o);
    }
    if ((threadIdx.x & 31) == 0) {
        atomicMax(amax, m);
        if (nn) atomicMax(has_nan, 1u);
    }
#endif
}

// max |x| over the bit patterns (NaN excluded) and a NaN flag, grid-stride, four elements per load where the
// input allows; on the device one atomic per warp (a shuffle reduction first), the result left on the device.
extern "C" __global__ void absmax_bits(const void* x, int in_kind, i64 n, u32* amax, u32* has_nan) {
    u32 m = 0, nn = 0;
    i64 t0 = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
    i64 n4 = vec_ok(x, n, in_kind) ? n / 4 : 0;
    for (i64 q = t0; q < n4; q += stride) {
        u32 v[4];
        load4(x, 4 * q, in_kind, v);
        for (int e = 0; e < 4; ++e) {
            m = fold_amax(m, v[e]);
            nn |= (v[e] & 0x7FFFFFFFu) > 0x7F800000u;
        }
    }
    for (i64 i = 4 * n4 + t0; i < n; i += stride) {
        u32 u = load1(x, i, in_kind);
        m = fold_amax(m, u);
        nn |= (u & 0x7FFFFFFFu) > 0x7F800000u;
    }
    publish_amax(m, nn, amax, has_nan);
}

// absmax_bits of rht(x): each 16-element chunk of the (R, K) rows (K a multiple of 16) rotated as the rht kernel
// rotates it (sh, scale, to_bf16), its max |y| folded, nothing written but the amax and the NaN flag. With the
// RHT fused into nvfp4_quantize, the rotated tensor is never stored.
extern "C" __global__ void rht_absmax_bits(const void* x, int in_kind, i64 R, i64 K, i64 S, const double* sh,
                                           double scale, int to_bf16, u32* amax, u32* has_nan) {
    u32 m = 0, nn = 0;
    i64 nch = K / 16, n = R * nch;
    bool vec = S == 1 && vec_ok(x, K, in_kind);
    for (i64 c = (i64)blockIdx.x * blockDim.x + threadIdx.x; c < n; c += (i64)gridDim.x * blockDim.x) {
        u32 v[16];
        i64 r = S == 1 ? c / nch : c % R, k0 = 16 * (S == 1 ? c % nch : c / R);   // in place: rows fastest
        load16(x, in_kind, r, K, S, k0, vec, v, sh, scale, to_bf16);
        for (int e = 0; e < 16; ++e) {
            m = fold_amax(m, v[e]);
            nn |= (v[e] & 0x7FFFFFFFu) > 0x7F800000u;
        }
    }
    publish_amax(m, nn, amax, has_nan);
}

// ------------------------------------------------------------------------------------------ NVFP4
// flavor: FL_TE, FL_PAPER, FL_TORCHAO, FL_MODELOPT (fp4sim/ids.py). Returns the scale byte; *fac is the element factor. All
// values are float32 numbers carried in doubles; each r32 is one float32 operation of SPEC §2.1 / §3.3.
__device__ int nvfp4_scale(double amax_b, int flavor, double c0, double c1, const double* e4m3_vals,
                           double* fac) {
    const double FMAX = 3.4028234663852886e+38;
    double sf;
    if (flavor == FL_TE) sf = dmin_py(r32(amax_b * c0), FMAX);
    else if (flavor == FL_PAPER) sf = dmin_py(r32(r32(amax_b / 6.0) * c0), FMAX);
    else if (flavor == FL_TORCHAO) {
        sf = r32(r32(amax_b / 6.0) / c0);
        if (sf == sf) sf = dmin_py(dmax_py(sf, 0.015625), 448.0);
    } else {
        sf = r32(amax_b / c0);
        if (sf == 0.0) sf = 1.0;
        if (sf == sf) sf = dmin_py(dmax_py(sf, 0.001953125), 448.0);
    }
    int byte = sf != sf ? 0xFF : encode_one(d2f_bits(sf), MODE_RNE, 0, 8, 3, -6, 7, 0x7E, true, 0x7F, 0x7F, 0x80);
    double sval = e4m3_vals[byte];
    if (flavor <= FL_PAPER) *fac = dmin_py(r32(1.0 / r32(sval * c1)), FMAX);
    else if (flavor == FL_TORCHAO) *fac = r32(c1 / sval);
    else *fac = r32(sval * c1);
    return byte;
}

__device__ int nvfp4_elem(double v, double fac, int flavor, int mode, int r, int nsr) {
    double y = r32(flavor == FL_MODELOPT ? v / fac : v * fac);
    int c = e2m1_code(y, mode, r, nsr);
    if (v != v) c = 7;
    else if (flavor == FL_TORCHAO && fac != fac) c = 0xC;
    else if (flavor == FL_MODELOPT && y == 0.0) c = 0;
    return c;
}

// The per-tensor constants of an NVFP4 flavour from a tensor amax left on the device by absmax_bits (one thread):
// out = (c0, c1, dq0, dq1) as planning.nvfp4_constants_rows computes them on the host, each an exact float32 value
// in a double; r6 = fl(1/6) and inv2688 = fl(1/2688) come from the host. No host round trip.
extern "C" __global__ void nvfp4_tensor_constants(const u32* amax_bits, int flavor, double r6, double inv2688,
                                                  double* out) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const double FMAX = 3.4028234663852886e+38;
    double a = f2d(amax_bits[0] & 0x7FFFFFFFu);      // never NaN (absmax_bits skips NaN patterns)
    if (flavor <= FL_PAPER) {
        double s = 1.0;                               // amax 0 or Inf: the encode scale is 1
        if (a != 0.0 && a <= FMAX) {
            double q = 2688.0 / a;                    // float32's quotient, rounded once below
            s = q > FMAX ? FMAX : r32(q);
        }
        double s_dec = r32(1.0 / s);
        out[0] = flavor == FL_TE ? r32(s * r6) : s;
        out[1] = s_dec;
        out[2] = a;
        out[3] = inv2688;
    } else {
        double pts = r32(a / 2688.0);
        out[0] = flavor == FL_TORCHAO ? pts : r32(6.0 * pts);
        out[1] = flavor == FL_TORCHAO ? r32(1.0 / pts) : pts;
        out[2] = pts;
        out[3] = 0.0;
    }
}

// One thread per (row group, 16-wide block). codes: (R, Kp/2) packed; scales: (ceil(R/tile), Kp/16);
// fake: (R, K) float32 bit patterns when do_fake. c0v, c1v, dq0v, dq1v: the flavour's float32 constants (exact
// in double), one set per row when per_row, else one; e4m3_vals: float64 table of the 256 E4M3 values. A full
// full block is read once: a 1x16 block into registers (amax, then its codes from the same registers), a 16x16
// tile row by row. SR bytes: see SrSource. rht_sh (a (16, 16) float64 diag(s) @ H_16, or null): each 16-element
// chunk is first rotated as the rht kernel rotates it (rht_scale, rht_bf16), so that quantize(rht(x)) runs without
// writing and reading the rotated tensor (K a multiple of 16). S: x is read in place (xoff); with S > 1 a warp's
// threads take neighbouring rows, whose elements lie side by side. flags (when not null): bit 0 set when a NaN was
// seen, bit 1 an Inf (of the rotated values with rht_sh), as mx_quantize sets them.
extern "C" __global__ void nvfp4_quantize(const void* x, int in_kind, i64 R, i64 K, i64 S, const u8* rb, int use_rb,
                                          int ph,
                                          u32 pk0, u32 pk1, u32 pstream, u32 pmask, i64 pstride, int mode, int nsr,
                                          int flavor, int tile, const double* c0v, const double* c1v,
                                          const double* dq0v, const double* dq1v, int per_row,
                                          const double* e4m3_vals, u8* codes, u8* scales, u32* fake, int do_fake,
                                          const double* rht_sh, double rht_scale, int rht_bf16, u32* flags) {
    i64 nbk = (K + 15) / 16, ngroups = (R + tile - 1) / tile;
    i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= ngroups * nbk) return;
    i64 g = S == 1 ? t / nbk : t % ngroups, j = S == 1 ? t % nbk : t / ngroups;
    i64 ci = per_row ? g : 0;  // per-row second-level constants (row-scaled NVFP4, 1x16 groups) or one per tensor
    double c0 = c0v[ci], c1 = c1v[ci], dq0 = dq0v[ci], dq1 = dq1v[ci];
    i64 r0 = g * tile, r1 = r0 + tile < R ? r0 + tile : R;
    i64 k0 = j * 16, k1 = k0 + 16 < K ? k0 + 16 : K;
    SrSource sr = sr_source(rb, use_rb, ph, pk0, pk1, pstream, pmask, pstride);
    bool full = k1 - k0 == 16, vec = full && S == 1 && vec_ok(x, K, in_kind);
    u32 v[16];
    u32 m = 0, nn = 0;
    for (i64 r = r0; r < r1; ++r) {
        if (full) {
            load16(x, in_kind, r, K, S, k0, vec, v, rht_sh, rht_scale, rht_bf16);
            for (int e = 0; e < 16; ++e) {
                m = fold_amax(m, v[e]);
                nn |= (v[e] & 0x7FFFFFFFu) > 0x7F800000u;
            }
        } else {
            for (i64 k = k0; k < k1; ++k) {
                u32 u = load1(x, xoff(r, k, K, S), in_kind);
                m = fold_amax(m, u);
                nn |= (u & 0x7FFFFFFFu) > 0x7F800000u;
            }
        }
    }
    u32 fl = (nn ? 1u : 0u) | (m == 0x7F800000u ? 2u : 0u);
    if (fl && flags) atomicOr(flags, fl);
    double fac;
    int byte = nvfp4_scale(f2d(m), flavor, c0, c1, e4m3_vals, &fac);
    scales[g * nbk + j] = (u8)byte;
    double sval = e4m3_vals[byte];
    double sdq = flavor <= FL_PAPER ? r32(r32(sval * dq0) * dq1) : r32(sval * dq0);
    // Fast path: RNE, multiply flavours, factors in [2^-100, 2^100] (see e2m1_rne_f)
    bool fast = mode == MODE_RNE && flavor <= FL_TORCHAO && fac >= 0x1p-100 && fac <= 0x1p100;
    bool fast_dq = sdq >= 0x1p-100 && sdq <= 0x1p100;
    float ff = (float)fac, fdq = (float)sdq;
    for (i64 r = r0; r < r1; ++r) {
        if (full) {
            if (tile != 1)                            // a 1x16 block is still in v
                load16(x, in_kind, r, K, S, k0, vec, v, rht_sh, rht_scale, rht_bf16);
            u64 packed = 0;
            u32 fv[16];
            for (int e = 0; e < 16; ++e) {
                int c;
                if (fast) {
                    c = e2m1_rne_f(__uint_as_float(v[e]) * ff);
                } else {
                    int rr = mode == MODE_SR ? sr_byte(sr, r, k0 + e, K) : 0;
                    c = nvfp4_elem(f2d(v[e]), fac, flavor, mode, rr, nsr);
                }
                packed |= (u64)c << (4 * e);
                fv[e] = fast_dq ? fbits((float)E2M1_VALUES[c] * fdq) : d2f_bits(E2M1_VALUES[c] * sdq);
            }
            *(u64*)(codes + r * (nbk * 8) + j * 8) = packed;
            if (do_fake && vec)
                for (int q = 0; q < 4; ++q) store4(fake + r * K + k0 + 4 * q, fv + 4 * q);
            else if (do_fake)
                for (int e = 0; e < 16; ++e) fake[r * K + k0 + e] = fv[e];
            continue;
        }
        for (i64 p = 0; p < 8; ++p) {
            i64 ka = k0 + 2 * p, kb = ka + 1;
            double va = ka < K ? f2d(load1(x, xoff(r, ka, K, S), in_kind)) : 0.0;
            double vb = kb < K ? f2d(load1(x, xoff(r, kb, K, S), in_kind)) : 0.0;
            int ra = (mode == MODE_SR && ka < K) ? sr_byte(sr, r, ka, K) : 0;
            int rbb = (mode == MODE_SR && kb < K) ? sr_byte(sr, r, kb, K) : 0;
            int ca = nvfp4_elem(va, fac, flavor, mode, ra, nsr), cb = nvfp4_elem(vb, fac, flavor, mode, rbb, nsr);
            codes[r * (nbk * 8) + j * 8 + p] = (u8)(ca | (cb << 4));
            if (do_fake) {
                if (ka < K) fake[r * K + ka] = d2f_bits(E2M1_VALUES[ca] * sdq);
                if (kb < K) fake[r * K + kb] = d2f_bits(E2M1_VALUES[cb] * sdq);
            }
        }
    }
}

// ------------------------------------------------------------------------------------------ NVFP4 4over6
// TransformerEngine's 4over6 block scales (see fp4sim/cpu/four_over_six.py for the rule). The E2M1 x E4M3
// product in FP16 as TE's fast-math path forms it, exactly (integer construction of the FP16 bits).
__device__ double fp16_product(double q, int byte) {
    int q_sign = q < 0.0 ? 1 : 0;
    i64 q_sig = (i64)(fabs(q) * 2.0);
    int s_sign = byte >> 7, s_exp = (byte >> 3) & 0xF, s_man = byte & 0x7;
    i64 s_sig = s_exp == 0 ? s_man : s_man + 8;
    i64 s_exp2 = s_exp == 0 ? s_exp - 9 : s_exp - 10;
    i64 p_sign = q_sign ^ s_sign, p_sig = q_sig * s_sig, p_exp2 = s_exp2 - 1;
    i64 lg = 0;
    for (i64 t = 2; t <= 256; t *= 2) lg += p_sig >= t;
    i64 floor_exp = lg + p_exp2;
    i64 sh = 10 - lg;
    i64 normal = ((floor_exp + 15) << 10) | ((p_sig << (sh > 0 ? sh : 0)) - 1024);
    i64 sub_sh = p_exp2 + 24;
    i64 sub = p_sig << (sub_sh > 0 ? sub_sh : 0);
    i64 bits = (p_sign << 15) | (floor_exp < -14 ? sub : normal);
    if (p_sig == 0) bits = p_sign << 15;
    if ((byte & 0x7F) == 0x7F) bits = 0x7E00;
    double sign = (bits & 0x8000) ? -1.0 : 1.0;
    i64 e = (bits >> 10) & 0x1F, fr = bits & 0x3FF;
    double mag = e == 0 ? ldexp((double)fr, (int)(e - 24)) : ldexp((double)(fr + 1024), (int)(e - 25));
    return sign * mag;
}

// One thread per (row group of `tile` rows, 16-wide block): both candidates, their errors, the choice.
// sec: (S_enc, S_dec, amax_g) triples, one for the tensor (per_row 0) or one per row (row-scaled, tile 1).
// codes: (R, Kp/2) packed; scales: (ceil(R/tile), Kp/16); pick: the same shape, 1 where map-to-4 won.
extern "C" __global__ void nvfp4_4over6_quantize(const float* x, i64 R, i64 K, int tile, const double* sec,
                                                 int per_row, double denom, int err_mse, int fast_math,
                                                 int ties_map4, const double* e4m3_vals, u8* codes, u8* scales,
                                                 u8* pick) {
    const double FMAX = 3.4028234663852886e+38;
    i64 nbk = (K + 15) / 16, ngroups = (R + tile - 1) / tile;
    i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= ngroups * nbk) return;
    i64 g = t / nbk, j = t % nbk;
    const double* sc = sec + (per_row ? 3 * g : 0);
    double s_enc = sc[0], s_dec = sc[1], amax_g = sc[2];
    i64 r0 = g * tile, k0 = j * 16;
    u32 m = 0;
    for (i64 r = r0; r < r0 + tile && r < R; ++r)
        for (i64 k = k0; k < k0 + 16 && k < K; ++k) {
            u32 a = fbits(x[r * K + k]) & 0x7FFFFFFFu;
            m = (a > 0x7F800000u || a <= m) ? m : a;
        }
    double base = r32(r32(f2d(m) / 6.0) * s_enc);
    double tot[2];
    int bytes[2];
    double encs[2];
    for (int c = 0; c < 2; ++c) {
        double sf = c == 0 ? r32(base * 1.5) : base;
        sf = dmin_py(sf, 448.0);
        int byte = encode_one(d2f_bits(sf), MODE_RNE, 0, 8, 3, -6, 7, 0x7E, true, 0x7F, 0x7F, 0x80);
        double sval = e4m3_vals[byte];
        double enc = dmin_py(r32(1.0 / r32(sval * s_dec)), FMAX);
        double errs[16];
        for (int rr = 0; rr < tile; ++rr) {
            i64 r = r0 + rr;
            double e = 0.0;
            for (int kk = 0; kk < 16; ++kk) {
                i64 k = k0 + kk;
                double v = (r < R && k < K) ? f2d(fbits(x[r * K + k])) : 0.0;
                double y = r32(v * enc);
                y = y != y ? y : (y > 6.0 ? 6.0 : (y < -6.0 ? -6.0 : y));
                int code = v != v ? 7 : e2m1_code(y, MODE_RNE, 0, 8);
                double q = E2M1_VALUES[code];
                double d = fast_math ? r32(fp16_product(q, byte) - r32(v * s_enc))
                                     : r32(r32(r32(r32(q * sval) * amax_g) / denom) - v);
                e = r32(e + (err_mse ? r32(d * d) : fabs(d)));
            }
            errs[rr] = e;
        }
        double te;
        if (tile == 16) {
            for (int i = 0; i < 8; ++i) errs[i] = r32(errs[i] + errs[i + 8]);
            for (int i = 0; i < 4; ++i) errs[i] = r32(errs[i] + errs[i + 4]);
            for (int i = 0; i < 2; ++i) errs[i] = r32(errs[i] + errs[i + 2]);
            te = r32(errs[0] + errs[1]);
        } else {
            te = errs[0];
        }
        tot[c] = te;
        bytes[c] = byte;
        encs[c] = enc;
    }
    int w = (tot[0] < tot[1] || (ties_map4 && tot[0] == tot[1])) ? 0 : 1;  // TE: map-to-4 only when smaller
    scales[g * nbk + j] = (u8)bytes[w];
    pick[g * nbk + j] = (u8)(w == 0);
    double enc = encs[w];
    for (i64 r = r0; r < r0 + tile && r < R; ++r)
        for (int p = 0; p < 8; ++p) {
            int cc[2];
            for (int h = 0; h < 2; ++h) {
                i64 k = k0 + 2 * p + h;
                double v = k < K ? f2d(fbits(x[r * K + k])) : 0.0;
                double y = r32(v * enc);
                y = y != y ? y : (y > 6.0 ? 6.0 : (y < -6.0 ? -6.0 : y));
                cc[h] = v != v ? 7 : e2m1_code(y, MODE_RNE, 0, 8);
            }
            codes[r * (nbk * 8) + j * 8 + p] = (u8)(cc[0] | (cc[1] << 4));
        }
}

// ------------------------------------------------------------------------------------------ MX
__device__ int mx_scale_byte(u32 amax_bits, int mode, int emax, int mbits, double rcp) {
    if (mode == SM_RCEIL) {
        u32 a = d2f_bits(f2d(amax_bits) * rcp) & 0x7FFFFFFFu;
        int E = (int)(a >> 23);
        int c = E == 0 ? (a > 0x00400000u) : (E == 255 ? 255 : E + ((a & 0x7FFFFFu) != 0));
        return c < 254 ? c : 254;
    }
    if (amax_bits == 0) return 0;
    i64 u = (i64)amax_bits;
    if (mode == SM_EVEN) u += (i64)1 << (22 - mbits);
    int e = (int)((u >> 23) & 0xFF) - 127 - emax;
    if (mode == SM_CEIL && (u & 0x7FFFFF) != 0) e += 1;
    e = e < -127 ? -127 : (e > 127 ? 127 : e);
    return e + 127;
}

// One thread per (row, 32-wide block). FP4 codes packed (R, Kp/2), FP8 codes (R, Kp). A full block whose row
// can be read four elements at a time is read once, into registers. flags: bit 0 set when a NaN was seen, bit 1
// an Inf (what the host's warnings need, read later without a synchronisation).
extern "C" __global__ void mx_quantize(const void* x, int in_kind, i64 R, i64 K, i64 S, const u8* rb, int use_rb,
                                       int ph,
                                       u32 pk0, u32 pk1, u32 pstream, u32 pmask, i64 pstride, int mode, int nsr,
                                       int scale_mode, int emax, int mbits_elem, double rcp,
                                       const double* pow2_enc, const double* pow2_dec, int mbits, int emin, int bias,
                                       int maxmag, int nosat, int nanc, int signbit, int is_fp4,
                                       const double* elem_vals, u8* codes, u8* scales, u32* fake, int do_fake,
                                       u32* flags) {
    i64 nbk = (K + 31) / 32;
    i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= R * nbk) return;
    i64 r = S == 1 ? t / nbk : t % R, j = S == 1 ? t % nbk : t / R, k0 = j * 32;   // S: see nvfp4_quantize
    SrSource sr = sr_source(rb, use_rb, ph, pk0, pk1, pstream, pmask, pstride);
    bool full = k0 + 32 <= K, vec = full && S == 1 && vec_ok(x, K, in_kind);
    u32 v[32];
    u32 m = 0, nn = 0;
    if (full) {
        if (vec)
            for (int q = 0; q < 8; ++q) load4(x, r * K + k0 + 4 * q, in_kind, v + 4 * q);
        else
            for (int e = 0; e < 32; ++e) v[e] = load1(x, xoff(r, k0 + e, K, S), in_kind);
        for (int e = 0; e < 32; ++e) {
            m = fold_amax(m, v[e]);
            nn |= (v[e] & 0x7FFFFFFFu) > 0x7F800000u;
        }
    } else {
        for (i64 k = k0; k < k0 + 32 && k < K; ++k) {
            u32 u = load1(x, xoff(r, k, K, S), in_kind);
            m = fold_amax(m, u);
            nn |= (u & 0x7FFFFFFFu) > 0x7F800000u;
        }
    }
    u32 fl = (nn ? 1u : 0u) | (m == 0x7F800000u ? 2u : 0u);
    if (fl) atomicOr(flags, fl);
    int e = mx_scale_byte(m, scale_mode, emax, mbits_elem, rcp);
    scales[r * nbk + j] = (u8)e;
    double mul = pow2_enc[e], dmul = pow2_dec[e];
    bool fast_dq = dmul >= 0x1p-100 && dmul <= 0x1p100;
    float fdq = (float)dmul;
    if (full) {
        // fast path (see e2m1_rne_f): x * 2^(127-e) in float32 hardware
        bool fast = is_fp4 && mode == MODE_RNE && mul >= 0x1p-100 && mul <= 0x1p100;
        float mf = (float)mul;
        u64 packed[4] = {0, 0, 0, 0};
        u32 fv[32];
        for (int q = 0; q < 32; ++q) {
            int c;
            if (fast) {
                c = e2m1_rne_f(__uint_as_float(v[q]) * mf);
            } else {
                int rr = mode == MODE_SR ? sr_byte(sr, r, k0 + q, K) : 0;
                double y = r32(f2d(v[q]) * mul);
                c = is_fp4 ? e2m1_code(y, mode, rr, nsr)
                           : encode_one(d2f_bits(y), mode, rr, nsr, mbits, emin, bias, maxmag, true, nosat, nanc,
                                        signbit);
            }
            if (is_fp4) packed[q >> 4] |= (u64)c << (4 * (q & 15));
            else packed[q >> 3] |= (u64)c << (8 * (q & 7));
            fv[q] = fast_dq ? fbits((float)elem_vals[c] * fdq) : d2f_bits(elem_vals[c] * dmul);
        }
        if (is_fp4) {
            u64* dst = (u64*)(codes + r * (nbk * 16) + (k0 >> 1));
            dst[0] = packed[0]; dst[1] = packed[1];
        } else {
            u64* dst = (u64*)(codes + r * (nbk * 32) + k0);
            for (int q = 0; q < 4; ++q) dst[q] = packed[q];
        }
        if (do_fake && vec)
            for (int q = 0; q < 8; ++q) store4(fake + r * K + k0 + 4 * q, fv + 4 * q);
        else if (do_fake)
            for (int q = 0; q < 32; ++q) fake[r * K + k0 + q] = fv[q];
        return;
    }
    int lowc = 0;
    for (i64 k = k0; k < k0 + 32; ++k) {
        double xv = k < K ? f2d(load1(x, xoff(r, k, K, S), in_kind)) : 0.0;
        int rr = (mode == MODE_SR && k < K) ? sr_byte(sr, r, k, K) : 0;
        double y = r32(xv * mul);
        int c;
        if (is_fp4) {
            c = e2m1_code(y, mode, rr, nsr);
            if ((k & 1) == 0) lowc = c;
            else codes[r * (nbk * 16) + (k >> 1)] = (u8)(lowc | (c << 4));
        } else {
            c = encode_one(d2f_bits(y), mode, rr, nsr, mbits, emin, bias, maxmag, true, nosat, nanc, signbit);
            codes[r * (nbk * 32) + k] = (u8)c;
        }
        if (do_fake && k < K) fake[r * K + k] = d2f_bits(elem_vals[c] * dmul);
    }
}

// ------------------------------------------------------------------------------------------ FP8
// Per-tensor (divide = 0: y = x * scale) or blockwise (divide = 1: scale = amax_b / max per tile x blk block).
// One thread per (row group, block). Per-tensor with amax_dev (a tensor amax left on the device by absmax_bits):
// the scale is fl(max / amax) (1 when amax is 0 or Inf, at most FLT_MAX) computed here, and thread 0 writes the
// decode scale fl(1 / scale) to scales[0]: no host round trip; without it, per_tensor_scale is the host's scale.
extern "C" __global__ void fp8_quantize(const void* x, int in_kind, i64 R, i64 K, const u8* rb, int use_rb, int mode,
                                        int nsr, int tile, i64 blk, double per_tensor_scale, const u32* amax_dev,
                                        int divide, int mbits, int emin, int bias, int maxmag, int nosat, int nanc,
                                        int signbit, const double* elem_vals, u8* codes, u32* scales, u32* fake,
                                        int do_fake) {
    const double FMAX = 3.4028234663852886e+38;
    i64 nbk = (K + blk - 1) / blk, ngroups = (R + tile - 1) / tile;
    i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= ngroups * nbk) return;
    i64 g = t / nbk, j = t % nbk;
    i64 r0 = g * tile, r1 = r0 + tile < R ? r0 + tile : R;
    i64 k0 = j * blk, k1 = k0 + blk < K ? k0 + blk : K;
    double fmax_ = elem_vals[maxmag];
    double s = per_tensor_scale;
    bool vec = ((k1 - k0) & 3) == 0 && (k0 & 3) == 0 && vec_ok(x, K, in_kind);
    if (!divide && amax_dev) {
        double a = f2d(amax_dev[0] & 0x7FFFFFFFu);
        s = (a > 0.0 && a <= FMAX) ? dmin_py(r32(fmax_ / a), FMAX) : 1.0;
        if (t == 0) scales[0] = d2f_bits(r32(1.0 / s));
    }
    if (divide) {
        u32 m = 0;
        for (i64 r = r0; r < r1; ++r) {
            if (vec) {
                for (i64 k = k0; k < k1; k += 4) {
                    u32 v[4];
                    load4(x, r * K + k, in_kind, v);
                    for (int e = 0; e < 4; ++e) m = fold_amax(m, v[e]);
                }
            } else {
                for (i64 k = k0; k < k1; ++k) m = fold_amax(m, load1(x, r * K + k, in_kind));
            }
        }
        s = r32(f2d(m) / fmax_);
        scales[g * nbk + j] = d2f_bits(s);
    }
    double inv = r32(1.0 / s);
    for (i64 r = r0; r < r1; ++r)
        for (i64 k = k0; k < k1; k += 4) {
            u32 v[4];
            int n = k + 4 <= k1 ? 4 : (int)(k1 - k);
            if (vec) load4(x, r * K + k, in_kind, v);
            else for (int e = 0; e < n; ++e) v[e] = load1(x, r * K + k + e, in_kind);
            u32 packed = 0, fv[4];
            for (int e = 0; e < n; ++e) {
                double xv = f2d(v[e]);
                int rr = use_rb ? rb[r * K + k + e] : 0;
                double y = r32(divide ? (s != 0.0 ? xv / s : xv * 0.0) : xv * s);
                int c = encode_one(d2f_bits(y), mode, rr, nsr, mbits, emin, bias, maxmag, true, nosat, nanc, signbit);
                packed |= (u32)c << (8 * e);
                fv[e] = d2f_bits(divide ? elem_vals[c] * s : elem_vals[c] * inv);
            }
            if (vec) {
                *(u32*)(codes + r * K + k) = packed;
                if (do_fake) store4(fake + r * K + k, fv);
            } else {
                for (int e = 0; e < n; ++e) {
                    codes[r * K + k + e] = (u8)(packed >> (8 * e));
                    if (do_fake) fake[r * K + k + e] = fv[e];
                }
            }
        }
}

// float32 bit patterns -> float64, exactly (f2d): CuPy's own casts are compiled with -ftz=true and flush float32
// subnormals to zero, so the float64 operands of the kernels below are widened here.
extern "C" __global__ void widen_f32(const u32* x, i64 n, double* y) {
    i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t < n) y[t] = f2d(x[t]);
}

// float64 -> float32 bit patterns rounded to nearest-even by integer code (d2f_bits), subnormals kept: with
// widen_f32 this gives CuPy paths IEEE float32 products, quotients and sums (computed exactly or double-rounded
// innocuously in float64) where CuPy's float32 arithmetic would flush.
extern "C" __global__ void narrow_f64(const double* x, i64 n, u32* y) {
    i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t < n) y[t] = d2f_bits(x[t]);
}

// ------------------------------------------------------------------------------------------ RHT
// One thread per d-long chunk of a row (K a multiple of d): y[r, c0 + j] = round(scale * sum_i x[r, c0 + i] *
// signs_h[i, j]), the sum in float64 in the order of i, rounded once to bfloat16 or float32. The chunk is read
// once (into registers for d <= 32).
extern "C" __global__ void rht(const float* x, i64 R, i64 K, int d, const double* signs_h, double scale,
                               int to_bf16, u32* out) {
    i64 nch = K / d;
    i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= R * nch) return;
    i64 r = t / nch, c0 = (t % nch) * d;
    const float* xr = x + r * K + c0;
    double xv[32];
    bool reg = d <= 32;
    if (reg)
        for (int i = 0; i < d; ++i) xv[i] = f2d(fbits(xr[i]));
    for (int j = 0; j < d; ++j) {
        double acc = 0.0;
        for (int i = 0; i < d; ++i) acc += (reg ? xv[i] : f2d(fbits(xr[i]))) * signs_h[i * d + j];
        double v = acc * scale;  // rounded once, to bfloat16 or float32
        out[r * K + c0 + j] = to_bf16 ? (round_f64(v, 7, -126, 127, 0x7F7Full, 0x7F80u, 0x7FFFu, 0x8000u) << 16)
                                      : d2f_bits(v);
    }
}

// ------------------------------------------------------------------------------------------ dequantize
// One thread per 16 consecutive outputs of a row: v = fl(value(code) * factor), the factor per (row, block)
// (bk is a multiple of 16, or K itself, so the 16 share it):
// kind 0 NVFP4 (E4M3 byte; te/paper fl(fl(s * dq0) * dq1), else fl(s * dq0)), 1 MX (UE8M0 byte -> 2^(e-127)),
// 2 FP8 blockwise (float32 scale per tile x block, tile rows), 3 FP8 per-tensor (the decode scale fl(1/scale) in
// sfloat[0], read here on the device; dq0 unused). codes: packed two per byte when packed, row stride
// cstride bytes; out: float32 bit patterns (R, K). A factor in [2^-100, 2^100] multiplies in float32 hardware
// (the product of an element value and it is then normal or zero, so FTZ cannot touch it); others in float64.
extern "C" __global__ void dequantize_blocks(const u8* codes, int packed, i64 cstride, const u8* sbytes,
                                             const u32* sfloat, i64 R, i64 K, i64 bk, int tile, int kind,
                                             int flavor, double dq0, double dq1, const double* dq0v,
                                             const double* dq1v, int per_row, const double* elem_vals,
                                             const double* e4m3_vals, const double* pow2_dec, u32* out) {
    i64 nch = (K + 15) / 16;
    i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= R * nch) return;
    i64 r = t / nch, k0 = (t % nch) * 16, nbk = (K + bk - 1) / bk, j = k0 / bk;
    int n = k0 + 16 <= K ? 16 : (int)(K - k0);
    double fac;
    if (kind == DQ_NVFP4) {
        double s = e4m3_vals[sbytes[r * nbk + j]];
        double a0 = dq0v[per_row ? r : 0], a1 = dq1v[per_row ? r : 0];  // NVFP4: per-row or per-tensor
        fac = flavor <= FL_PAPER ? r32(r32(s * a0) * a1) : r32(s * a0);
    } else if (kind == DQ_MX) {
        fac = pow2_dec[sbytes[r * nbk + j]];
    } else if (kind == DQ_FP8_BLOCKWISE) {
        fac = f2d(sfloat[(r / tile) * nbk + j]);
    } else {
        fac = f2d(sfloat[0]);
    }
    bool fast = fac >= 0x1p-100 && fac <= 0x1p100;
    float ff = (float)fac;
    u32 o[16];
    for (int e = 0; e < n; ++e) {
        i64 k = k0 + e;
        int c = packed ? ((codes[r * cstride + (k >> 1)] >> (4 * (k & 1))) & 15) : codes[r * cstride + k];
        o[e] = fast ? fbits((float)elem_vals[c] * ff) : d2f_bits(elem_vals[c] * fac);
    }
    u32* dst = out + r * K + k0;
    if (n == 16 && (K & 3) == 0 && (((u64)out) & 15) == 0) {
        for (int q = 0; q < 4; ++q) store4(dst + 4 * q, o + 4 * q);
    } else {
        for (int e = 0; e < n; ++e) dst[e] = o[e];
    }
}

// ------------------------------------------------------------------------------------------ NVFP4 GEMM models
// fp4sim.gemm's exact_sum / kG_rne / kG_rtz (fp4sim/cpu/gemm_models.py has the same rule for the CPU): one thread
// per output element. A (M, Kp), B (N, Kp): twice the E2M1 values; SA (M, Kp/16), SB (N, Kp/16): 512 x the E4M3
// block scales, so every product is an integer in units of 2^-20 and sums of them are exact int64s. Groups of
// gb 16-element blocks in physical K order; each group's exact sum is rounded once to float32 (the int64 ->
// float conversion rounds to nearest-even) and added to the accumulator with a float32 addition rounded to
// nearest-even (ACC_RNE) or toward zero (ACC_RTZ); ACC_EXACT rounds the whole exact sum once. grid > 0: the
// accumulator rounded to the nearest multiple of 1/grid (ties to even). out: the accumulator, before alpha.
extern "C" __global__ void nvfp4_gemm_models(const signed char* A, const signed char* B, const i64* SA,
                                             const i64* SB, i64 M, i64 N, i64 Kp, int gb, int mode, int grid,
                                             float* out) {
    i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= M * N) return;
    i64 i = t / N, j = t % N, nblk = Kp / 16;
    const signed char* a = A + i * Kp;
    const signed char* b = B + j * Kp;
    const float unit = 9.5367431640625e-07f;  // 2^-20
    float acc = 0.0f;
    i64 tot = 0, g = 0;
    for (i64 blk = 0; blk < nblk; ++blk) {
        i64 d = 0;
        for (int k = 0; k < 16; ++k) d += (i64)a[blk * 16 + k] * (i64)b[blk * 16 + k];
        g += d * (SA[i * nblk + blk] * SB[j * nblk + blk]);
        if ((blk + 1) % gb == 0 || blk == nblk - 1) {
            if (mode == ACC_EXACT) {
                tot += g;
            } else {
                float p = (float)g * unit;
                acc = mode == ACC_RNE ? __fadd_rn(acc, p) : __fadd_rz(acc, p);
            }
            g = 0;
        }
    }
    if (mode == ACC_EXACT) acc = (float)tot * unit;
    if (grid > 0) acc = rintf(acc * (float)grid) / (float)grid;
    out[t] = acc;
}

// ------------------------------------------------------------------------------------------ tensor cores
// The block-FMA chain of fp4sim.tensorcore, the rules of the Numba kernel (fp4sim/cpu/tensorcore.py) operation for
// operation: one thread per output; every operation is exact in float64 (a product of two inputs has at most 48
// significant bits, power-of-two scalings, integer sums below 2^53) and float32 results are made by integer code
// (r32), so FTZ cannot touch them. A, B: values (M, K), (N, K); EA, EB: their clamped exponents; idx: the K indices
// of the chain (L of them, -1 a zero element); C, out: float32 bits (M, N).
__device__ __forceinline__ bool finite_d(double v) { return (v - v) == 0.0; }
__device__ __forceinline__ int ilog2_d(double v) { int e; frexp(v, &e); return e - 1; }

extern "C" __global__ void tc_chain(const double* A, const int* EA, const double* B, const int* EB, const i64* idx,
                                    i64 M, i64 N, i64 K, i64 L, int nfma, int frac, int frac_out, int min_exp,
                                    int late, int c_emin, const u32* C, u32* out) {
    i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= M * N) return;
    i64 i = t / N, j = t % N;
    const double* a = A + i * K;
    const double* b = B + j * K;
    const int* ea = EA + i * K;
    const int* eb = EB + j * K;
    double c = f2d(C[t]);
    for (i64 k0 = 0; k0 < L; k0 += nfma) {
        if (!finite_d(c)) break;                    // an overflowed accumulator stays infinite
        int E = min_exp;
        for (i64 u = k0; u < k0 + nfma; ++u) {
            i64 k = idx[u];
            if (k >= 0 && ea[k] + eb[k] > E) E = ea[k] + eb[k];
        }
        if (!late && c != 0.0) {
            int ec = ilog2_d(c);
            if (ec < c_emin) ec = c_emin;
            if (ec > E) E = ec;
        }
        double sc = ldexp(1.0, frac - E), s = 0.0;
        for (i64 u = k0; u < k0 + nfma; ++u) {
            i64 k = idx[u];
            if (k >= 0) s += trunc(a[k] * b[k] * sc);
        }
        if (!late) s += trunc(c * sc);
        double d = s * ldexp(1.0, E - frac);
        if (d != 0.0) {
            int ed = ilog2_d(d);
            if (ed < -126) ed = -126;
            d = trunc(d * ldexp(1.0, frac_out - ed)) * ldexp(1.0, ed - frac_out);
        }
        c = late ? r32(r32(d) + c) : r32(d) + 0.0;   // late: a float32 nearest-even addition
    }
    out[t] = d2f_bits(c);
}

// Blackwell's block-scaled instruction chain (fp4sim/tensorcore/blockscaled.py; the Numba kernel's rules): per L
// elements, each group of G products summed exactly and times its two block scales (bs elements per scale) is a
// term at the scales' exponent sum (e_zero for an all-zero group or a zero scale product); terms and accumulator
// (exponent clamped at -126) truncated to F fraction bits below the largest, summed, truncated to a float32.
extern "C" __global__ void tc_group_chain(const double* A, const double* B, const double* SA, const double* SB,
                                          const i64* ESA, const i64* ESB, i64 M, i64 N, i64 K, i64 nb, int L, int G,
                                          int bs, int F, int e_zero, u32* out) {
    i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= M * N) return;
    i64 i = t / N, j = t % N;
    const double* a = A + i * K;
    const double* b = B + j * K;
    double c = 0.0, v[8];
    i64 e[8];
    int ng = L / G;
    for (i64 k0 = 0; k0 < K; k0 += L) {
        if (!finite_d(c)) break;
        i64 emax = e_zero;
        if (c != 0.0) {
            i64 ec = ilog2_d(c);
            emax = emax > (ec > -126 ? ec : -126) ? emax : (ec > -126 ? ec : -126);
        }
        for (int g = 0; g < ng; ++g) {
            double p = 0.0;
            bool nz = false;
            for (i64 k = k0 + (i64)g * G; k < k0 + (i64)(g + 1) * G; ++k) {
                double q = a[k] * b[k];
                p += q;
                nz = nz || q != 0.0;
            }
            i64 blk = (k0 + (i64)g * G) / bs;
            double s = SA[i * nb + blk] * SB[j * nb + blk];
            v[g] = p * s;
            e[g] = (nz && s != 0.0) ? ESA[i * nb + blk] + ESB[j * nb + blk] : (i64)e_zero;
            if (e[g] > emax) emax = e[g];
        }
        double sc = ldexp(1.0, (int)(F - emax)), acc = 0.0;
        for (int g = 0; g < ng; ++g) acc += trunc(v[g] * sc);
        acc += trunc(c * sc);
        double d = acc * ldexp(1.0, (int)(emax - F));
        if (d != 0.0 && finite_d(d)) {
            int ed = ilog2_d(d);
            if (ed < -126) ed = -126;
            d = trunc(d * ldexp(1.0, 23 - ed)) * ldexp(1.0, ed - 23);
        }
        c = r32(d) + 0.0;
    }
    out[t] = d2f_bits(c);
}

// ------------------------------------------------------------------------------------------ analysis
// The statistics of `fp4sim.analyze --device cuda` (fp4sim/analyze/device.py), as fp4sim/cpu/analysis.py takes them
// on the CPU. Counts, extrema and per-block values are the CPU's exactly: a block's squared error is summed in
// NumPy's pairwise order (np_sum), as the CPU's kernels sum it. The chunk-wide float64 sums (an_sums, the outlier
// study's column sums) are per-thread partial sums added up by the caller: the same terms in another order.

// A thread's count added to a global counter, and a thread's maximum folded into a global one: on the device reduced
// over the warp first (every lane must reach these calls), then one atomic per warp; on the host build one per thread.
__device__ __forceinline__ void publish_add(u64 v, u64* dst) {
#ifdef FP4SIM_HOST_SHIM
    if (v) atomicAdd(dst, v);
#else
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    if ((threadIdx.x & 31) == 0 && v) atomicAdd(dst, v);
#endif
}

template <typename T>
__device__ __forceinline__ void publish_max(T v, T* dst) {
#ifdef FP4SIM_HOST_SHIM
    atomicMax(dst, v);
#else
    for (int o = 16; o > 0; o >>= 1) {
        T w = __shfl_xor_sync(0xFFFFFFFFu, v, o);
        v = w > v ? w : v;
    }
    if ((threadIdx.x & 31) == 0) atomicMax(dst, v);
#endif
}

__device__ __forceinline__ bool fin32(u32 u) { return (u & 0x7FFFFFFFu) < 0x7F800000u; }

// NumPy's direct sum of f(lo) ... f(lo + n - 1), n <= 128 (8 interleaved accumulators), and its pairwise sum of
// f(0) ... f(n - 1) (runs longer than 128 split in two at half the length rounded down to a multiple of 8).
template <class F>
__device__ double np_leaf(const F& f, i64 lo, i64 n) {
    if (n < 8) {
        double res = 0.0;
        for (i64 i = 0; i < n; ++i) res += f(lo + i);
        return res;
    }
    double r[8];
    for (int q = 0; q < 8; ++q) r[q] = f(lo + q);
    i64 i = 8, m = n - n % 8;
    for (; i < m; i += 8)
        for (int q = 0; q < 8; ++q) r[q] += f(lo + i + q);
    double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; ++i) res += f(lo + i);
    return res;
}

template <class F>
__device__ double np_sum(const F& f, i64 lo, i64 n) {
    if (n <= 128) return np_leaf(f, lo, n);
    i64 k2 = n / 2;
    k2 -= k2 % 8;
    return np_sum(f, lo, k2) + np_sum(f, lo + k2, n - k2);
}

// fp4sim.cpu.analysis.block_stats for one chunk, one thread per block of B elements of a row (B = K for the
// per-tensor schemes): x (R, K) float32 and its dequantized values y (R, K); codes the packed E2M1 codes (row
// stride cstride bytes, low nibble first) when fp4. Per block: eb (its squared error over the elements where x and y
// are finite), xm (its largest finite |x|, the first one), ym (|y| there), blk_max (a code of magnitude 7 in it),
// binades (how many E2M1 binades its codes use). Over the chunk: counts[FIN ... DEAD] (see N_COUNTS), max_err (the
// float64 bits of the largest |error|), hist (the codes' histogram); row_amax[r] the float64 bits of the row's
// largest finite |x| (window 2 only). window: 0 no g_amax window, 1 the tensor's, 2 the row's (the dead-zone
// counter counts only with one).
extern "C" __global__ void an_block_stats(const float* x, const float* y, const u8* codes, i64 cstride, i64 R,
                                          i64 K, i64 B, i64 nbk, int fp4, int window, u64* counts, u64* max_err,
                                          u64* row_amax, double* eb, double* xm, double* ym, u8* blk_max,
                                          u8* binades, u64* hist) {
    i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 n_fin = 0, n_lost = 0, n_nz = 0, n_under = 0, n_zy = 0, n_zero = 0, n_sat = 0, n_dead = 0;
    u64 me = 0;
    u32 h[16];
    for (int q = 0; q < 16; ++q) h[q] = 0;
    if (t < R * nbk) {
        i64 r = t / nbk, b = t % nbk, k0 = b * B;
        i64 n = K - k0 < B ? K - k0 : B;
        const float* xr = x + r * K + k0;
        const float* yr = y + r * K + k0;
        double best = 0.0;
        i64 arg = 0;
        for (i64 i = 0; i < n; ++i) {
            u32 bx = fbits(xr[i]), by = fbits(yr[i]);
            double xd = f2d(bx), yd = f2d(by);
            bool fin = fin32(bx), finy = fin32(by), nz = fin && xd != 0.0;
            double dd = fin && finy ? fabs(yd - xd) : 0.0;
            u64 db = (u64)__double_as_longlong(dd);
            me = db > me ? db : me;
            double ab = fin ? fabs(xd) : 0.0;
            if (ab > best) { best = ab; arg = i; }
            n_fin += fin;
            n_lost += fin && !finy;
            n_nz += nz;
            n_under += nz && yd == 0.0;
            n_zy += fin && yd == 0.0;
        }
        auto e2 = [&](i64 i) -> double {
            if (i >= n) return 0.0;
            u32 bx = fbits(xr[i]), by = fbits(yr[i]);
            if (!fin32(bx) || !fin32(by)) return 0.0;
            double d = f2d(by) - f2d(bx);
            return d * d;
        };
        i64 o = r * nbk + b;
        eb[o] = np_sum(e2, 0, B);
        xm[o] = best;
        ym[o] = fabs(f2d(fbits(yr[arg])));
        if (window == 2) atomicMax(row_amax + r, (u64)__double_as_longlong(best));
        if (window) {
            double lim = best / 24.0;
            for (i64 i = 0; i < n; ++i) {
                u32 bx = fbits(xr[i]);
                double ab = fin32(bx) ? fabs(f2d(bx)) : 0.0;
                n_dead += ab > 0.0 && ab < lim;
            }
        }
        if (fp4) {
            int top = 0, used = 0;
            for (i64 i = 0; i < n; ++i) {
                i64 k = k0 + i;
                int c = (codes[r * cstride + (k >> 1)] >> (4 * (k & 1))) & 15, mag = c & 7;
                top = mag > top ? mag : top;
                used |= mag >= 2 ? 1 << (mag >> 1) : mag;
                n_zero += mag == 0;
                u32 bx = fbits(xr[i]);
                n_sat += mag == 7 && fin32(bx) && fabs(f2d(bx)) > fabs(f2d(fbits(yr[i]))) * (1 + 1e-7);
                h[c] += 1;
            }
            blk_max[o] = top == 7;
            binades[o] = (used & 1) + ((used >> 1) & 1) + ((used >> 2) & 1) + ((used >> 3) & 1);
        }
    }
    if (!fp4) n_zero = n_zy;
    publish_add(n_fin, counts + 0);
    publish_add(n_lost, counts + 1);
    publish_add(n_nz, counts + 2);
    publish_add(n_under, counts + 3);
    publish_add(n_zero, counts + 4);
    publish_add(n_sat, counts + 5);
    publish_add(n_dead, counts + 6);
    publish_max(me, max_err);
    if (fp4)
        for (int q = 0; q < 16; ++q) publish_add(h[q], hist + q);
}

// A thread's partial sum into its warp's: on the device a shuffle reduction, lane 0 storing it (every lane must
// reach this call); on the host build, where the threads run one after the other, each adds its own.
__device__ __forceinline__ void publish_part(double v, double* dst) {
#ifdef FP4SIM_HOST_SHIM
    *dst += v;
#else
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    if ((threadIdx.x & 31) == 0) *dst = v;
#endif
}

// The float64 sums of the studies over the finite x of a flat chunk (n elements): partial sums per warp,
// part[w * AN_NCOL + column] (zeroed by the caller), added up by the caller. Warp w takes the 32 * seg elements
// from 32 * seg * w, lane l every 32nd of them from l. Columns: 0 count, 1 sum x, 2 sum x^2, 3 sum ea^2,
// 4 sum eb^2, 5 sum d^2, 6 sum d^4 (d = x - mean), 7 sum ea, 8 sum eb, 9 sum |x|, 10 NaN count, 11 Inf count
// (over every x), 12 sum ea sign(x), 13 sum eb sign(x); ea = float64(ya) - float64(x) (eb of yb) for nerr >= 1 (2),
// whatever ya is (an Inf or NaN ya makes the sums Inf or NaN, as the CPU's masked copies do). amax2: max |x| with NaN ignored ([0], Inf counts) and over the finite x ([1]),
// float32 bits.
#define AN_NCOL 14
extern "C" __global__ void an_sums(const float* x, const float* ya, const float* yb, i64 n, int nerr, double mean,
                                   int seg, double* part, u32* amax2) {
    i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    double s[AN_NCOL];
    for (int q = 0; q < AN_NCOL; ++q) s[q] = 0.0;
    u32 am = 0, fm = 0;
    i64 base = (t >> 5) * 32 * (i64)seg + (t & 31);
    for (int j = 0; j < seg; ++j) {
        i64 i = base + 32 * (i64)j;
        if (i >= n) break;
        u32 bx = fbits(x[i]), a = bx & 0x7FFFFFFFu;
        s[10] += a > 0x7F800000u;
        s[11] += a == 0x7F800000u;
        am = fold_amax(am, bx);
        if (a >= 0x7F800000u) continue;
        fm = a > fm ? a : fm;
        double xd = f2d(bx), d = xd - mean, d2 = d * d, sg = xd > 0.0 ? 1.0 : (xd < 0.0 ? -1.0 : 0.0);
        s[0] += 1.0;
        s[1] += xd;
        s[2] += xd * xd;
        s[5] += d2;
        s[6] += d2 * d2;
        s[9] += fabs(xd);
        for (int w = 0; w < nerr && w < 2; ++w) {
            double e = f2d(fbits((w ? yb : ya)[i])) - xd;
            s[3 + w] += e * e;
            s[7 + w] += e;
            s[12 + w] += e * sg;
        }
    }
    if (base - (t & 31) < n)                                  // the same for the whole warp
        for (int q = 0; q < AN_NCOL; ++q) publish_part(s[q], part + (t >> 5) * AN_NCOL + q);
    publish_max(am, amax2);
    publish_max(fm, amax2 + 1);
}

// The outlier study's column sums (fp4sim.cpu.analysis.outlier_sums), one thread per column and tile of `rows` rows:
// perr[tile, k] the sum of (float64(y) - float64(x))^2 over the tile's finite x of column k, px2[tile, k] of x^2;
// col_big[k] set to 1 where |x| > thr (thr a float32 value; NaN is not big).
extern "C" __global__ void an_outlier_cols(const float* x, const float* y, i64 R, i64 K, i64 rows, double thr,
                                           double* perr, double* px2, u8* col_big) {
    i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x, tile = t / K, k = t % K;
    if (tile * rows >= R) return;
    i64 r1 = (tile + 1) * rows < R ? (tile + 1) * rows : R;
    double ce = 0.0, cx = 0.0;
    bool big = false;
    for (i64 r = tile * rows; r < r1; ++r) {
        u32 bx = fbits(x[r * K + k]);
        double xd = f2d(bx);
        big |= f2d(bx & 0x7FFFFFFFu) > thr;
        if (!fin32(bx)) continue;
        double e = f2d(fbits(y[r * K + k])) - xd;
        ce += e * e;
        cx += xd * xd;
    }
    perr[t] = ce;
    px2[t] = cx;
    if (big) col_big[k] = 1;
}

// ... and its 16-element blocks, one thread per block: eb[r, j] its squared error over the finite x summed as NumPy
// sums a run of 16 (the zero-padded last block included), bb[r, j] whether it holds a big value, row_big[r] set to 1
// where the row does.
extern "C" __global__ void an_outlier_blocks(const float* x, const float* y, i64 R, i64 K, double thr, double* eb,
                                             u8* bb, u8* row_big) {
    i64 nbk = (K + 15) / 16, t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= R * nbk) return;
    i64 r = t / nbk, k0 = (t % nbk) * 16, w = K - k0 < 16 ? K - k0 : 16;
    const float* xr = x + r * K + k0;
    const float* yr = y + r * K + k0;
    auto e2 = [&](i64 i) -> double {
        if (i >= w) return 0.0;
        u32 bx = fbits(xr[i]);
        if (!fin32(bx)) return 0.0;
        double e = f2d(fbits(yr[i])) - f2d(bx);
        return e * e;
    };
    bool big = false;
    for (i64 i = 0; i < w; ++i) big |= f2d(fbits(xr[i]) & 0x7FFFFFFFu) > thr;
    eb[t] = np_leaf(e2, 0, 16);
    bb[t] = big;
    if (big) row_big[r] = 1;
}

// The absmax map of a chunk (rows r0 ... of the tensor): one thread per row and group of pc columns, its largest
// finite |x| (NaN and Inf count as 0) folded into m[(r0 + r) / pr, group] (float32 bits) by an atomic max.
extern "C" __global__ void an_absmax_map(const float* x, i64 R, i64 K, i64 r0, i64 pr, i64 pc, i64 cols, u32* m) {
    i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x, r = t / cols, g = t % cols;
    if (r >= R) return;
    i64 k1 = (g + 1) * pc < K ? (g + 1) * pc : K;
    u32 v = 0;
    for (i64 k = g * pc; k < k1; ++k) {
        u32 a = fbits(x[r * K + k]) & 0x7FFFFFFFu;
        v = a < 0x7F800000u && a > v ? a : v;
    }
    atomicMax(m + ((r0 + r) / pr) * cols + g, v);
}
