//! The CPU kernels of the `8da4w` layout: 4-bit Q4_1 weights (decoder
//! layers) and 8-bit Q8_0 ones (the vocabulary projection) multiplied by
//! activations rounded to 8 bits per block of 32, attention over the paged
//! KV cache, and a whole decoder layer in one call.
//!
//! Imports go one way, down this list:
//!
//! ```text
//! decode_layer ──> decode_attention, extend_attention, block_gemm
//! block_gemm, q8_0 ──> tiles
//! block_gemm, q8_0, tiles, decode_attention, extend_attention ──> simd, spin_pool
//! ```

pub mod block_gemm;
pub mod decode_attention;
pub mod decode_layer;
pub mod extend_attention;
pub mod q8_0;
pub mod simd;
pub mod spin_pool;
pub mod tiles;
