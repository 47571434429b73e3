//! Greedy sampling on the GPU.

use super::*;

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn greedy_sampling_is_the_first_argmax() {
    let Some(g) = gpu() else { return };
    for dtype in DTYPES {
        let c = Ctx::new(&g, dtype);
        let mut r = Lcg(9);
        let (rows, vocab) = (8, 151_936);
        let mut x = c.round(&r.vec(rows * vocab, 4.0));
        // Row 1: a tie for the maximum (the lower id wins); row 2: NaN and +inf.
        x[vocab + 7] = 100.0;
        x[vocab + 9000] = 100.0;
        x[2 * vocab + 5] = f32::NAN;
        x[2 * vocab + 77] = f32::INFINITY;
        // Row 3: a tie across chunks (8,192 tokens a block), met last-chunk first.
        for t in [150_000, 40_000, 20_000] {
            x[3 * vocab + t] = 100.0;
        }
        // Row 4: -0 and +0 tie as floats compare, across chunks: the first wins.
        x[4 * vocab..5 * vocab].fill(-1.0);
        x[4 * vocab + 30_000] = -0.0;
        x[4 * vocab + 100_000] = 0.0;
        // Rows 5 and 6: nothing finite (all -inf; all NaN): token 0.
        x[5 * vocab..6 * vocab].fill(f32::NEG_INFINITY);
        x[6 * vocab..7 * vocab].fill(f32::NAN);
        // Row 7: -inf but for one finite logit in the last chunk.
        x[7 * vocab..8 * vocab].fill(f32::NEG_INFINITY);
        x[7 * vocab + 151_000] = -3.0;
        // Plain greedy rows: no logits-processor entries, no logprobs.
        let params = vec![SampleRowEx::plain(Default::default()); rows];
        let batch = SamplingBatch::plain(&params);
        let got = c
            .ops
            .sample_tokens_ex(&c.upload(&x), vocab, &batch, true)
            .unwrap()
            .tokens;
        for row in 0..rows {
            let rowv = &x[row * vocab..(row + 1) * vocab];
            let mut best = 0;
            for (i, &v) in rowv.iter().enumerate() {
                let v = if v.is_nan() { f32::NEG_INFINITY } else { v };
                let b = if rowv[best].is_nan() {
                    f32::NEG_INFINITY
                } else {
                    rowv[best]
                };
                if v > b {
                    best = i;
                }
            }
            assert_eq!(got[row], best as i32, "{dtype:?} row {row}");
        }
        assert_eq!(got[1], 7);
        assert_eq!(got[2], 77);
    }
}
