//! What the kernels share: activations rounded to 8 bits per block
//! (`activations`), the AVX2 helpers several kernels use (`avx2`: lane
//! sums, an 8 x 8 transpose, e^x), the CPU check that picks those paths,
//! and a dot product the compiler vectorizes. The bottom of the kernels'
//! imports: it uses none of them.

pub mod activations;
#[cfg(target_arch = "x86_64")]
pub mod avx2;

pub use activations::{QuantizedRows, BLOCK};

/// Whether this CPU runs the AVX2 and FMA paths (else plain loops compute
/// the same sums).
#[cfg(target_arch = "x86_64")]
pub fn avx2() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
}

/// Whether this CPU also has AVX-512 VNNI on 256-bit vectors (`vpdpbusd`:
/// 32 byte products summed into eight 32-bit lanes in one instruction),
/// which block_gemm's products use beside the AVX2 path.
#[cfg(target_arch = "x86_64")]
pub fn vnni() -> bool {
    avx2() && is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl")
}

/// sum a[i] * b[i] in eight independent lanes, which the compiler vectorizes.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = a8.remainder().iter().zip(b8.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in a8.zip(b8) {
        for i in 0..8 {
            lanes[i] += x[i] * y[i];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// For a test that compares the AVX2 path with the plain loops (or checks
/// the AVX2 path alone): on a CPU without AVX2 and FMA both sides would be
/// the plain loops and a pass would compare them with themselves. libtest
/// cannot mark a test ignored at run time, so there such a test fails,
/// saying why, rather than pass having checked nothing. Every such test has
/// `avx2` in its path: `cargo test -- --skip avx2` leaves them out there,
/// and the run counts them as filtered out.
#[cfg(all(test, target_arch = "x86_64"))]
pub(crate) fn require_avx2() {
    assert!(avx2(), "not run: this CPU has no AVX2 and FMA, so there is no AVX2 path to check (--skip avx2)");
}

/// A small deterministic generator of values in -1..=1, so the kernels'
/// tests need no crate.
#[cfg(test)]
pub(crate) fn test_values(count: usize, seed: u32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(2654435761).wrapping_add(1);
    (0..count)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            (state % 2001) as f32 / 1000.0 - 1.0
        })
        .collect()
}
