// A thin shim that lets fp4sim's CUDA kernels compile as plain C++ on the host: the CUDA keywords become
// nothing, thread and block indices become globals that the launcher loops over, and the few intrinsics the
// kernels use get exact host equivalents. Kernels that need no cooperation between threads run unchanged.
#pragma once
#include <cfenv>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <xmmintrin.h>

#define FP4SIM_HOST_SHIM 1
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define __global__
#define __device__
#define __constant__
#define __forceinline__ inline

struct dim3_ { unsigned x, y, z; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
static dim3_ threadIdx, blockIdx, blockDim, gridDim;

inline u32 __float_as_uint(float f) { u32 u; std::memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(u32 u) { float f; std::memcpy(&f, &u, 4); return f; }
inline long long __double_as_longlong(double d) { long long u; std::memcpy(&u, &d, 8); return u; }
inline double __longlong_as_double(long long u) { double d; std::memcpy(&d, &u, 8); return d; }
inline u32 __umulhi(u32 a, u32 b) { return (u32)(((u64)a * (u64)b) >> 32); }
inline u32 atomicMax(u32* p, u32 v) { u32 o = *p; if (v > o) *p = v; return o; }
inline u32 atomicOr(u32* p, u32 v) { u32 o = *p; *p = o | v; return o; }
inline u64 atomicAdd(u64* p, u64 v) { u64 o = *p; *p = o + v; return o; }
inline u64 atomicMax(u64* p, u64 v) { u64 o = *p; if (v > o) *p = v; return o; }
using std::fabs; using std::isinf;
inline float fabsf(float v) { return std::fabs(v); }
inline float nextafterf(float a, float b) { return std::nextafter(a, b); }
using std::rintf;
// float32 additions with a named rounding: the host's own IEEE addition under that rounding mode
inline float __fadd_rn(float a, float b) { volatile float x = a, y = b; volatile float s = x + y; return s; }
inline float __fadd_rz(float a, float b) {
    volatile float x = a, y = b;
    std::fesetround(FE_TOWARDZERO);
    volatile float s = x + y;
    std::fesetround(FE_TONEAREST);
    return s;
}

// Runs the kernel with the CPU's flush-to-zero and denormals-are-zero modes on, as CuPy compiles kernels
// with --ftz=true: a kernel whose float32 arithmetic met a subnormal would then differ from the Numba result.
template <typename... A, typename... B>
void host_launch(void (*kernel)(A...), long long threads, B... args) {
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040u);  // FTZ | DAZ
    blockDim.x = 256; gridDim.x = (unsigned)((threads + 255) / 256);
    for (unsigned b = 0; b < gridDim.x; ++b)
        for (unsigned t = 0; t < blockDim.x; ++t) { blockIdx.x = b; threadIdx.x = t; kernel(args...); }
    _mm_setcsr(csr);
}
