//! ModelConfig parsing: the three real configs in tests/data/models, a transformers-5 style
//! config, and the one-line errors.

use std::path::PathBuf;

use vllm_worker::config::{Architecture, ModelConfig};

fn shared_model(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/data/models")
        .join(name);
    assert!(
        dir.join("config.json").is_file(),
        "reference model config missing: {}",
        dir.display()
    );
    dir
}

#[test]
fn parses_qwen3_0_6b() {
    let c = ModelConfig::from_model_dir(&shared_model("Qwen3-0.6B")).unwrap();
    assert_eq!(c.architecture, Architecture::Qwen3);
    assert_eq!(
        (
            c.hidden_size,
            c.num_hidden_layers,
            c.num_attention_heads,
            c.num_key_value_heads
        ),
        (1024, 28, 16, 8)
    );
    assert_eq!(
        (c.head_dim, c.vocab_size, c.intermediate_size),
        (128, 151936, 3072)
    );
    assert_eq!(c.rope_theta, 1e6);
    assert_eq!(c.rope_scaling, None);
    assert!(c.tie_word_embeddings && !c.attention_bias && c.qk_norm());
    assert_eq!(c.eos_token_ids, vec![151645]);
    assert_eq!(c.max_position_embeddings, 40960);
    assert_eq!(c.dtype, "bfloat16");
}

#[test]
fn parses_qwen2_5_0_5b_with_default_head_dim_and_bias() {
    let c = ModelConfig::from_model_dir(&shared_model("Qwen2.5-0.5B-Instruct")).unwrap();
    assert_eq!(c.architecture, Architecture::Qwen2);
    assert_eq!(c.head_dim, 64); // 896 / 14
    assert!(c.attention_bias && !c.qk_norm());
    assert_eq!((c.num_key_value_heads, c.rms_norm_eps), (2, 1e-6));
}

#[test]
fn parses_llama_3_2_1b_with_llama3_scaling() {
    let c = ModelConfig::from_model_dir(&shared_model("Llama-3.2-1B-Instruct")).unwrap();
    assert_eq!(c.architecture, Architecture::Llama);
    assert_eq!(c.eos_token_ids, vec![128001, 128008, 128009]);
    assert_eq!(c.rope_theta, 500000.0);
    let s = c.rope_scaling.unwrap();
    assert_eq!(
        (
            s.factor,
            s.low_freq_factor,
            s.high_freq_factor,
            s.original_max_position_embeddings
        ),
        (32.0, 1.0, 4.0, 8192.0)
    );
    assert_eq!((c.head_dim, c.max_position_embeddings), (64, 131072));
}

#[test]
fn parses_transformers_5_form() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "dtype": "float16",
        "layer_types": ["full_attention", "full_attention"],
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "eos_token_id": 7, "tie_word_embeddings": false
    });
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    let c = ModelConfig::from_model_dir(dir.path()).unwrap();
    assert_eq!(c.head_dim, 32);
    assert_eq!(c.rope_theta, 500000.0);
    assert_eq!(c.rope_scaling.unwrap().factor, 8.0);
    assert_eq!(c.dtype, "float16");
    assert_eq!(c.eos_token_ids, vec![7]);
    assert!(!c.tie_word_embeddings);

    // rope_parameters of the default type: theta only.
    let cfg = serde_json::json!({
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 10, "max_position_embeddings": 64,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}
    });
    let c = ModelConfig::from_json(&cfg).unwrap();
    assert_eq!(
        (c.rope_theta, c.rope_scaling, c.num_key_value_heads),
        (1e6, None, 4)
    );
}

#[test]
fn errors_say_what_is_wrong_in_one_line() {
    let missing = ModelConfig::from_model_dir(std::path::Path::new("/nonexistent/model"))
        .unwrap_err()
        .to_string();
    assert!(missing.contains("does not exist"), "{missing}");
    let dir = tempfile::tempdir().unwrap();
    let no_cfg = ModelConfig::from_model_dir(dir.path())
        .unwrap_err()
        .to_string();
    assert!(no_cfg.contains("no config.json"), "{no_cfg}");
    let e = ModelConfig::from_json(&serde_json::json!({"architectures": ["GPT2LMHeadModel"]}))
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "unsupported architecture GPT2LMHeadModel (supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)"
    );
    let e = ModelConfig::from_json(
        &serde_json::json!({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 8,
        "num_attention_heads": 2}),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("intermediate_size"), "{e}");
    for msg in [missing, no_cfg, e] {
        assert!(!msg.contains('\n'));
    }
}
