//! Attention of a prefill chunk's new tokens over their sequence (its
//! cached prefix and the chunk itself), read from the paged KV cache by
//! slot, in float32 on the CPU: a chat's next turn, a shared system
//! prompt's question.
//!
//! torch's CPU flash attention needs the sequence's k and v gathered into
//! contiguous tensors first and multiplies 32-query blocks through MKL
//! calls that pack their operands each time. Here a task takes 16 new
//! tokens and one KV head, whose group of query heads makes up to 48
//! query rows (with 3 heads a group), and walks the keys in tiles of 64 slots: the tile's k read
//! from the cache and transposed 8 x 8 at a time, its scores in register
//! blocks (4 rows x 16 keys), the softmax kept online (running max and
//! sum per row), then the weighted v (4 rows x 16 values).
//!
//! Query token t of T new ones sees the sequence's first L - T + t + 1
//! slots (L slots in all, the new tokens' last): causal over the chunk.

use crate::kernels::simd;
use crate::kernels::spin_pool::{SharedPtr, SpinPool};

/// New tokens per task.
const TOKENS_PER_TASK: usize = 16;
/// Keys multiplied together.
const KEY_TILE: usize = 64;

/// One sequence's new tokens and its cache.
pub struct Extend<'a> {
    /// Queries [tokens, heads * head_dim].
    pub q: &'a [f32],
    /// A layer's k and v cache, [cache slots, kv_heads * head_dim] each.
    pub k: &'a [f32],
    pub v: &'a [f32],
    /// The sequence's slots in order, the new tokens' last.
    pub slots: &'a [i64],
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
}

impl Extend<'_> {
    fn tokens(&self) -> usize {
        self.q.len() / (self.heads * self.head_dim)
    }

    /// Slots that new token `t` sees.
    fn visible(&self, t: usize) -> usize {
        self.slots.len() - self.tokens() + t + 1
    }

    /// Whether the sizes fit together and every slot lies inside the cache:
    /// what `attend`'s unchecked reads rely on.
    pub fn check(&self) -> Result<(), String> {
        if self.heads == 0 || self.kv_heads == 0 || self.head_dim == 0 || self.heads % self.kv_heads != 0 {
            return Err(format!("{} query heads do not share {} KV heads evenly", self.heads, self.kv_heads));
        }
        let (kv_width, tokens) = (self.kv_heads * self.head_dim, self.tokens());
        if self.q.len() != tokens * self.heads * self.head_dim || tokens == 0 || tokens > self.slots.len() {
            return Err(format!("{tokens} new tokens over {} slots", self.slots.len()));
        }
        if self.k.len() != self.v.len() || self.k.len() % kv_width != 0 {
            return Err("the k and v caches are not alike, [cache slots, kv_heads * head_dim]".into());
        }
        let cache_slots = (self.k.len() / kv_width) as u64;
        if !self.slots.iter().all(|&s| (s as u64) < cache_slots) {
            return Err("a slot past the cache".into());
        }
        Ok(())
    }
}

/// out [tokens, heads * head_dim] = each new token's attention, tasks split
/// among `parts` threads of `pool`; nothing is written unless `e` passes
/// `Extend::check` and `out` is q's size: else the misfit.
pub fn attend(pool: &SpinPool, parts: usize, e: &Extend, out: &mut [f32]) -> Result<(), String> {
    e.check()?;
    if out.len() != e.q.len() {
        return Err(format!("out holds {} values, q {}", out.len(), e.q.len()));
    }
    #[cfg(target_arch = "x86_64")]
    if e.head_dim % 8 == 0 && simd::avx2() {
        let per_task = tokens_per_task(e.tokens(), e.kv_heads, parts.clamp(1, pool.threads()));
        let blocks = e.tokens().div_ceil(per_task);
        let tasks = blocks * e.kv_heads;
        let out_ptr = SharedPtr(out.as_mut_ptr());
        let parts = parts.clamp(1, pool.threads()).min(tasks.max(1));
        pool.run(parts, &|part| {
            let mut scratch = avx2::Scratch::new(e);
            for task in tasks * part / parts..tasks * (part + 1) / parts {
                let (kv_head, block) = (task % e.kv_heads, task / e.kv_heads);
                let first = block * per_task;
                let tokens = first..e.tokens().min(first + per_task);
                // The keys walked: those the last token of the task's
                // TOKENS_PER_TASK block sees (all of a split extend's
                // tasks walk the same tiles, each row's sums as unsplit).
                let seen = e.visible(if per_task < TOKENS_PER_TASK { e.tokens() } else { tokens.end } - 1);
                // SAFETY: the CPU has AVX2; each task writes only its own
                // tokens' heads of `out`.
                unsafe { scratch.attend(e, kv_head, tokens, seen, out_ptr.get()) };
            }
        });
        return Ok(());
    }
    plain(e, out);
    Ok(())
}

/// New tokens per task: TOKENS_PER_TASK, or fewer for an extend of one
/// task's tokens or less (a short chunk after a cached prefix) whose KV
/// heads alone make fewer than two tasks a thread: one task per KV head
/// left 3 heads uneven on 2 threads.
fn tokens_per_task(tokens: usize, kv_heads: usize, parts: usize) -> usize {
    if tokens > TOKENS_PER_TASK || kv_heads >= 2 * parts {
        return TOKENS_PER_TASK;
    }
    // At most one task per 4 tokens (rounded up): a task's query rows fill 4-row register blocks.
    let blocks = (2 * parts).div_ceil(kv_heads).min(tokens.div_ceil(4));
    tokens.div_ceil(blocks.max(1))
}

/// `attend` as plain loops: one query row at a time, the whole softmax at
/// once. The path without AVX2, and the tests' reference.
fn plain(e: &Extend, out: &mut [f32]) {
    let (d, group, kv_width) = (e.head_dim, e.heads / e.kv_heads, e.kv_heads * e.head_dim);
    let mut scores = Vec::new();
    for t in 0..e.tokens() {
        for h in 0..e.heads {
            let q = &e.q[(t * e.heads + h) * d..][..d];
            let at = |s: i64| s as usize * kv_width + (h / group) * d;
            let seen = &e.slots[..e.visible(t)];
            scores.clear();
            scores.extend(
                seen.iter().map(|&s| q.iter().zip(&e.k[at(s)..][..d]).map(|(a, b)| a * b).sum::<f32>() * e.scale),
            );
            let max = scores.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            let total: f32 = scores
                .iter_mut()
                .map(|x| {
                    *x = (*x - max).exp();
                    *x
                })
                .sum();
            let o = &mut out[(t * e.heads + h) * d..][..d];
            o.fill(0.0);
            for (&s, &w) in seen.iter().zip(&scores) {
                o.iter_mut().zip(&e.v[at(s)..][..d]).for_each(|(o, v)| *o += w / total * v);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Extend, KEY_TILE, TOKENS_PER_TASK};
    use crate::kernels::simd::avx2::{exponentials, transpose};
    use std::arch::x86_64::*;
    use std::ops::Range;

    /// A task's buffers, reused by the thread's tasks: rows are (token,
    /// query head of the group), padded to a multiple of 4.
    pub struct Scratch {
        q: Vec<f32>,      // [rows, d], scaled
        k: Vec<f32>,      // [d, KEY_TILE]: the tile's k transposed, zeros past its keys
        v: Vec<f32>,      // [KEY_TILE, d]
        scores: Vec<f32>, // [rows, KEY_TILE], then the tile's weights
        o: Vec<f32>,      // [rows, d], unnormalized
        max: Vec<f32>,
        total: Vec<f32>,
    }

    impl Scratch {
        pub fn new(e: &Extend) -> Scratch {
            let rows = TOKENS_PER_TASK * e.heads / e.kv_heads + 3;
            let d = e.head_dim;
            Scratch {
                q: vec![0.0; rows * d],
                k: vec![0.0; d * KEY_TILE],
                v: vec![0.0; KEY_TILE * d],
                scores: vec![0.0; rows * KEY_TILE],
                o: vec![0.0; rows * d],
                max: vec![0.0; rows],
                total: vec![0.0; rows],
            }
        }

        /// The attention of `tokens`' query heads of `kv_head`'s group over
        /// the first `seen` slots (each token's own visible ones), into
        /// their places in `out`.
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn attend(&mut self, e: &Extend, kv_head: usize, tokens: Range<usize>, seen: usize, out: *mut f32) {
            let (d, group) = (e.head_dim, e.heads / e.kv_heads);
            let rows = tokens.len() * group;
            let padded = rows.div_ceil(4) * 4;
            // Row r is token tokens.start + r / group, head kv_head * group + r % group.
            let head = |r: usize| (tokens.start + r / group) * e.heads + kv_head * group + r % group;
            self.q[..padded * d].fill(0.0);
            for r in 0..rows {
                for (q, x) in self.q[r * d..][..d].iter_mut().zip(&e.q[head(r) * d..][..d]) {
                    *q = x * e.scale;
                }
            }
            self.o[..padded * d].fill(0.0);
            self.max[..rows].fill(f32::NEG_INFINITY);
            self.total[..rows].fill(0.0);
            for start in (0..seen).step_by(KEY_TILE) {
                let keys = KEY_TILE.min(seen - start);
                self.load_tile(e, kv_head, &e.slots[start..start + keys]);
                self.k_products(padded, d);
                for r in 0..rows {
                    let scores = &mut self.scores[r * KEY_TILE..][..keys];
                    // Keys past what this row's token sees weigh nothing.
                    let sees = e.visible(tokens.start + r / group).saturating_sub(start).min(keys);
                    if sees == 0 {
                        scores.fill(0.0);
                        continue;
                    }
                    scores[sees..].fill(f32::NEG_INFINITY);
                    let tile_max = scores[..sees].iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
                    let max = self.max[r].max(tile_max);
                    let rescale = (self.max[r] - max).exp();
                    self.total[r] = self.total[r] * rescale + exponentials(scores, max);
                    self.max[r] = max;
                    if rescale != 1.0 {
                        self.o[r * d..][..d].iter_mut().for_each(|o| *o *= rescale);
                    }
                }
                self.v_products(padded, d, keys);
            }
            for r in 0..rows {
                let inverse = 1.0 / self.total[r];
                let o = std::slice::from_raw_parts_mut(out.add(head(r) * d), d);
                o.iter_mut().zip(&self.o[r * d..][..d]).for_each(|(o, x)| *o = x * inverse);
            }
        }

        /// The k and v of `slots` (at most a tile) for `kv_head`, k transposed.
        #[target_feature(enable = "avx2,fma")]
        unsafe fn load_tile(&mut self, e: &Extend, kv_head: usize, slots: &[i64]) {
            let (d, kv_width) = (e.head_dim, e.kv_heads * e.head_dim);
            let at = |j: usize| slots.get(j).map(|&s| s as usize * kv_width + kv_head * d);
            for j in (0..KEY_TILE).step_by(8) {
                for i in (0..d).step_by(8) {
                    let rows: [__m256; 8] = std::array::from_fn(|x| match at(j + x) {
                        Some(row) => _mm256_loadu_ps(e.k.as_ptr().add(row + i)),
                        None => _mm256_setzero_ps(),
                    });
                    for (x, column) in transpose(rows).into_iter().enumerate() {
                        _mm256_storeu_ps(self.k.as_mut_ptr().add((i + x) * KEY_TILE + j), column);
                    }
                }
            }
            for (j, &s) in slots.iter().enumerate() {
                let row = s as usize * kv_width + kv_head * d;
                self.v[j * d..][..d].copy_from_slice(&e.v[row..][..d]);
            }
        }

        /// scores[rows, KEY_TILE] = q . the tile's k, 4 rows x 16 keys at a time.
        #[target_feature(enable = "avx2,fma")]
        unsafe fn k_products(&mut self, padded: usize, d: usize) {
            let (q, k, scores) = (self.q.as_ptr(), self.k.as_ptr(), self.scores.as_mut_ptr());
            for r in (0..padded).step_by(4) {
                for c in (0..KEY_TILE).step_by(16) {
                    let mut acc = [[_mm256_setzero_ps(); 2]; 4];
                    for i in 0..d {
                        let keys =
                            [_mm256_loadu_ps(k.add(i * KEY_TILE + c)), _mm256_loadu_ps(k.add(i * KEY_TILE + c + 8))];
                        for (row, acc) in acc.iter_mut().enumerate() {
                            let x = _mm256_set1_ps(*q.add((r + row) * d + i));
                            acc[0] = _mm256_fmadd_ps(x, keys[0], acc[0]);
                            acc[1] = _mm256_fmadd_ps(x, keys[1], acc[1]);
                        }
                    }
                    for (row, acc) in acc.iter().enumerate() {
                        let at = scores.add((r + row) * KEY_TILE + c);
                        _mm256_storeu_ps(at, acc[0]);
                        _mm256_storeu_ps(at.add(8), acc[1]);
                    }
                }
            }
        }

        /// o[rows, d] += the tile's weights . its v (`keys` rows), 4 rows x
        /// 16 values at a time.
        #[target_feature(enable = "avx2,fma")]
        unsafe fn v_products(&mut self, padded: usize, d: usize, keys: usize) {
            let (weights, v, o) = (self.scores.as_ptr(), self.v.as_ptr(), self.o.as_mut_ptr());
            for r in (0..padded).step_by(4) {
                for c in (0..d).step_by(16) {
                    let wide = c + 16 <= d; // head_dim 8 * odd ends on one vector
                    let mut acc = [[_mm256_setzero_ps(); 2]; 4];
                    for (row, acc) in acc.iter_mut().enumerate() {
                        acc[0] = _mm256_loadu_ps(o.add((r + row) * d + c));
                        if wide {
                            acc[1] = _mm256_loadu_ps(o.add((r + row) * d + c + 8));
                        }
                    }
                    for j in 0..keys {
                        let values = v.add(j * d + c);
                        let values = [
                            _mm256_loadu_ps(values),
                            if wide { _mm256_loadu_ps(values.add(8)) } else { _mm256_setzero_ps() },
                        ];
                        for (row, acc) in acc.iter_mut().enumerate() {
                            let w = _mm256_set1_ps(*weights.add((r + row) * KEY_TILE + j));
                            acc[0] = _mm256_fmadd_ps(w, values[0], acc[0]);
                            acc[1] = _mm256_fmadd_ps(w, values[1], acc[1]);
                        }
                    }
                    for (row, acc) in acc.iter().enumerate() {
                        _mm256_storeu_ps(o.add((r + row) * d + c), acc[0]);
                        if wide {
                            _mm256_storeu_ps(o.add((r + row) * d + c + 8), acc[1]);
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::simd::test_values as values;

    /// Every head_dim here is a multiple of 8: `attend` takes the AVX2 tiles.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_tiles_give_the_plain_softmax() {
        simd::require_avx2();
        let pool = SpinPool::new(3);
        // (new tokens, cached prefix, heads, kv heads, head dim): a chunk
        // of one task and of several, tiles cut mid-row, a group of 3,
        // plain multi-head, head_dim 72 (a half vector at the end).
        for (tokens, prefix, heads, kv_heads, d) in
            [(45, 1300, 9, 3, 64), (5, 0, 4, 4, 32), (17, 70, 6, 2, 72), (1, 3, 2, 1, 8)]
        {
            let kv_width = kv_heads * d;
            let cache_slots = prefix + tokens + 9;
            let (k, v) = (values(cache_slots * kv_width, 1), values(cache_slots * kv_width, 2));
            let q: Vec<f32> = values(tokens * heads * d, 3).iter().map(|x| x * 4.0).collect();
            // The sequence's slots, scattered over the cache as pages are.
            let slots: Vec<i64> = (0..prefix + tokens).map(|i| ((i * 7 + 3) % cache_slots) as i64).collect();
            let e = Extend { q: &q, k: &k, v: &v, slots: &slots, heads, kv_heads, head_dim: d, scale: 0.125 };
            let (mut got, mut want) = (vec![0f32; q.len()], vec![0f32; q.len()]);
            attend(&pool, 3, &e, &mut got).unwrap();
            plain(&e, &mut want);
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() < 2e-5, "{tokens} tokens after {prefix}, d {d}: {g} vs {w}");
            }
        }
    }

    /// A short extend split into several tasks a KV head (2 threads, 3 KV
    /// heads, 7 tokens) gives each row the bits it gets
    /// on one thread, unsplit. 280 slots: the last tile's 24 keys, of
    /// which the first task's last token sees 21, would be summed in
    /// another order if that task walked only the keys it sees.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_split_short_extends_are_the_unsplit_bit_for_bit() {
        simd::require_avx2();
        assert!(tokens_per_task(7, 3, 2) < 7 && tokens_per_task(7, 3, 1) == TOKENS_PER_TASK);
        let (tokens, prefix, heads, kv_heads, d) = (7, 273, 9, 3, 64);
        let cache_slots = prefix + tokens;
        let (k, v) = (values(cache_slots * kv_heads * d, 4), values(cache_slots * kv_heads * d, 5));
        let q = values(tokens * heads * d, 6);
        let slots: Vec<i64> = (0..cache_slots as i64).rev().collect();
        let e = Extend { q: &q, k: &k, v: &v, slots: &slots, heads, kv_heads, head_dim: d, scale: 0.125 };
        let (mut split, mut whole) = (vec![0f32; q.len()], vec![0f32; q.len()]);
        attend(&SpinPool::new(2), 2, &e, &mut split).unwrap();
        attend(&SpinPool::new(1), 1, &e, &mut whole).unwrap();
        assert_eq!(split, whole);
    }

    #[test]
    fn a_token_sees_nothing_after_itself() {
        // The first new token, with no prefix, attends to itself alone.
        let (d, tokens) = (8, 3);
        let (k, v) = (values(tokens * d, 4), values(tokens * d, 5));
        let q = values(tokens * d, 6);
        let slots: Vec<i64> = (0..tokens as i64).collect();
        let e = Extend { q: &q, k: &k, v: &v, slots: &slots, heads: 1, kv_heads: 1, head_dim: d, scale: 1.0 };
        let mut out = vec![0f32; q.len()];
        attend(&SpinPool::new(1), 1, &e, &mut out).unwrap();
        for (o, x) in out[..d].iter().zip(&v[..d]) {
            assert!((o - x).abs() < 1e-6);
        }
    }

    #[test]
    fn a_slot_past_the_cache_is_refused() {
        let (k, v, q) = (vec![0f32; 16], vec![0f32; 16], vec![0f32; 8]);
        let e = Extend { q: &q, k: &k, v: &v, slots: &[0, 2], heads: 1, kv_heads: 1, head_dim: 8, scale: 1.0 };
        let mut out = vec![f32::NAN; 8];
        assert_eq!(attend(&SpinPool::new(1), 1, &e, &mut out).unwrap_err(), "a slot past the cache");
        assert!(out.iter().all(|o| o.is_nan()), "nothing written");
    }
}
