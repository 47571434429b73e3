//! Tests of the GGUF parser, dequantization, names and the model config, on files the tests
//! write themselves and on a reference file written once by the `gguf` Python package
//! (`scripts/make_gguf_dequant_reference.py`).

use std::path::{Path, PathBuf};

use super::*;
use crate::config::{Architecture, ModelConfig};
use crate::weights::{DType, Weights};
use vllm_fixtures::{tiny_model_tensors, write_tiny_model, ModelType, TinyDtype, TinyModelSpec};

fn reference_file() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/gguf_dequant_reference.gguf")
}

fn every_value() -> Vec<(&'static str, MetadataValue)> {
    use MetadataValue as V;
    vec![
        ("t.u8", V::U8(200)),
        ("t.i8", V::I8(-5)),
        ("t.u16", V::U16(60000)),
        ("t.i16", V::I16(-30000)),
        ("t.u32", V::U32(4_000_000_000)),
        ("t.i32", V::I32(-2_000_000_000)),
        ("t.f32", V::F32(1.5)),
        ("t.bool", V::Bool(true)),
        ("t.string", V::String("héllo ✓".into())),
        ("t.u64", V::U64(1 << 40)),
        ("t.i64", V::I64(-(1 << 40))),
        ("t.f64", V::F64(2.25)),
        (
            "t.array",
            V::Array(vec![V::String("a".into()), V::String(String::new())]),
        ),
        (
            "t.nested",
            V::Array(vec![
                V::Array(vec![V::I32(1), V::I32(-2)]),
                V::Array(vec![]),
            ]),
        ),
    ]
}

fn small_file(alignment: Option<u32>) -> GgufWriter {
    let mut w = GgufWriter::new();
    if let Some(a) = alignment {
        w.meta("general.alignment", MetadataValue::U32(a));
    }
    for (k, v) in every_value() {
        w.meta(k, v);
    }
    w.f32_tensor("a", &[2, 3], &[1., 2., 3., 4., 5., 6.]);
    w.f32_tensor("b", &[5], &[7., 8., 9., 10., 11.]);
    w.tensor("c", &[32], GgmlType::Q8_0, {
        let mut b = half::f16::from_f32(0.5).to_le_bytes().to_vec();
        b.extend((0..32).map(|i| (i as i8 - 16) as u8));
        b
    });
    w
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn parses_every_value_type_tensors_and_alignment() {
    let dir = tempfile::tempdir().unwrap();
    for alignment in [None, Some(64), Some(1)] {
        let path = write(dir.path(), "m.gguf", &small_file(alignment).to_bytes());
        let f = GgufFile::open(&path).unwrap();
        assert_eq!(f.version(), 3);
        assert_eq!(
            f.alignment(),
            alignment.map_or(DEFAULT_ALIGNMENT, u64::from)
        );
        for (k, v) in every_value() {
            assert_eq!(f.metadata(k), Some(&v), "{k}");
        }
        assert_eq!(f.get_u64("t.u32"), Some(4_000_000_000));
        assert_eq!(f.get_u64("t.i8"), None);
        assert_eq!(f.get_f64("t.i16"), Some(-30000.0));
        assert_eq!(f.get_str("t.string"), Some("héllo ✓"));
        assert_eq!(f.get_bool("t.bool"), Some(true));
        assert_eq!(f.tensors().len(), 3);
        let a = f.tensor_info("a").unwrap();
        assert_eq!((a.dims.as_slice(), a.shape()), (&[3u64, 2][..], vec![2, 3]));
        assert_eq!(f.tensor_info("c").unwrap().offset % f.alignment(), 0);
        assert_eq!(
            f.dequantize("a").unwrap(),
            (vec![2, 3], vec![1., 2., 3., 4., 5., 6.])
        );
        assert_eq!(f.dequantize("b").unwrap().1, vec![7., 8., 9., 10., 11.]);
        let c: Vec<f32> = (0..32).map(|i| 0.5 * (i as f32 - 16.0)).collect();
        assert_eq!(f.dequantize("c").unwrap(), (vec![32], c));
    }
}

#[test]
fn bad_files_give_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let good = small_file(None).to_bytes();
    let err = |bytes: &[u8]| {
        let path = write(dir.path(), "bad.gguf", bytes);
        format!("{:#}", GgufFile::open(&path).unwrap_err())
    };
    let mut bad = good.clone();
    bad[0] = b'X';
    assert!(err(&bad).contains("not a GGUF file"), "{}", err(&bad));
    let mut bad = good.clone();
    bad[4] = 1;
    assert!(
        err(&bad).contains("unsupported GGUF version 1"),
        "{}",
        err(&bad)
    );
    // Every cut through the header or the data is reported as a truncation.
    // (The last 30 bytes are the padding after the last tensor.)
    for cut in [0, 3, 10, 30, 100, 200, good.len() - 40, good.len() - 31] {
        let e = err(&good[..cut]);
        assert!(e.contains("truncated"), "cut at {cut}: {e}");
    }
    let mut w = small_file(None);
    w.meta("general.alignment", MetadataValue::U32(3));
    assert!(err(&w.to_bytes()).contains("not a power of two"));
    // A value type code no GGUF knows.
    let mut bad = GgufWriter::new().meta("k", MetadataValue::U8(1)).to_bytes();
    let at = 24 + 8 + 1;
    bad[at..at + 4].copy_from_slice(&99u32.to_le_bytes());
    assert!(err(&bad).contains("unknown value type 99"), "{}", err(&bad));
    // A type of unknown layout is listed, and named when read.
    let mut w = GgufWriter::new();
    w.tensor("iq", &[256], GgmlType::Other(19), vec![0; 64]);
    let path = write(dir.path(), "iq.gguf", &w.to_bytes());
    let f = GgufFile::open(&path).unwrap();
    let e = f.dequantize("iq").unwrap_err().to_string();
    assert!(
        e.contains("unsupported GGUF tensor type ggml type 19"),
        "{e}"
    );
    // A known type that is not decoded names the supported ones.
    let mut w = GgufWriter::new();
    w.tensor("q5", &[32], GgmlType::Q5_0, vec![0; 22]);
    let path = write(dir.path(), "q5.gguf", &w.to_bytes());
    let e = GgufFile::open(&path)
        .unwrap()
        .dequantize("q5")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("unsupported GGUF tensor type Q5_0 (supported: F32, F16, BF16, Q8_0"),
        "{e}"
    );
    assert!(!e.contains('\n'));
}

#[test]
fn reads_the_python_written_reference_file() {
    let f = GgufFile::open(&reference_file()).unwrap();
    assert_eq!(f.architecture(), Some("llama"));
    assert_eq!(f.metadata("test.u8"), Some(&MetadataValue::U8(200)));
    assert_eq!(
        f.metadata("test.i64"),
        Some(&MetadataValue::I64(-(1 << 40)))
    );
    assert_eq!(f.get_str("test.string"), Some("héllo ✓"));
    assert_eq!(f.get_f64("test.f64"), Some(2.25));
    let strs = f.metadata("test.array_str").unwrap().as_array().unwrap();
    assert_eq!(
        strs.iter().map(|v| v.as_str().unwrap()).collect::<Vec<_>>(),
        ["a", "bc", ""]
    );
    let ints = f.metadata("test.array_i32").unwrap().as_array().unwrap();
    assert_eq!(
        ints.iter().map(|v| v.as_i64().unwrap()).collect::<Vec<_>>(),
        [1, -2, 3]
    );
}

#[test]
fn dequantization_matches_gguf_python() {
    let f = GgufFile::open(&reference_file()).unwrap();
    for name in [
        "q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k", "f16", "bf16",
    ] {
        let (shape, got) = f.dequantize(name).unwrap();
        let (eshape, expected) = f.dequantize(&format!("{name}.expected")).unwrap();
        assert_eq!(shape, eshape, "{name}");
        assert!(
            expected.iter().any(|&v| v != 0.0),
            "{name}: empty reference"
        );
        for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
            assert!(
                (g - e).abs() <= 1e-6 * e.abs().max(1e-3),
                "{name}[{i}]: {g} vs {e}"
            );
        }
    }
}

#[test]
fn large_tensors_dequantize_in_parallel_chunks_alike() {
    // 3.5 chunks of Q4_1 blocks: every chunk must read its own blocks.
    let n = (1 << 16) * 7 / 2;
    let mut bytes = Vec::new();
    let mut expected = Vec::new();
    for b in 0..n / 32 {
        let d = half::f16::from_f32(0.01 * (b % 13) as f32);
        let m = half::f16::from_f32(-0.1 * (b % 7) as f32);
        bytes.extend(d.to_le_bytes());
        bytes.extend(m.to_le_bytes());
        let qs: Vec<u8> = (0..16).map(|j| ((b + j) % 256) as u8).collect();
        let mut block = [0f32; 32];
        for (j, &q) in qs.iter().enumerate() {
            block[j] = d.to_f32() * f32::from(q & 0xF) + m.to_f32();
            block[j + 16] = d.to_f32() * f32::from(q >> 4) + m.to_f32();
        }
        bytes.extend(qs);
        expected.extend(block);
    }
    assert_eq!(dequantize(GgmlType::Q4_1, &bytes, n).unwrap(), expected);
    let e = dequantize(GgmlType::Q4_1, &bytes[1..], n).unwrap_err();
    assert!(e.contains("do not fill"), "{e}");
}

#[test]
fn names_map_to_llama_cpp() {
    for (hf, gg) in [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
        (
            "model.layers.3.self_attn.q_proj.weight",
            "blk.3.attn_q.weight",
        ),
        ("model.layers.3.self_attn.k_proj.bias", "blk.3.attn_k.bias"),
        (
            "model.layers.0.self_attn.v_proj.weight",
            "blk.0.attn_v.weight",
        ),
        (
            "model.layers.0.self_attn.o_proj.weight",
            "blk.0.attn_output.weight",
        ),
        (
            "model.layers.12.self_attn.q_norm.weight",
            "blk.12.attn_q_norm.weight",
        ),
        (
            "model.layers.12.self_attn.k_norm.weight",
            "blk.12.attn_k_norm.weight",
        ),
        (
            "model.layers.1.mlp.gate_proj.weight",
            "blk.1.ffn_gate.weight",
        ),
        ("model.layers.1.mlp.up_proj.weight", "blk.1.ffn_up.weight"),
        (
            "model.layers.1.mlp.down_proj.weight",
            "blk.1.ffn_down.weight",
        ),
        (
            "model.layers.1.input_layernorm.weight",
            "blk.1.attn_norm.weight",
        ),
        (
            "model.layers.1.post_attention_layernorm.weight",
            "blk.1.ffn_norm.weight",
        ),
    ] {
        assert_eq!(gguf_name(hf).as_deref(), Some(gg), "{hf}");
    }
    for hf in [
        "model.layers.x.mlp.up_proj.weight",
        "model.layers.1.mlp.other.weight",
        "foo",
    ] {
        assert_eq!(gguf_name(hf), None, "{hf}");
    }
    assert_eq!(
        permuted_heads("model.layers.0.self_attn.q_proj.weight", 9, 3),
        Some(9)
    );
    assert_eq!(
        permuted_heads("model.layers.0.self_attn.k_proj.bias", 9, 3),
        Some(3)
    );
    assert_eq!(
        permuted_heads("model.layers.0.self_attn.v_proj.weight", 9, 3),
        None
    );
}

/// llama.cpp's `LlamaModel.permute`: `w.reshape(heads, 2, d/2, …).swapaxes(1, 2)`.
fn permute_rows(data: &[f32], cols: usize, heads: usize) -> Vec<f32> {
    let d = data.len() / cols / heads;
    let mut out = vec![0f32; data.len()];
    for h in 0..heads {
        for i in 0..d / 2 {
            for j in 0..2 {
                let (to, from) = (h * d + 2 * i + j, h * d + j * (d / 2) + i);
                out[to * cols..(to + 1) * cols]
                    .copy_from_slice(&data[from * cols..(from + 1) * cols]);
            }
        }
    }
    out
}

#[test]
fn unpermute_inverts_the_converter() {
    let (heads, d, cols) = (3, 8, 5);
    let data: Vec<f32> = (0..heads * d * cols).map(|i| i as f32).collect();
    let permuted = permute_rows(&data, cols, heads);
    assert_ne!(permuted, data);
    let bytes = DType::F32.encode(&permuted);
    let back = unpermute_rows(&bytes, cols * 4, heads).unwrap();
    assert_eq!(DType::F32.decode(&back), data);
    assert!(unpermute_rows(&bytes, cols * 4, 7).is_err());
}

/// Writes `cfg` and HF `tensors` as llama.cpp's converter would: GGUF names and metadata,
/// q/k rows permuted for llama; the 2-D tensors in `quant` (Q8_0) or F32.
fn convert_to_gguf(
    cfg: &ModelConfig,
    tensors: &[(String, Vec<usize>, Vec<f32>)],
    path: &Path,
    q8: bool,
) {
    let arch = match cfg.architecture {
        Architecture::Llama => "llama",
        Architecture::Qwen2 => "qwen2",
        Architecture::Qwen3 => "qwen3",
    };
    let mut w = GgufWriter::new();
    let u32v = |v: usize| MetadataValue::U32(v as u32);
    w.meta("general.architecture", MetadataValue::String(arch.into()))
        .meta(&format!("{arch}.block_count"), u32v(cfg.num_hidden_layers))
        .meta(
            &format!("{arch}.context_length"),
            u32v(cfg.max_position_embeddings),
        )
        .meta(&format!("{arch}.embedding_length"), u32v(cfg.hidden_size))
        .meta(
            &format!("{arch}.feed_forward_length"),
            u32v(cfg.intermediate_size),
        )
        .meta(
            &format!("{arch}.attention.head_count"),
            u32v(cfg.num_attention_heads),
        )
        .meta(
            &format!("{arch}.attention.head_count_kv"),
            u32v(cfg.num_key_value_heads),
        )
        .meta(&format!("{arch}.attention.key_length"), u32v(cfg.head_dim))
        .meta(
            &format!("{arch}.rope.freq_base"),
            MetadataValue::F32(cfg.rope_theta as f32),
        )
        .meta(
            &format!("{arch}.attention.layer_norm_rms_epsilon"),
            MetadataValue::F32(cfg.rms_norm_eps as f32),
        )
        .meta(
            "tokenizer.ggml.tokens",
            MetadataValue::Array(
                (0..cfg.vocab_size)
                    .map(|i| MetadataValue::String(format!("t{i}")))
                    .collect(),
            ),
        )
        .meta("tokenizer.ggml.eos_token_id", u32v(2));
    if let Some(s) = cfg.rope_scaling {
        w.f32_tensor(
            "rope_freqs.weight",
            &[cfg.head_dim / 2],
            &llama3_rope_factors(cfg.head_dim, cfg.rope_theta, s),
        );
    }
    for (name, shape, data) in tensors {
        if cfg.tie_word_embeddings && name == "lm_head.weight" {
            continue;
        }
        let heads = match arch {
            "llama" => permuted_heads(name, cfg.num_attention_heads, cfg.num_key_value_heads),
            _ => None,
        };
        let cols = data.len() / shape[0];
        let data = match heads {
            Some(h) => permute_rows(data, cols, h),
            None => data.clone(),
        };
        let gname = gguf_name(name).unwrap();
        if q8 && shape.len() == 2 && cols % 32 == 0 {
            let bytes = data
                .chunks(32)
                .flat_map(|block| {
                    let amax = block.iter().fold(0f32, |a, v| a.max(v.abs()));
                    let d = amax / 127.0;
                    let mut out = half::f16::from_f32(d).to_le_bytes().to_vec();
                    out.extend(
                        block
                            .iter()
                            .map(|v| (if d == 0.0 { 0.0 } else { (v / d).round() }) as i8 as u8),
                    );
                    out
                })
                .collect();
            let dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
            w.tensor(&gname, &dims, GgmlType::Q8_0, bytes);
        } else {
            w.f32_tensor(&gname, shape, &data);
        }
    }
    w.write(path).unwrap();
}
/// `rope_freqs.weight` as llama.cpp's converter computes it from Llama 3 scaling.
fn llama3_rope_factors(
    head_dim: usize,
    theta: f64,
    s: vllm_kernels::cpu::Llama3RopeScaling,
) -> Vec<f32> {
    let low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
    let high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
    (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / theta.powf((2 * i) as f64 / head_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            if wavelen < high_freq_wavelen {
                1.0
            } else if wavelen > low_freq_wavelen {
                s.factor as f32
            } else {
                let smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor)
                    / (s.high_freq_factor - s.low_freq_factor);
                (1.0 / ((1.0 - smooth) / s.factor + smooth)) as f32
            }
        })
        .collect()
}

#[test]
fn a_converted_model_gives_the_checkpoints_logits() {
    for arch in [ModelType::Llama, ModelType::Qwen2, ModelType::Qwen3] {
        let dir = tempfile::tempdir().unwrap();
        let hf = dir.path().join("hf");
        let mut spec = TinyModelSpec::tiny(arch);
        spec.dtype = TinyDtype::F32;
        spec.tie_word_embeddings = arch != ModelType::Qwen2;
        write_tiny_model(&hf, &spec).unwrap();
        // The tiny Llama has Llama 3 rope scaling, which GGUF carries as `rope_freqs`.
        let cfg = ModelConfig::from_model_dir(&hf).unwrap();
        assert_eq!(cfg.rope_scaling.is_some(), arch == ModelType::Llama);
        let tensors = tiny_model_tensors(&spec);
        let gguf_dir = dir.path().join("gguf");
        std::fs::create_dir(&gguf_dir).unwrap();
        convert_to_gguf(&cfg, &tensors, &gguf_dir.join("m.gguf"), false);

        // The folder with one .gguf resolves to it; its config equals the checkpoint's.
        let gcfg = ModelConfig::from_model_dir(&gguf_dir).unwrap();
        assert_eq!(gcfg.architecture, cfg.architecture);
        assert_eq!(
            gcfg.tie_word_embeddings, cfg.tie_word_embeddings,
            "{arch:?}"
        );
        assert_eq!(gcfg.attention_bias, cfg.attention_bias);
        assert_eq!(
            (
                gcfg.hidden_size,
                gcfg.num_hidden_layers,
                gcfg.head_dim,
                gcfg.vocab_size
            ),
            (
                cfg.hidden_size,
                cfg.num_hidden_layers,
                cfg.head_dim,
                cfg.vocab_size
            )
        );
        assert_eq!(gcfg.eos_token_ids, [2]);

        assert_eq!(gcfg.rope_freq_factors.is_some(), arch == ModelType::Llama);
        // Long enough that the scaled frequencies turn visibly (by position 63).
        let tokens: Vec<u32> = (0..64).map(|i| (i * 37 + 5) % 500).collect();
        let want = crate::reference::reference_logits(&hf, &tokens).unwrap();
        let got = crate::reference::reference_logits(&gguf_dir, &tokens).unwrap();
        let diff = want
            .iter()
            .zip(&got)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(diff < 1e-4, "{arch:?}: max logit difference {diff}");

        // Q8_0 weights land close to the f32 ones.
        let q8 = dir.path().join("q8.gguf");
        convert_to_gguf(&cfg, &tensors, &q8, true);
        let got = crate::reference::reference_logits(&q8, &tokens).unwrap();
        let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
        let diff = want
            .iter()
            .zip(&got)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            diff < 0.05 * scale,
            "{arch:?}: Q8_0 logits off by {diff} (scale {scale})"
        );
    }
}

#[test]
fn weights_check_shapes_and_name_what_is_missing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    let mut w = GgufWriter::new();
    w.meta(
        "general.architecture",
        MetadataValue::String("qwen2".into()),
    );
    w.f32_tensor("output_norm.weight", &[4], &[1., 2., 3., 4.]);
    w.write(&path).unwrap();
    let weights = Weights::open(&path).unwrap();
    assert!(weights.contains("model.norm.weight"));
    assert!(!weights.contains("lm_head.weight"));
    let t = weights.get("model.norm.weight", &[4]).unwrap();
    assert_eq!((t.dtype, t.to_f32()), (DType::F32, vec![1., 2., 3., 4.]));
    assert!(matches!(t.bytes(), std::borrow::Cow::Borrowed(_)));
    let e = weights
        .get("model.norm.weight", &[2, 2])
        .unwrap_err()
        .to_string();
    assert!(e.contains("has shape [4], expected [2, 2]"), "{e}");
    let e = weights.get("lm_head.weight", &[4]).unwrap_err().to_string();
    assert!(
        e.contains("no tensor `lm_head.weight` (GGUF `output.weight`)"),
        "{e}"
    );
    let e = Weights::load(&path, crate::config::LoadFormat::Safetensors, DType::F32)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("is the GGUF file"), "{e}");
}

#[test]
fn config_errors_are_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    let mut w = GgufWriter::new();
    w.meta(
        "general.architecture",
        MetadataValue::String("gemma3".into()),
    );
    w.write(&path).unwrap();
    let e = ModelConfig::from_model_dir(&path).unwrap_err().to_string();
    assert!(
        e.contains("unsupported GGUF architecture `gemma3` (supported: llama, qwen2, qwen3)"),
        "{e}"
    );
    let mut w = GgufWriter::new();
    w.meta(
        "general.architecture",
        MetadataValue::String("llama".into()),
    );
    w.write(&path).unwrap();
    let e = ModelConfig::from_model_dir(&path).unwrap_err().to_string();
    assert!(
        e.contains("missing or invalid `llama.embedding_length`"),
        "{e}"
    );
    assert!(!e.contains('\n'));

    // rope_freqs.weight must hold one positive divisor per rotary frequency.
    let mut w = GgufWriter::new();
    let u32v = |v: u32| MetadataValue::U32(v);
    w.meta(
        "general.architecture",
        MetadataValue::String("llama".into()),
    )
    .meta("llama.embedding_length", u32v(64))
    .meta("llama.attention.head_count", u32v(4))
    .meta("llama.feed_forward_length", u32v(128))
    .meta("llama.block_count", u32v(1))
    .meta("llama.context_length", u32v(128))
    .meta("llama.vocab_size", u32v(10));
    w.f32_tensor("rope_freqs.weight", &[5], &[1.0; 5]);
    w.write(&path).unwrap();
    let e = ModelConfig::from_model_dir(&path).unwrap_err().to_string();
    assert!(
        e.contains("rope_freqs.weight has shape [5], expected [8] (head_dim / 2)"),
        "{e}"
    );
}
