//! AVX2 helpers more than one kernel uses. Each is `unsafe`: its callers
//! run it only where `simd::avx2()` holds (in `target_feature` code).

use std::arch::x86_64::*;

/// The sum of the eight lanes.
#[inline(always)]
pub unsafe fn sum_lanes(v: __m256) -> f32 {
    let halves = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
    _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)))
}

/// An 8 x 8 matrix of 32-bit lanes (rows[x] holds row x) transposed.
#[inline(always)]
pub unsafe fn transpose(rows: [__m256; 8]) -> [__m256; 8] {
    let [r0, r1, r2, r3, r4, r5, r6, r7] = rows;
    let (t0, t1) = (_mm256_unpacklo_ps(r0, r1), _mm256_unpackhi_ps(r0, r1));
    let (t2, t3) = (_mm256_unpacklo_ps(r2, r3), _mm256_unpackhi_ps(r2, r3));
    let (t4, t5) = (_mm256_unpacklo_ps(r4, r5), _mm256_unpackhi_ps(r4, r5));
    let (t6, t7) = (_mm256_unpacklo_ps(r6, r7), _mm256_unpackhi_ps(r6, r7));
    // u_x holds column x (low half) and x + 4 (high half) of rows 0..4 or 4..8.
    let (u0, u1) = (_mm256_shuffle_ps::<0x44>(t0, t2), _mm256_shuffle_ps::<0xEE>(t0, t2));
    let (u2, u3) = (_mm256_shuffle_ps::<0x44>(t1, t3), _mm256_shuffle_ps::<0xEE>(t1, t3));
    let (u4, u5) = (_mm256_shuffle_ps::<0x44>(t4, t6), _mm256_shuffle_ps::<0xEE>(t4, t6));
    let (u6, u7) = (_mm256_shuffle_ps::<0x44>(t5, t7), _mm256_shuffle_ps::<0xEE>(t5, t7));
    [
        _mm256_permute2f128_ps::<0x20>(u0, u4),
        _mm256_permute2f128_ps::<0x20>(u1, u5),
        _mm256_permute2f128_ps::<0x20>(u2, u6),
        _mm256_permute2f128_ps::<0x20>(u3, u7),
        _mm256_permute2f128_ps::<0x31>(u0, u4),
        _mm256_permute2f128_ps::<0x31>(u1, u5),
        _mm256_permute2f128_ps::<0x31>(u2, u6),
        _mm256_permute2f128_ps::<0x31>(u3, u7),
    ]
}

/// w = exp(w - max) in place; returns their sum: a softmax's weights
/// before the division.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn exponentials(weights: &mut [f32], max: f32) -> f32 {
    let shift = _mm256_set1_ps(max);
    let mut sums = _mm256_setzero_ps();
    let mut chunks = weights.chunks_exact_mut(8);
    for chunk in &mut chunks {
        let e = exp(_mm256_sub_ps(_mm256_loadu_ps(chunk.as_ptr()), shift));
        _mm256_storeu_ps(chunk.as_mut_ptr(), e);
        sums = _mm256_add_ps(sums, e);
    }
    let mut total = sum_lanes(sums);
    for w in chunks.into_remainder() {
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), exp(_mm256_set1_ps(*w - max)));
        *w = lanes[0];
        total += *w;
    }
    total
}

/// e^x for x <= 88: scores minus their maximum (x <= 0, within 4 ulp,
/// tested) and SiLU's e^-g:
/// x = n ln 2 + r with |r| <= ln 2 / 2, e^r by its Taylor series to
/// r^7 / 7! (the next term is below 2^-27 of it), times 2^n built in
/// the exponent bits. Below -87 (e^x under f32's normal range) it
/// returns 0.
#[inline(always)]
pub unsafe fn exp(x: __m256) -> __m256 {
    let tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0), _CMP_LT_OQ);
    let x = _mm256_max_ps(x, _mm256_set1_ps(-87.0));
    let n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)), _MM_FROUND_TO_NEAREST_INT);
    // ln 2 in two parts, so that n * LN2_HIGH is exact.
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_145_75), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428_606_8e-6), r);
    let mut p = _mm256_set1_ps(1.0 / 5040.0);
    for c in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(power)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exponential_is_within_a_few_ulp() {
        super::super::require_avx2();
        let xs: Vec<f32> = (0..=9000).map(|i| -0.01 * i as f32).collect();
        let mut weights = xs.clone();
        // SAFETY: the CPU has AVX2 and FMA.
        let total = unsafe { exponentials(&mut weights, 0.0) };
        for (x, got) in xs.iter().zip(&weights) {
            if *x < -87.0 {
                assert_eq!(*got, 0.0);
            } else {
                let want = x.exp();
                assert!((got - want).abs() <= 4.0 * f32::EPSILON * want, "e^{x}: {got} vs {want}");
            }
        }
        let want_total: f32 = xs.iter().map(|x| if *x < -87.0 { 0.0 } else { x.exp() }).sum();
        assert!((total - want_total).abs() < 1e-5 * want_total);
    }
}
