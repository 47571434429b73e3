//! Hugging Face tensor names → llama.cpp's GGUF names (`convert_hf_to_gguf.py`'s map for
//! the Llama, Qwen2 and Qwen3 decoders), and the inverse of the row permutation that
//! converter applies to Llama's q and k projections.

/// The GGUF name of the Hugging Face tensor `hf`, or None for a name with no GGUF twin.
pub fn gguf_name(hf: &str) -> Option<String> {
    let fixed = match hf {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(name) = fixed {
        return Some(name.to_string());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    layer.parse::<usize>().ok()?;
    let (module, suffix) = rest.rsplit_once('.')?;
    if !matches!(suffix, "weight" | "bias") {
        return None;
    }
    let short = match module {
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        _ => return None,
    };
    Some(format!("blk.{layer}.{short}.{suffix}"))
}

/// The number of heads whose rows `convert_hf_to_gguf.py` permuted in tensor `hf` of a
/// Llama model: `n_head` for q, `n_head_kv` for k, None for every other tensor.
pub fn permuted_heads(hf: &str, n_head: usize, n_head_kv: usize) -> Option<usize> {
    let module = hf.strip_prefix("model.layers.")?.split_once('.')?.1;
    match module.rsplit_once('.')?.0 {
        "self_attn.q_proj" => Some(n_head),
        "self_attn.k_proj" => Some(n_head_kv),
        _ => None,
    }
}

/// Undoes llama.cpp's q/k permutation of the leading dimension of `data` (rows of
/// `row_bytes` bytes, `heads` heads of equal row count). The converter wrote row
/// `h*d + 2*i + j` from Hugging Face row `h*d + j*d/2 + i` (`reshape(heads, 2, d/2, …)`
/// with axes 1 and 2 swapped); this puts each row back.
pub fn unpermute_rows(data: &[u8], row_bytes: usize, heads: usize) -> Result<Vec<u8>, String> {
    let rows = data.len() / row_bytes.max(1);
    if heads == 0
        || row_bytes == 0
        || !rows.is_multiple_of(heads)
        || !(rows / heads).is_multiple_of(2)
    {
        return Err(format!(
            "cannot undo the q/k permutation of {rows} rows over {heads} heads"
        ));
    }
    let d = rows / heads;
    let mut out = vec![0u8; data.len()];
    for h in 0..heads {
        for i in 0..d / 2 {
            for j in 0..2 {
                let src = h * d + 2 * i + j;
                let dst = h * d + j * (d / 2) + i;
                out[dst * row_bytes..(dst + 1) * row_bytes]
                    .copy_from_slice(&data[src * row_bytes..(src + 1) * row_bytes]);
            }
        }
    }
    Ok(out)
}
