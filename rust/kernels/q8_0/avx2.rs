//! The Q8_0 dot products in AVX2: LLVM's intrinsics for 1 to 3
//! activation rows, and hand-written assembly loops where LLVM's spilled
//! registers (two weight rows against one or four activation rows). Every
//! path sums a row's blocks in the same order (the even blocks, then the
//! odd ones), so a row's products do not depend on the rows beside it.

use crate::kernels::simd::avx2::sum_lanes;
use crate::kernels::simd::{ActivationRow, BLOCK};
use std::arch::x86_64::*;

/// 32 products of unsigned `w` and signed `x` bytes, summed to 8 floats.
#[inline(always)]
unsafe fn byte_dot(w: __m256i, x: __m256i) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)))
}

/// One activation row's codes and scales, as raw pointers.
type Row = (*const i8, *const f32);

fn rows<const R: usize>(xs: &[ActivationRow]) -> [Row; R] {
    std::array::from_fn(|r| (xs[r].0.as_ptr(), xs[r].1.as_ptr()))
}

/// A Q8_0 block as maddubs takes it: the codes' magnitudes (its left
/// side is unsigned), and the codes, whose signs go onto the activations.
#[inline(always)]
unsafe fn magnitudes(codes: *const i8, b: usize) -> (__m256i, __m256i) {
    let w = _mm256_loadu_si256(codes.add(b * BLOCK) as *const __m256i);
    (_mm256_sign_epi8(w, w), w)
}

/// Two Q8_0 weight rows (codes, scales) dotted with each of `xs`.
///
/// # Safety
/// The CPU has AVX2 and FMA; the weight rows and each of `xs` (1 to 4
/// rows) hold `w[0].1.len()` blocks.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_pair(w: [(&[i8], &[f32]); 2], xs: &[ActivationRow], out: &mut [[f32; 4]; 2]) {
    let scales = [w[0].1, w[1].1];
    let codes = [w[0].0.as_ptr(), w[1].0.as_ptr()];
    let lanes = match xs.len() {
        4 => four_rows(codes, scales, rows(xs)),
        1 => {
            let [a, b] = one_row(codes, scales, rows::<1>(xs)[0]);
            [widen([a]), widen([b])]
        }
        2 => {
            let [a, b] = pairs_tile::<2>(codes, scales, rows(xs));
            [widen(a), widen(b)]
        }
        _ => {
            let [a, b] = pairs_tile::<3>(codes, scales, rows(xs));
            [widen(a), widen(b)]
        }
    };
    store_sums(lanes, out);
}

// (A loop, not `array::map`: a closure passed to it was compiled
// outside the `target_feature` code, its intrinsics as calls.)
#[inline(always)]
unsafe fn store_row_sums(lanes: [__m256; 4], out: &mut [f32; 4]) {
    for (o, v) in out.iter_mut().zip(lanes) {
        *o = sum_lanes(v);
    }
}

#[inline(always)]
unsafe fn store_sums(lanes: [[__m256; 4]; 2], out: &mut [[f32; 4]; 2]) {
    for (sums, lanes) in out.iter_mut().zip(lanes) {
        store_row_sums(lanes, sums);
    }
}

/// Two weight rows and R activation rows (2 or 3): each weight block
/// is loaded once for the R rows and each activation block once for
/// both weight rows; 2R accumulators are in flight. The even blocks
/// are summed first, then the odd ones, and the two sums added: the
/// order of `tile` and `one_row`, so that a row's products come out
/// the same to the bit whichever rows share its step.
#[inline(always)]
unsafe fn pairs_tile<const R: usize>(codes: [*const i8; 2], scales: [&[f32]; 2], xs: [Row; R]) -> [[__m256; R]; 2] {
    let blocks = scales[0].len();
    let mut sums = [[[_mm256_setzero_ps(); R]; 2]; 2];
    for (parity, acc) in sums.iter_mut().enumerate() {
        for b in (parity..blocks).step_by(2) {
            let w = [magnitudes(codes[0], b), magnitudes(codes[1], b)];
            let w_scale = [_mm256_set1_ps(*scales[0].get_unchecked(b)), _mm256_set1_ps(*scales[1].get_unchecked(b))];
            for r in 0..R {
                let x = _mm256_loadu_si256(xs[r].0.add(b * BLOCK) as *const __m256i);
                let x_scale = _mm256_set1_ps(*xs[r].1.add(b));
                for c in 0..2 {
                    let scale = _mm256_mul_ps(w_scale[c], x_scale);
                    let product = byte_dot(w[c].0, _mm256_sign_epi8(x, w[c].1));
                    acc[c][r] = _mm256_fmadd_ps(scale, product, acc[c][r]);
                }
            }
        }
    }
    let [even, odd] = sums;
    std::array::from_fn(|c| std::array::from_fn(|r| _mm256_add_ps(even[c][r], odd[c][r])))
}

/// `pairs_tile` for four activation rows, in assembly: two weight rows
/// (their codes and scales), the even blocks summed and then the odd
/// ones, with the same operations in the same order as `tile`, so the
/// same bits. LLVM's version of this loop keeps more values live than
/// AVX2's 16 vector registers and spilled accumulators every block;
/// here the eight accumulators, the two weight blocks, their scales,
/// an activation block and its scale fill the 16 exactly. Measured on
/// one thread: 3.24 -> 2.65 cycles per 32 products at k = 1,536; the
/// vocabulary projection 1.13-1.17x.
/// The slices and rows hold `scales[0].len()` blocks each.
#[inline(always)]
unsafe fn four_rows(codes: [*const i8; 2], scales: [&[f32]; 2], xs: [Row; 4]) -> [[__m256; 4]; 2] {
    let zeros = [[_mm256_setzero_ps(); 4]; 2];
    let odd = four_rows_pass(codes, scales, xs, 1, zeros);
    let even = four_rows_pass(codes, scales, xs, 0, zeros);
    std::array::from_fn(|c| std::array::from_fn(|r| _mm256_add_ps(even[c][r], odd[c][r])))
}

// Pieces of `four_rows_pass`'s loop. {i} is the byte offset of the
// block's scale (4 per block), so [p + {i}*8] is a block of 32 codes.

/// Q8_0 block of row `w` into ymm`dst` as magnitudes (maddubs wants an
/// unsigned left side; `signed` moves the signs onto the activations).
#[rustfmt::skip]
macro_rules! magnitudes {
    ($dst:literal, $w:literal) => {
        concat!(
            "vmovdqu ymm", $dst, ", ymmword ptr [{", $w, "} + {i}*8]\n",
            "vpsignb ymm", $dst, ", ymm", $dst, ", ymm", $dst, "\n",
        )
    };
}

/// Block scales of both weight rows into ymm10 and ymm11.
macro_rules! weight_scales {
    () => {
        concat!("vbroadcastss ymm10, dword ptr [{w0s} + {i}]\n", "vbroadcastss ymm11, dword ptr [{w1s} + {i}]\n")
    };
}

/// Activation row `x`'s block into ymm12, its scale into ymm13.
#[rustfmt::skip]
macro_rules! activations {
    ($x:literal, $s:literal) => {
        concat!(
            "vmovdqu ymm12, ymmword ptr [{", $x, "} + {i}*8]\n",
            "vbroadcastss ymm13, dword ptr [{", $s, "} + {i}]\n",
        )
    };
}

/// The activation block with weight row `w`'s signs, into ymm14.
macro_rules! signed {
    ($w:literal) => {
        concat!("vpsignb ymm14, ymm12, ymmword ptr [{", $w, "} + {i}*8]\n")
    };
}

/// ymm`acc` += (weight scale * activation scale) * the 32 byte
/// products of ymm`w` and ymm14, summed to eight lanes.
#[rustfmt::skip]
macro_rules! product {
    ($acc:literal, $w:literal, $scale:literal) => {
        concat!(
            "vpmaddubsw ymm14, ymm", $w, ", ymm14\n",
            "vpmaddwd ymm14, ymm14, ymmword ptr [rip + {ones}]\n",
            "vcvtdq2ps ymm14, ymm14\n",
            "vmulps ymm15, ymm", $scale, ", ymm13\n",
            "vfmadd231ps ymm", $acc, ", ymm15, ymm14\n",
        )
    };
}

/// Activation row r (x`r`, s`r`) against both weight rows; its
/// accumulators are ymm`acc0` and ymm`acc1`.
#[rustfmt::skip]
macro_rules! row {
    ($x:literal, $s:literal, $acc0:literal, $acc1:literal) => {
        concat!(
            activations!($x, $s),
            signed!("w0"),
            product!($acc0, 8, 10),
            signed!("w1"),
            product!($acc1, 9, 11),
        )
    };
}

/// A pass of the assembly loops over blocks parity, parity + 2, ...:
/// every pointer goes to just past its last block and {i} counts up
/// from -8 * steps to 0, so one register is both the offset and the
/// loop's test.
struct Pass {
    steps: usize,
    end: usize,
}

impl Pass {
    /// None when the pass has no block.
    fn new(blocks: usize, parity: usize) -> Option<Pass> {
        let steps = blocks.checked_sub(parity)?.div_ceil(2);
        (steps > 0).then_some(Pass { steps, end: parity + 2 * steps })
    }

    fn past<T>(&self, p: *const T, block_bytes: usize) -> usize {
        (p as *const u8).wrapping_add(self.end * block_bytes) as usize
    }

    /// The two weight rows' codes and scales, past the pass.
    fn weights(&self, codes: [*const i8; 2], scales: [&[f32]; 2]) -> ([usize; 2], [usize; 2]) {
        (codes.map(|p| self.past(p, BLOCK)), scales.map(|s| self.past(s.as_ptr(), 4)))
    }
}

/// The loop of a `Pass` over `steps` pairs of blocks: `blocks` is the
/// body's template, the operands after it the activations' and the
/// accumulators'; ymm8-15 are the body's scratch.
macro_rules! block_loop {
    ($steps:expr, $w:expr, $ws:expr, $blocks:expr, $($operands:tt)*) => {
        std::arch::asm!(
            concat!("2:\n", $blocks, "add {i}, 8\n", "jnz 2b\n"),
            i = inout(reg) -8 * $steps as isize => _,
            w0 = in(reg) $w[0], w1 = in(reg) $w[1], w0s = in(reg) $ws[0], w1s = in(reg) $ws[1],
            ones = sym ONE_WORDS,
            $($operands)*
            out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
            out("ymm12") _, out("ymm13") _, out("ymm14") _, out("ymm15") _,
            options(pure, readonly, nostack),
        )
    };
}

/// Blocks `parity`, `parity` + 2, ... of `four_rows`, added onto `acc`
/// (acc[c][r]: weight row c with activation row r).
#[target_feature(enable = "avx2,fma")]
unsafe fn four_rows_pass(
    codes: [*const i8; 2],
    scales: [&[f32]; 2],
    xs: [Row; 4],
    parity: usize,
    acc: [[__m256; 4]; 2],
) -> [[__m256; 4]; 2] {
    let Some(pass) = Pass::new(scales[0].len(), parity) else {
        return acc;
    };
    let (w, ws) = pass.weights(codes, scales);
    let x = xs.map(|(codes, _)| pass.past(codes, BLOCK));
    let s = xs.map(|(_, scales)| pass.past(scales, 4));
    let [[mut a0, mut a1, mut a2, mut a3], [mut a4, mut a5, mut a6, mut a7]] = acc;
    // SAFETY (the loop's reads): offsets -8 * steps .. 0 from the
    // pointers past block `end - 1` reach blocks parity, parity + 2,
    // ..., end - 2, all inside the rows four_rows's caller passes.
    block_loop!(
        pass.steps, w, ws,
        concat!(
            magnitudes!(8, "w0"),
            magnitudes!(9, "w1"),
            weight_scales!(),
            row!("x0", "s0", 0, 4),
            row!("x1", "s1", 1, 5),
            row!("x2", "s2", 2, 6),
            row!("x3", "s3", 3, 7),
        ),
        x0 = in(reg) x[0], x1 = in(reg) x[1], x2 = in(reg) x[2], x3 = in(reg) x[3],
        s0 = in(reg) s[0], s1 = in(reg) s[1], s2 = in(reg) s[2], s3 = in(reg) s[3],
        inout("ymm0") a0, inout("ymm1") a1, inout("ymm2") a2, inout("ymm3") a3,
        inout("ymm4") a4, inout("ymm5") a5, inout("ymm6") a6, inout("ymm7") a7,
    );
    [[a0, a1, a2, a3], [a4, a5, a6, a7]]
}

/// Two weight rows against one activation row in assembly, with
/// `four_rows_pass`'s loop: the even blocks summed, then the odd ones,
/// bit-identical to `tile`. Against LLVM's loop for the same tile: the
/// vocabulary projection 1.48x at batch 1.
#[inline(always)]
unsafe fn one_row(codes: [*const i8; 2], scales: [&[f32]; 2], x: Row) -> [__m256; 2] {
    let zeros = [_mm256_setzero_ps(); 2];
    let [even0, even1] = one_row_pass(codes, scales, x, 0, zeros);
    let [odd0, odd1] = one_row_pass(codes, scales, x, 1, zeros);
    [_mm256_add_ps(even0, odd0), _mm256_add_ps(even1, odd1)]
}

/// Blocks `parity`, `parity` + 2, ... of `one_row`, added onto `acc`
/// (one accumulator per weight row), with `four_rows_pass`'s loop.
#[target_feature(enable = "avx2,fma")]
unsafe fn one_row_pass(
    codes: [*const i8; 2],
    scales: [&[f32]; 2],
    x: Row,
    parity: usize,
    acc: [__m256; 2],
) -> [__m256; 2] {
    let Some(pass) = Pass::new(scales[0].len(), parity) else {
        return acc;
    };
    let (w, ws) = pass.weights(codes, scales);
    let (x0, s0) = (pass.past(x.0, BLOCK), pass.past(x.1, 4));
    let [mut a0, mut a1] = acc;
    // SAFETY: as in four_rows_pass.
    block_loop!(
        pass.steps, w, ws,
        concat!(magnitudes!(8, "w0"), magnitudes!(9, "w1"), weight_scales!(), row!("x0", "s0", 0, 1)),
        x0 = in(reg) x0, s0 = in(reg) s0,
        inout("ymm0") a0, inout("ymm1") a1,
    );
    [a0, a1]
}

#[repr(align(32))]
struct Aligned<T>(T);
static ONE_WORDS: Aligned<[i16; 16]> = Aligned([1; 16]);

/// out[i] = the scaled code dot products of one Q8_0 row with xs[i].
///
/// # Safety
/// As for `dot_pair`, with one weight row of `scales.len()` blocks.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot(codes: &[i8], scales: &[f32], xs: &[ActivationRow], out: &mut [f32; 4]) {
    let codes = codes.as_ptr();
    let lanes = match xs.len() {
        1 => widen(tile::<1>(codes, scales, rows(xs))),
        2 => widen(tile::<2>(codes, scales, rows(xs))),
        3 => widen(tile::<3>(codes, scales, rows(xs))),
        _ => tile::<4>(codes, scales, rows(xs)),
    };
    store_row_sums(lanes, out);
}

#[inline(always)]
unsafe fn widen<const R: usize>(lanes: [__m256; R]) -> [__m256; 4] {
    std::array::from_fn(|r| if r < R { lanes[r] } else { _mm256_setzero_ps() })
}

/// The dot products of one weight row with R activation rows, blocks
/// in pairs: two accumulators per row hide the latency of the FMA
/// chain.
#[inline(always)]
unsafe fn tile<const R: usize>(codes: *const i8, scales: &[f32], xs: [Row; R]) -> [__m256; R] {
    let blocks = scales.len();
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    let mut b = 0;
    while b < blocks {
        for (half, acc_index) in [(b, 0), (b + 1, 1)] {
            if half == blocks {
                break;
            }
            let (w, sign) = magnitudes(codes, half);
            for r in 0..R {
                let x = _mm256_loadu_si256(xs[r].0.add(half * BLOCK) as *const __m256i);
                let scale = _mm256_set1_ps(scales[half] * *xs[r].1.add(half));
                let product = byte_dot(w, _mm256_sign_epi8(x, sign));
                acc[r][acc_index] = _mm256_fmadd_ps(scale, product, acc[r][acc_index]);
            }
        }
        b += 2;
    }
    std::array::from_fn(|r| _mm256_add_ps(acc[r][0], acc[r][1]))
}
