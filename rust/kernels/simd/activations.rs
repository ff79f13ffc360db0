//! Activations quantized to 8 bits per block of 32 inputs, the left side
//! of every 8da4w product (block_gemm's Q4_1 and q8_0's): with the weights
//! in blocks too, a block's dot product is integer arithmetic, 32 byte
//! products per AVX2 `maddubs`.

/// Inputs sharing one scale, in weights and activations alike (ggml's blocks).
pub const BLOCK: usize = 32;

/// Rows of activations quantized per block: q = round(x / d) (ties to even) with
/// d = max|x| / 127, sum = d * sum(q), which a Q4_1 block's minimum multiplies,
/// and code_sum = sum(q), which q8_0's VNNI products take off their offset codes'.
pub struct QuantizedRows {
    pub(crate) codes: Vec<i8>,
    pub(crate) scales: Vec<f32>,
    pub(crate) sums: Vec<f32>,
    pub(crate) code_sums: Vec<i32>,
    pub(crate) blocks: usize,
}

impl QuantizedRows {
    /// `x` holds rows of `k` values; `k` is a multiple of BLOCK.
    pub fn new(x: &[f32], k: usize) -> QuantizedRows {
        assert!(k % BLOCK == 0 && x.len() % k == 0, "rows of a multiple of {BLOCK} values");
        let blocks_total = x.len() / BLOCK;
        let mut rows = QuantizedRows {
            codes: vec![0; x.len()],
            scales: vec![0.0; blocks_total],
            sums: vec![0.0; blocks_total],
            code_sums: vec![0; blocks_total],
            blocks: k / BLOCK,
        };
        quantize_blocks(x, &mut rows);
        rows
    }

    pub(crate) fn len(&self) -> usize {
        self.scales.len() / self.blocks
    }
}

fn quantize_blocks(x: &[f32], rows: &mut QuantizedRows) {
    for (b, (x, codes)) in x.chunks_exact(BLOCK).zip(rows.codes.chunks_exact_mut(BLOCK)).enumerate() {
        #[cfg(target_arch = "x86_64")]
        let (scale, code_sum) = if super::avx2() {
            // SAFETY: the CPU has AVX2 and FMA; both blocks hold BLOCK values.
            unsafe { avx2::quantize_block(x, codes) }
        } else {
            quantize_block(x, codes)
        };
        #[cfg(not(target_arch = "x86_64"))]
        let (scale, code_sum) = quantize_block(x, codes);
        rows.scales[b] = scale;
        rows.sums[b] = scale * code_sum as f32;
        rows.code_sums[b] = code_sum;
    }
}

/// One block's codes; returns its scale d and the sum of its codes.
fn quantize_block(x: &[f32], codes: &mut [i8]) -> (f32, i32) {
    let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = max / 127.0;
    let inverse = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut total = 0i32;
    for (q, v) in codes.iter_mut().zip(x) {
        // Ties to even, as the AVX2 conversion rounds.
        *q = (v * inverse).round_ties_even() as i8;
        total += *q as i32;
    }
    (d, total)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// `quantize_block` in eight lanes.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `x` and `codes` hold at least 32 values.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn quantize_block(x: &[f32], codes: &mut [i8]) -> (f32, i32) {
        let values: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(x.as_ptr().add(8 * i)));
        let sign = _mm256_set1_ps(-0.0);
        let [a, b, c, d] = values.map(|v| _mm256_andnot_ps(sign, v));
        let max8 = _mm256_max_ps(_mm256_max_ps(a, b), _mm256_max_ps(c, d));
        let max4 = _mm_max_ps(_mm256_castps256_ps128(max8), _mm256_extractf128_ps(max8, 1));
        let max2 = _mm_max_ps(max4, _mm_movehl_ps(max4, max4));
        let max = _mm_cvtss_f32(_mm_max_ss(max2, _mm_movehdup_ps(max2)));
        let scale = max / 127.0;
        let inverse = _mm256_set1_ps(if scale > 0.0 { 1.0 / scale } else { 0.0 });
        // Rounded to the nearest integer, ties to even (MXCSR's default).
        let [q0, q1, q2, q3] = values.map(|v| _mm256_cvtps_epi32(_mm256_mul_ps(v, inverse)));
        let total8 = _mm256_add_epi32(_mm256_add_epi32(q0, q1), _mm256_add_epi32(q2, q3));
        let total4 = _mm_add_epi32(_mm256_castsi256_si128(total8), _mm256_extracti128_si256(total8, 1));
        let total2 = _mm_add_epi32(total4, _mm_unpackhi_epi64(total4, total4));
        let total = _mm_cvtsi128_si32(_mm_add_epi32(total2, _mm_shuffle_epi32(total2, 1)));
        // The packs work within 128-bit lanes: the codes come out in
        // pieces of 4 as q0a q1a q2a q3a q0b q1b q2b q3b (a and b the
        // halves of each vector), which one permutation puts in order.
        let words = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
        let ordered = _mm256_permutevar8x32_epi32(words, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(codes.as_mut_ptr() as *mut __m256i, ordered);
        (scale, total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::simd::test_values;

    /// `QuantizedRows` takes the AVX2 path; `quantize_block` is the plain one.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_activation_blocks_quantize_as_the_plain_loop() {
        super::super::require_avx2();
        let x = test_values(8 * BLOCK, 12);
        let rows = QuantizedRows::new(&x, 2 * BLOCK);
        for (b, block) in x.chunks(BLOCK).enumerate() {
            let mut codes = [0i8; BLOCK];
            assert_eq!(quantize_block(block, &mut codes), (rows.scales[b], rows.code_sums[b]));
            assert_eq!(rows.sums[b], rows.scales[b] * rows.code_sums[b] as f32);
            assert_eq!(codes[..], rows.codes[b * BLOCK..(b + 1) * BLOCK]);
            let max = codes.iter().map(|q| q.unsigned_abs()).max();
            assert_eq!(max, Some(127), "the largest value maps to 127");
        }
    }
}
