//! Embedding gather: one table row per token id.
//!
//! The table may be a vocabulary shard (tensor parallel, DESIGN §7): it holds rows
//! `vocab_start..vocab_start + rows`, and ids outside that range produce zeros, which the
//! all-reduce across ranks then fills in.

/// `out[t] = table[ids[t] - vocab_start]` or zeros when the id is outside the shard.
///
/// Shapes: `table` [rows, hidden], `out` [ids.len(), hidden].
pub fn embedding(ids: &[u32], table: &[f32], vocab_start: usize, hidden: usize, out: &mut [f32]) {
    let rows = table.len() / hidden;
    assert_eq!(out.len(), ids.len() * hidden, "embedding: out shape");
    for (t, &id) in ids.iter().enumerate() {
        let dst = &mut out[t * hidden..(t + 1) * hidden];
        let id = id as usize;
        if id >= vocab_start && id - vocab_start < rows {
            let r = id - vocab_start;
            dst.copy_from_slice(&table[r * hidden..(r + 1) * hidden]);
        } else {
            dst.fill(0.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gathers_rows_and_zeros_outside_the_shard() {
        let table = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]; // 3 rows of 2, ids 10..13
        let mut out = [f32::NAN; 6];
        embedding(&[12, 9, 10], &table, 10, 2, &mut out);
        assert_eq!(out, [5.0, 6.0, 0.0, 0.0, 1.0, 2.0]);
    }
}
