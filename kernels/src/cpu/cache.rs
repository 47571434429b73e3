//! `reshape_and_cache`: writes each new token's K and V into the paged KV cache.
//!
//! Cache layout per layer: [num_blocks, block_size, num_kv_heads, head_dim], so a slot
//! (`block_id * block_size + offset`) addresses one contiguous [num_kv_heads, head_dim]
//! row. A negative slot marks a padding token and is skipped, as in vLLM.

/// Shapes: `key`, `value` [T, num_kv_heads, head_dim], `slot_mapping` [T], caches
/// [num_blocks * block_size, num_kv_heads * head_dim] flattened.
pub fn reshape_and_cache(
    key: &[f32],
    value: &[f32],
    key_cache: &mut [f32],
    value_cache: &mut [f32],
    slot_mapping: &[i32],
    kv_row: usize,
) {
    let t = slot_mapping.len();
    assert_eq!(key.len(), t * kv_row, "reshape_and_cache: key shape");
    assert_eq!(value.len(), t * kv_row, "reshape_and_cache: value shape");
    assert_eq!(
        key_cache.len(),
        value_cache.len(),
        "reshape_and_cache: cache shapes"
    );
    let num_slots = key_cache.len() / kv_row;
    for (i, &slot) in slot_mapping.iter().enumerate() {
        if slot < 0 {
            continue;
        }
        let s = slot as usize;
        assert!(
            s < num_slots,
            "reshape_and_cache: slot {s} out of {num_slots}"
        );
        key_cache[s * kv_row..(s + 1) * kv_row].copy_from_slice(&key[i * kv_row..(i + 1) * kv_row]);
        value_cache[s * kv_row..(s + 1) * kv_row]
            .copy_from_slice(&value[i * kv_row..(i + 1) * kv_row]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_rows_at_their_slots_and_skips_padding() {
        let mut kc = vec![f32::NAN; 4 * 2];
        let mut vc = vec![f32::NAN; 4 * 2];
        reshape_and_cache(
            &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
            &[-1.0, -2.0, -3.0, -4.0, 9.0, 9.0],
            &mut kc,
            &mut vc,
            &[3, 0, -1],
            2,
        );
        assert_eq!(&kc[6..8], &[1.0, 2.0]);
        assert_eq!(&kc[0..2], &[3.0, 4.0]);
        assert_eq!(&vc[6..8], &[-1.0, -2.0]);
        assert!(kc[2].is_nan() && kc[4].is_nan());
    }
}
