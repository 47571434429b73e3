//! The exponential race: how a plain temperature row (no min-p, top-k or top-p) draws its
//! token in one pass, as vLLM's sampler does (`probs / q` with q ~ Exp(1), then argmax).
//! The token is the argmax over t of `y_t − ln E_t`, y the scaled logits and E_t an Exp(1)
//! variate of the token: that picks t with probability softmax(y)_t (the Gumbel-max
//! trick), with no maximum, normaliser or second pass, so the GPU draws a row in one pass
//! over it (sampling.cu's `race_*`, sampling_fast.cu's `block_chunk_race`).
//!
//! The variates are a pure function of the row's uniform (whose 53 bits key the hashes)
//! and the token id, computed in f32 with every operation rounded on its own and a
//! polynomial logarithm, so the CPU and the GPU get the same bits. Each E_t is
//! `−ln(1 − W_t)`, W_t uniform in (0, 1): its top byte B_t comes from one hash word per 4
//! tokens, its low bits from a second hash. B_t bounds the noise `−ln E_t` cheaply:
//! - B_t ≥ 1 means W_t ≥ 2^-8, so E_t ≥ 2^-8 and `−ln E_t` ≤ 5.55 ([`NOISE_BOUND`]);
//! - B_t = 0 (the tail) still has W_t ≥ 2^-32, so `−ln E_t` ≤ 22.19 ([`TAIL_NOISE_BOUND`]).
//!
//! A token whose y plus its bound cannot reach the best score found so far is passed over
//! without its logarithms, which spares the GPU kernel nearly all of them; the result is
//! the same token (`race_unpruned` in the tests checks it).

/// Above `−ln E_t` of every token whose top byte is not 0, with room for rounding.
pub const NOISE_BOUND: f32 = 5.6;
/// Above `−ln E_t` of every token.
pub const TAIL_NOISE_BOUND: f32 = 22.3;

/// The hash keys of one row's draw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RaceKey {
    k0: u32,
    k1: u32,
}

impl RaceKey {
    /// The key of a row whose uniform is `uniform` (53 random bits in [0, 1), as
    /// `seeded_uniform` and the sampler's own stream give them).
    pub fn of_uniform(uniform: f64) -> Self {
        let k = super::sampler::mix64((uniform * (1u64 << 53) as f64) as u64);
        Self {
            k0: k as u32,
            k1: (k >> 32) as u32,
        }
    }

    /// The hash word of tokens 4j..4j+4: byte `t % 4` is token t's top byte B_t. One
    /// round of mixing, keyed twice (an xor and an odd multiplier), so that two rows' words
    /// are not one sequence shifted or relabelled unless both keys line up.
    pub fn coarse_word(self, j: u32) -> u32 {
        mix32((j ^ self.k0).wrapping_mul(self.k1 | 1))
    }

    /// The low bits of token t's W_t.
    fn fine_word(self, t: u32) -> u32 {
        mix32((t ^ self.k1).wrapping_mul(self.k0 | 1))
    }

    /// ln E_t of token t, whose top byte is `byte` (of [`Self::coarse_word`]).
    pub fn ln_exponential(self, t: u32, byte: u32) -> f32 {
        let fine = self.fine_word(t);
        // Both exact in f32: at most 23 bits, plus a half.
        let w = if byte == 0 {
            ((fine >> 9) as f32 + 0.5) * (1.0 / (1u64 << 31) as f32)
        } else {
            (((byte << 15) | (fine >> 17)) as f32 + 0.5) * (1.0 / (1u32 << 23) as f32)
        };
        ln(-ln_1p_neg(w))
    }

    /// The race's score of token t with scaled logit y.
    pub fn score(self, t: u32, y: f32, byte: u32) -> f32 {
        y - self.ln_exponential(t, byte)
    }
}

/// Byte `t % 4` of a coarse word.
pub fn byte_of(word: u32, t: u32) -> u32 {
    (word >> (8 * (t & 3))) & 0xff
}

/// The lowest y a token whose noise is at most `bound` needs to possibly beat the score
/// `best`: below it, the token's score is below `best` even after rounding (the slack of
/// |best|·2^-16 covers the rounding of these subtractions and of the score itself).
pub fn score_floor(best: f32, bound: f32) -> f32 {
    (best - bound) - best.abs() * (1.0 / 65536.0)
}

/// The winner of the race over `y` (scaled, sanitised logits; −inf never wins), ties to the
/// lowest id; None when no y is finite.
pub fn race_token(y: &[f32], key: RaceKey) -> Option<u32> {
    let mut best = f32::NEG_INFINITY;
    let mut best_id = None;
    for (j, quad) in y.chunks(4).enumerate() {
        let word = key.coarse_word(j as u32);
        for (i, &yt) in quad.iter().enumerate() {
            let t = (4 * j + i) as u32;
            let byte = byte_of(word, t);
            let bound = if byte == 0 {
                TAIL_NOISE_BOUND
            } else {
                NOISE_BOUND
            };
            if yt == f32::NEG_INFINITY || (best_id.is_some() && yt < score_floor(best, bound)) {
                continue;
            }
            let s = key.score(t, yt, byte);
            if best_id.is_none() || s > best {
                best = s;
                best_id = Some(t);
            }
        }
    }
    best_id
}

/// lowbias32 (Chris Wellons' 32-bit integer hash): a bijective avalanche mix.
fn mix32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

/// ln(1 + f) + e·ln 2 for f in [√½ − 1, √2 − 1): Cephes' `logf` (relative error ~1e-7),
/// every operation rounded on its own, in this order, as the GPU computes it.
fn ln_core(f: f32, e: f32) -> f32 {
    let z = f * f;
    let mut p = 7.037_683_6e-2_f32;
    for c in [
        -1.151_461e-1_f32,
        1.167_699_9e-1,
        -1.242_014_1e-1,
        1.424_932_3e-1,
        -1.666_805_8e-1,
        2.000_071_5e-1,
        -2.499_999_4e-1,
        3.333_333e-1,
    ] {
        p = p * f + c;
    }
    let mut y = p * f * z;
    y += -2.121_944_4e-4 * e;
    y += -0.5 * z;
    let r = f + y;
    r + 0.693_359_4 * e
}

/// ln x of a positive, normal, finite x.
fn ln(x: f32) -> f32 {
    let bits = x.to_bits();
    let mut e = (bits >> 23) as i32 - 127;
    let mut m = (bits & 0x007f_ffff) | 0x3f80_0000; // x = m · 2^e, m in [1, 2)
    if m > 0x3fb5_04f3 {
        // m > √2: halve it, so that m − 1 lies in [√½ − 1, √2 − 1)
        m -= 0x0080_0000;
        e += 1;
    }
    ln_core(f32::from_bits(m) - 1.0, e as f32)
}

/// ln(1 − w) for w in (0, 1): the core directly while 1 − w ≥ √½, so that a small w keeps
/// its relative precision (the race's tail), else ln of the rounded 1 − w.
fn ln_1p_neg(w: f32) -> f32 {
    if w <= 0.292_893_2 {
        ln_core(-w, 0.0)
    } else {
        ln(1.0 - w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The race without pruning: every finite token's score.
    fn race_unpruned(y: &[f32], key: RaceKey) -> Option<u32> {
        let mut best: Option<(f32, u32)> = None;
        for (t, &yt) in y.iter().enumerate() {
            let t = t as u32;
            if yt == f32::NEG_INFINITY {
                continue;
            }
            let s = key.score(t, yt, byte_of(key.coarse_word(t / 4), t));
            if best.is_none_or(|(b, _)| s > b) {
                best = Some((s, t));
            }
        }
        best.map(|(_, t)| t)
    }

    #[test]
    fn ln_is_within_a_few_ulp_of_libm() {
        let mut x = 1e-12f32;
        while x < 100.0 {
            let want = f64::from(x).ln();
            let got = f64::from(ln(x));
            assert!(
                (got - want).abs() <= 3e-7 * want.abs().max(1.0),
                "ln({x}) = {got}, not {want}"
            );
            x *= 1.000_37;
        }
        for w in [
            1e-10f32,
            2.3e-10,
            1e-6,
            0.003_906_25,
            0.1,
            0.292_893_2,
            0.3,
            0.9,
            0.999_999_9,
        ] {
            let want = (-f64::from(w)).ln_1p();
            let got = f64::from(ln_1p_neg(w));
            assert!(
                (got - want).abs() <= 3e-7 * want.abs(),
                "ln(1 - {w}) = {got}, not {want}"
            );
        }
    }

    /// The noise bounds hold for every W the race can make: the bound is reached at the
    /// smallest W of each tier, and −ln E falls as W grows (checked over the tiers' edges).
    #[test]
    fn noise_never_exceeds_its_bound() {
        let key = RaceKey::of_uniform(0.25);
        for t in 0..200_000u32 {
            let byte = byte_of(key.coarse_word(t / 4), t);
            let noise = -key.ln_exponential(t, byte);
            let bound = if byte == 0 {
                TAIL_NOISE_BOUND
            } else {
                NOISE_BOUND
            };
            assert!(
                noise < bound && noise.is_finite(),
                "token {t}: noise {noise}"
            );
        }
        // The extremes: W = 2^-32 (tail) and W = 2^-8 (+ half a step), and the largest W.
        let noise = |w: f32| -ln(-ln_1p_neg(w));
        assert!(noise(2f32.powi(-32)) < TAIL_NOISE_BOUND && noise(2f32.powi(-32)) > 22.0);
        let top = noise(2f32.powi(-8) + 2f32.powi(-24));
        assert!(top < NOISE_BOUND && top > 5.5, "{top}");
        assert!(noise(1.0 - 2f32.powi(-24)).is_finite());
    }

    #[test]
    fn pruning_never_changes_the_winner() {
        let mut state = 7u64;
        let mut next = || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 40) as f32 / (1u64 << 24) as f32
        };
        for case in 0..60 {
            let n = [1, 3, 4, 5, 1000, 4099][case % 6];
            // Flat rows (ties on a coarse grid), spread rows, and rows with -inf and FLT_MAX.
            let mut y: Vec<f32> = (0..n)
                .map(|_| match case % 3 {
                    0 => (next() * 8.0).round() / 8.0,
                    1 => next() * 40.0 - 20.0,
                    _ => (next() * 4.0).round(),
                })
                .collect();
            if case % 5 == 4 {
                y[n / 2] = f32::NEG_INFINITY;
                y[n - 1] = f32::MAX;
            }
            for u in 0..20 {
                let key = RaceKey::of_uniform(f64::from(u) / 20.0 + 0.013);
                assert_eq!(
                    race_token(&y, key),
                    race_unpruned(&y, key),
                    "case {case} u {u}"
                );
            }
        }
        assert_eq!(
            race_token(&[f32::NEG_INFINITY; 5], RaceKey::of_uniform(0.5)),
            None
        );
    }

    /// Over many keys each token wins as often as softmax says, even where one token is far
    /// likelier than the rest (the tail tier decides those rows' rare tokens).
    #[test]
    fn winners_follow_softmax() {
        for y in [
            vec![1.0f32, 0.5, -0.3, 2.0, 0.0],
            vec![9.0f32, 0.0, 1.0, 0.5],
        ] {
            let lse = y.iter().map(|&v| f64::from(v).exp()).sum::<f64>().ln();
            let n = 200_000;
            let mut counts = vec![0usize; y.len()];
            for i in 0..n {
                let u = super::super::sampler::seeded_uniform(i as u64, 3);
                counts[race_token(&y, RaceKey::of_uniform(u)).unwrap() as usize] += 1;
            }
            for (c, &v) in counts.iter().zip(&y) {
                let p = (f64::from(v) - lse).exp();
                let sd = (p * (1.0 - p) / n as f64).sqrt();
                let freq = *c as f64 / n as f64;
                assert!(
                    (freq - p).abs() < 5.0 * sd + 1e-5,
                    "y {y:?}: freq {freq} vs p {p}"
                );
            }
        }
    }
}
