// Host entry points for fp4sim/gpu/kernels.cu compiled through cuda_host_shim.h (used by tests over ctypes).
// Each host_X(threads, args...) runs kernel X for `threads` threads, exactly as the GPU launch would.
#include "cuda_host_shim.h"
#include "kernels.cu"

#define HOST(name) extern "C" void host_##name

HOST(philox_bytes)(i64 th, u64 start, i64 n, u32 k0, u32 k1, u32 stream, u8* out) {
    host_launch(philox_bytes, th, start, n, k0, k1, stream, out);
}
HOST(encode_elements)(i64 th, const float* x, u8* out, i64 n, int wide, int mode, const u8* rb, int use_rb,
                      int nsr, int sat, int mbits, int emin, int bias, int maxmag, int nosat, int nanc, int signbit,
                      int ue8m0, int e2m1) {
    host_launch(encode_elements, th, x, out, n, wide, mode, rb, use_rb, nsr, sat, mbits, emin, bias, maxmag, nosat,
                nanc, signbit, ue8m0, e2m1);
}
HOST(absmax_bits)(i64 th, const void* x, int in_kind, i64 n, u32* amax, u32* has_nan) {
    host_launch(absmax_bits, th, x, in_kind, n, amax, has_nan);
}
HOST(nvfp4_tensor_constants)(i64 th, const u32* amax_bits, int flavor, double r6, double inv2688, double* out) {
    host_launch(nvfp4_tensor_constants, th, amax_bits, flavor, r6, inv2688, out);
}
HOST(rht_absmax_bits)(i64 th, const void* x, int in_kind, i64 R, i64 K, i64 S, const double* sh, double scale,
                      int to_bf16, u32* amax, u32* has_nan) {
    host_launch(rht_absmax_bits, th, x, in_kind, R, K, S, sh, scale, to_bf16, amax, has_nan);
}
HOST(nvfp4_quantize)(i64 th, const void* x, int in_kind, i64 R, i64 K, i64 S, const u8* rb, int use_rb, int ph, u32 pk0,
                     u32 pk1, u32 pstream, u32 pmask, i64 pstride, int mode, int nsr, int flavor, int tile,
                     const double* c0v, const double* c1v, const double* dq0v, const double* dq1v, int per_row,
                     const double* e4m3_vals, u8* codes, u8* scales, u32* fake, int do_fake, const double* rht_sh,
                     double rht_scale, int rht_bf16, u32* flags) {
    host_launch(nvfp4_quantize, th, x, in_kind, R, K, S, rb, use_rb, ph, pk0, pk1, pstream, pmask, pstride, mode, nsr,
                flavor, tile, c0v, c1v, dq0v, dq1v, per_row, e4m3_vals, codes, scales, fake, do_fake, rht_sh,
                rht_scale, rht_bf16, flags);
}
HOST(nvfp4_4over6_quantize)(i64 th, const float* x, i64 R, i64 K, int tile, const double* sec, int per_row,
                            double denom, int err_mse, int fast_math, int ties_map4, const double* e4m3_vals,
                            u8* codes, u8* scales, u8* pick) {
    host_launch(nvfp4_4over6_quantize, th, x, R, K, tile, sec, per_row, denom, err_mse, fast_math, ties_map4,
                e4m3_vals, codes, scales, pick);
}
HOST(mx_quantize)(i64 th, const void* x, int in_kind, i64 R, i64 K, i64 S, const u8* rb, int use_rb, int ph, u32 pk0,
                  u32 pk1, u32 pstream, u32 pmask, i64 pstride, int mode, int nsr, int scale_mode, int emax,
                  int mbits_elem, double rcp, const double* pow2_enc, const double* pow2_dec, int mbits, int emin,
                  int bias, int maxmag, int nosat, int nanc, int signbit, int is_fp4, const double* elem_vals,
                  u8* codes, u8* scales, u32* fake, int do_fake, u32* flags) {
    host_launch(mx_quantize, th, x, in_kind, R, K, S, rb, use_rb, ph, pk0, pk1, pstream, pmask, pstride, mode, nsr,
                scale_mode, emax, mbits_elem, rcp, pow2_enc, pow2_dec, mbits, emin, bias, maxmag, nosat, nanc, signbit,
                is_fp4, elem_vals, codes, scales, fake, do_fake, flags);
}
HOST(fp8_quantize)(i64 th, const void* x, int in_kind, i64 R, i64 K, const u8* rb, int use_rb, int mode, int nsr,
                   int tile, i64 blk, double per_tensor_scale, const u32* amax_dev, int divide, int mbits, int emin,
                   int bias, int maxmag, int nosat, int nanc, int signbit, const double* elem_vals, u8* codes,
                   u32* scales, u32* fake, int do_fake) {
    host_launch(fp8_quantize, th, x, in_kind, R, K, rb, use_rb, mode, nsr, tile, blk, per_tensor_scale, amax_dev,
                divide, mbits, emin, bias, maxmag, nosat, nanc, signbit, elem_vals, codes, scales, fake, do_fake);
}
HOST(widen_f32)(i64 th, const u32* x, i64 n, double* y) { host_launch(widen_f32, th, x, n, y); }
HOST(narrow_f64)(i64 th, const double* x, i64 n, u32* y) { host_launch(narrow_f64, th, x, n, y); }
HOST(rht)(i64 th, const float* x, i64 R, i64 K, int d, const double* signs_h, double scale, int to_bf16, u32* out) {
    host_launch(rht, th, x, R, K, d, signs_h, scale, to_bf16, out);
}
HOST(dequantize_blocks)(i64 th, const u8* codes, int packed, i64 cstride, const u8* sbytes, const u32* sfloat, i64 R,
                        i64 K, i64 bk, int tile, int kind, int flavor, double dq0, double dq1, const double* dq0v,
                        const double* dq1v, int per_row, const double* elem_vals, const double* e4m3_vals,
                        const double* pow2_dec, u32* out) {
    host_launch(dequantize_blocks, th, codes, packed, cstride, sbytes, sfloat, R, K, bk, tile, kind, flavor, dq0, dq1,
                dq0v, dq1v, per_row, elem_vals, e4m3_vals, pow2_dec, out);
}
HOST(nvfp4_gemm_models)(i64 th, const signed char* A, const signed char* B, const i64* SA, const i64* SB, i64 M,
                        i64 N, i64 Kp, int gb, int mode, int grid, float* out) {
    host_launch(nvfp4_gemm_models, th, A, B, SA, SB, M, N, Kp, gb, mode, grid, out);
}
HOST(tc_chain)(i64 th, const double* A, const int* EA, const double* B, const int* EB, const i64* idx, i64 M, i64 N,
               i64 K, i64 L, int nfma, int frac, int frac_out, int min_exp, int late, int c_emin, const u32* C,
               u32* out) {
    host_launch(tc_chain, th, A, EA, B, EB, idx, M, N, K, L, nfma, frac, frac_out, min_exp, late, c_emin, C, out);
}
HOST(tc_group_chain)(i64 th, const double* A, const double* B, const double* SA, const double* SB, const i64* ESA,
                     const i64* ESB, i64 M, i64 N, i64 K, i64 nb, int L, int G, int bs, int F, int e_zero, u32* out) {
    host_launch(tc_group_chain, th, A, B, SA, SB, ESA, ESB, M, N, K, nb, L, G, bs, F, e_zero, out);
}
HOST(an_block_stats)(i64 th, const float* x, const float* y, const u8* codes, i64 cstride, i64 R, i64 K, i64 B,
                     i64 nbk, int fp4, int window, u64* counts, u64* max_err, u64* row_amax, double* eb, double* xm,
                     double* ym, u8* blk_max, u8* binades, u64* hist) {
    host_launch(an_block_stats, th, x, y, codes, cstride, R, K, B, nbk, fp4, window, counts, max_err, row_amax, eb,
                xm, ym, blk_max, binades, hist);
}
HOST(an_sums)(i64 th, const float* x, const float* ya, const float* yb, i64 n, int nerr, double mean, int seg,
              double* part, u32* amax2) {
    host_launch(an_sums, th, x, ya, yb, n, nerr, mean, seg, part, amax2);
}
HOST(an_outlier_cols)(i64 th, const float* x, const float* y, i64 R, i64 K, i64 rows, double thr, double* perr,
                      double* px2, u8* col_big) {
    host_launch(an_outlier_cols, th, x, y, R, K, rows, thr, perr, px2, col_big);
}
HOST(an_outlier_blocks)(i64 th, const float* x, const float* y, i64 R, i64 K, double thr, double* eb, u8* bb,
                        u8* row_big) {
    host_launch(an_outlier_blocks, th, x, y, R, K, thr, eb, bb, row_big);
}
HOST(an_absmax_map)(i64 th, const float* x, i64 R, i64 K, i64 r0, i64 pr, i64 pc, i64 cols, u32* m) {
    host_launch(an_absmax_map, th, x, R, K, r0, pr, pc, cols, m);
}
