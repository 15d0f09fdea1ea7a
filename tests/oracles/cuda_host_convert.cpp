// Runs NVIDIA's own host-side conversions (cuda_fp4.h, cuda_fp6.h, cuda_fp8.h, cuda_bf16.h) over float32 inputs,
// as an independent oracle for fp4sim's encoders. Usage: cuda_host_convert IN.f32 OUT.bin
// OUT holds, for N inputs, 14 planes of N uint8 codes followed by 4 planes of N uint16 codes, in the order
// of the assignments below (tests/conftest.py names them).
#include <cuda_bf16.h>
#include <cuda_fp4.h>
#include <cuda_fp6.h>
#include <cuda_fp8.h>
#include <cstdio>
#include <cstring>
#include <vector>

int main(int argc, char **argv) {
    if (argc != 3) { std::fprintf(stderr, "usage: %s IN.f32 OUT.bin\n", argv[0]); return 2; }
    std::FILE *f = std::fopen(argv[1], "rb");
    if (!f) return 2;
    std::vector<float> x;
    float v;
    while (std::fread(&v, sizeof v, 1, f) == 1) x.push_back(v);
    std::fclose(f);
    const size_t n = x.size();
    std::vector<unsigned char> o8(14 * n);
    std::vector<unsigned short> o16(4 * n);
    for (size_t i = 0; i < n; ++i) {
        const float a = x[i];
        o8[0 * n + i] = __nv_cvt_float_to_fp4(a, __NV_E2M1, cudaRoundNearest);
        o8[1 * n + i] = __nv_cvt_float_to_fp4(a, __NV_E2M1, cudaRoundZero);
        o8[2 * n + i] = __nv_cvt_float_to_fp8(a, __NV_SATFINITE, __NV_E4M3);
        o8[3 * n + i] = __nv_cvt_float_to_fp8(a, __NV_NOSAT, __NV_E4M3);
        o8[4 * n + i] = __nv_cvt_float_to_fp8(a, __NV_SATFINITE, __NV_E5M2);
        o8[5 * n + i] = __nv_cvt_float_to_fp8(a, __NV_NOSAT, __NV_E5M2);
        o8[6 * n + i] = __nv_cvt_float_to_e8m0(a, __NV_SATFINITE, cudaRoundZero);
        o8[7 * n + i] = __nv_cvt_float_to_e8m0(a, __NV_SATFINITE, cudaRoundPosInf);
        o8[8 * n + i] = __nv_cvt_float_to_e8m0(a, __NV_NOSAT, cudaRoundZero);
        o8[9 * n + i] = __nv_cvt_float_to_e8m0(a, __NV_NOSAT, cudaRoundPosInf);
        o8[10 * n + i] = __nv_cvt_float_to_fp6(a, __NV_E2M3, cudaRoundNearest);
        o8[11 * n + i] = __nv_cvt_float_to_fp6(a, __NV_E2M3, cudaRoundZero);
        o8[12 * n + i] = __nv_cvt_float_to_fp6(a, __NV_E3M2, cudaRoundNearest);
        o8[13 * n + i] = __nv_cvt_float_to_fp6(a, __NV_E3M2, cudaRoundZero);
        __nv_bfloat16 b[4] = {__float2bfloat16_rn(a), __float2bfloat16_rz(a), __float2bfloat16_ru(a),
                              __float2bfloat16_rd(a)};
        for (int k = 0; k < 4; ++k) std::memcpy(&o16[k * n + i], &b[k], 2);
    }
    std::FILE *g = std::fopen(argv[2], "wb");
    if (!g) return 2;
    std::fwrite(o8.data(), 1, o8.size(), g);
    std::fwrite(o16.data(), 2, o16.size(), g);
    std::fclose(g);
    return 0;
}
