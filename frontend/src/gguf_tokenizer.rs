//! The tokenizer of a GGUF file, rebuilt from its metadata: a byte-level BPE
//! (`tokenizer.ggml.model = gpt2`) over `tokenizer.ggml.tokens` and `.merges`, control
//! tokens (type 3) as special added tokens and user-defined ones (type 4) as plain added
//! tokens, the pre-tokenizer split that `tokenizer.ggml.pre` names (the regex of the
//! model's own tokenizer.json, which llama.cpp's llama-vocab.cpp mirrors), bos/eos and
//! `add_bos_token` from `tokenizer.ggml.*`, and the chat template from
//! `tokenizer.chat_template`.

use anyhow::{anyhow, bail, Result};
use serde_json::{json, Value};
use vllm_worker::weights::gguf::{GgufFile, MetadataValue};

use crate::tokenizer::{ChatTemplate, TokenizerConfig};

/// Llama 3's split.
const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split: Llama 3's with single digits.
const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The `tokenizer.ggml.pre` names understood, for the error message.
const SUPPORTED_PRE: &str = "smollm, starcoder, gpt-2, llama-bpe, qwen2, deepseek-r1-qwen";

const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

fn split(pattern: &str) -> Value {
    json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false})
}

/// Bytes to the BPE alphabet; with `use_regex`, split first by GPT-2's regex.
fn byte_level(use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

/// The pre-tokenizer of `tokenizer.ggml.pre` = `pre`.
fn pre_tokenizer(pre: &str) -> Result<Value> {
    let steps = match pre {
        // SmolLM and StarCoder: every digit alone, then GPT-2's split.
        "smollm" | "starcoder" => vec![
            json!({"type": "Digits", "individual_digits": true}),
            byte_level(true),
        ],
        "gpt-2" | "gpt2" => vec![byte_level(true)],
        "llama-bpe" | "llama3" | "llama-v3" => vec![split(LLAMA3), byte_level(false)],
        "qwen2" | "deepseek-r1-qwen" => vec![split(QWEN2), byte_level(false)],
        other => bail!(
            "unsupported GGUF pre-tokenizer `{other}` (supported: {SUPPORTED_PRE}); pass --tokenizer DIR"
        ),
    };
    Ok(json!({"type": "Sequence", "pretokenizers": steps}))
}

fn strings<'a>(file: &'a GgufFile, key: &str) -> Result<Vec<&'a str>> {
    file.metadata(key)
        .and_then(MetadataValue::as_array)
        .ok_or_else(|| anyhow!("{}: no `{key}` array", file.path().display()))?
        .iter()
        .map(|v| {
            v.as_str()
                .ok_or_else(|| anyhow!("{}: `{key}` holds a non-string", file.path().display()))
        })
        .collect()
}

/// The tokenizer and the facts `tokenizer_config.json` would have given.
pub(crate) fn from_gguf(file: &GgufFile) -> Result<(tokenizers::Tokenizer, TokenizerConfig)> {
    let model = file.get_str("tokenizer.ggml.model").unwrap_or("(none)");
    if model != "gpt2" {
        bail!(
            "{}: unsupported GGUF tokenizer model `{model}` (supported: gpt2, byte-level BPE); pass --tokenizer DIR",
            file.path().display()
        );
    }
    let tokens = strings(file, "tokenizer.ggml.tokens")?;
    let merges = strings(file, "tokenizer.ggml.merges")?;
    let types: Vec<i64> = match file
        .metadata("tokenizer.ggml.token_type")
        .and_then(MetadataValue::as_array)
    {
        Some(t) => t.iter().map(|v| v.as_i64().unwrap_or(1)).collect(),
        None => vec![1; tokens.len()],
    };
    // Older files lack the key; llama.cpp then falls back to GPT-2's split.
    let pre = file.get_str("tokenizer.ggml.pre").unwrap_or("gpt-2");

    let vocab: serde_json::Map<String, Value> = tokens
        .iter()
        .enumerate()
        .map(|(id, t)| (t.to_string(), json!(id)))
        .collect();
    let added: Vec<Value> = tokens
        .iter()
        .zip(&types)
        .enumerate()
        .filter(|(_, (_, &ty))| ty == CONTROL || ty == USER_DEFINED)
        .map(|(id, (t, &ty))| {
            json!({"id": id, "content": t, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": ty == CONTROL})
        })
        .collect();

    let token_id = |key: &str| {
        file.get_u64(&format!("tokenizer.ggml.{key}"))
            .map(|v| v as u32)
    };
    let token_of = |id: Option<u32>| {
        id.and_then(|i| tokens.get(i as usize))
            .map(|t| t.to_string())
    };
    let bos_id = token_id("bos_token_id");
    let bos_token = token_of(bos_id);
    let add_bos_token = file.get_bool("tokenizer.ggml.add_bos_token");
    let post_processor = match (add_bos_token, bos_id, &bos_token) {
        (Some(true), Some(id), Some(bos)) => json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos.as_str(): {"id": bos, "ids": [id], "tokens": [bos]}}
        }),
        _ => Value::Null,
    };
    let tokenizer_json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer(pre)?,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": false, "vocab": vocab, "merges": merges
        }
    });
    let tokenizer: tokenizers::Tokenizer = tokenizer_json
        .to_string()
        .parse()
        .map_err(|e| anyhow!("{}: cannot build the tokenizer: {e}", file.path().display()))?;
    let config = TokenizerConfig {
        eos_token: token_of(token_id("eos_token_id")),
        bos_token,
        add_bos_token,
        chat_templates: chat_templates(file),
    };
    Ok((tokenizer, config))
}

/// `tokenizer.chat_template` (named "default") and each `tokenizer.chat_template.NAME`.
fn chat_templates(file: &GgufFile) -> Vec<ChatTemplate> {
    file.keys()
        .iter()
        .filter_map(|key| {
            let name = match key.strip_prefix("tokenizer.chat_template")? {
                "" => "default",
                rest => rest.strip_prefix('.')?,
            };
            Some(ChatTemplate {
                name: name.to_string(),
                template: file.get_str(key)?.to_string(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use vllm_worker::weights::gguf::GgufWriter;

    use crate::tokenizer::tests::{load, model_dir};
    use crate::tokenizer::Tokenizer;

    use super::*;

    /// Writes the tokenizer of a Hugging Face folder as llama.cpp's converter would:
    /// tokens by id, types (control for special added tokens, user-defined for the other
    /// added ones), merges as "a b", bos/eos ids and the chat template.
    fn convert(hf: &Tokenizer, dir: &Path, pre: &str, add_bos: bool, out: &Path) {
        let json: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer.json")).unwrap())
                .unwrap();
        let n = hf.vocab_size();
        let mut types = vec![1i32; n];
        for t in json["added_tokens"].as_array().unwrap() {
            let id = t["id"].as_u64().unwrap() as usize;
            types[id] = if t["special"].as_bool().unwrap() {
                3
            } else {
                4
            };
        }
        let merges = json["model"]["merges"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| match m {
                Value::String(s) => s.clone(),
                pair => format!(
                    "{} {}",
                    pair[0].as_str().unwrap(),
                    pair[1].as_str().unwrap()
                ),
            });
        let s = |v: String| MetadataValue::String(v);
        let mut w = GgufWriter::new();
        w.meta("tokenizer.ggml.model", s("gpt2".into()))
            .meta("tokenizer.ggml.pre", s(pre.into()))
            .meta(
                "tokenizer.ggml.tokens",
                MetadataValue::Array(
                    (0..n as u32)
                        .map(|i| s(hf.id_to_token(i).unwrap_or_else(|| format!("[PAD{i}]"))))
                        .collect(),
                ),
            )
            .meta(
                "tokenizer.ggml.token_type",
                MetadataValue::Array(types.into_iter().map(MetadataValue::I32).collect()),
            )
            .meta(
                "tokenizer.ggml.merges",
                MetadataValue::Array(merges.map(s).collect()),
            )
            .meta("tokenizer.ggml.add_bos_token", MetadataValue::Bool(add_bos))
            .meta(
                "tokenizer.ggml.eos_token_id",
                MetadataValue::U32(hf.eos_token_id().unwrap()),
            )
            .meta(
                "tokenizer.chat_template",
                s(hf.chat_template(None).unwrap().into()),
            );
        if let Some(bos) = hf.bos_token_id() {
            w.meta("tokenizer.ggml.bos_token_id", MetadataValue::U32(bos));
        }
        w.write(out).unwrap();
    }

    const TEXTS: &[&str] = &[
        "Hello world",
        "  leading and trailing spaces  ",
        "Numbers: 12345 and 3.14159, year 2024!",
        "naïve café — 東京 🚀 Привет",
        "tabs\tand\nnewlines\n\n  indented\r\n",
        "DON'T won't I'm you're they'll",
        "def f(x):\n    return x**2  # comment",
    ];

    #[test]
    fn rebuilt_tokenizers_encode_like_their_tokenizer_json() {
        let dir = tempfile::tempdir().unwrap();
        for (name, pre, add_bos, special) in [
            (
                "Qwen2.5-0.5B-Instruct",
                "qwen2",
                false,
                "<|im_start|>user\nHi<|im_end|>",
            ),
            (
                "Llama-3.2-1B-Instruct",
                "llama-bpe",
                true,
                "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
            ),
        ] {
            let hf = load(name);
            let path = dir.path().join(format!("{name}.gguf"));
            convert(&hf, &model_dir(name), pre, add_bos, &path);
            let tok = Tokenizer::from_model_dir(&path).unwrap();
            for text in TEXTS.iter().chain([&special]) {
                for add_special in [false, true] {
                    assert_eq!(
                        tok.encode(text, add_special).unwrap(),
                        hf.encode(text, add_special).unwrap(),
                        "{name}: {text:?} (add_special_tokens {add_special})"
                    );
                }
            }
            assert_eq!(tok.vocab_size(), hf.vocab_size());
            assert_eq!(tok.eos_token(), hf.eos_token(), "{name}");
            assert_eq!(tok.bos_token_id(), hf.bos_token_id(), "{name}");
            assert_eq!(tok.special_token_ids(), hf.special_token_ids(), "{name}");
            assert_eq!(tok.chat_template(None), hf.chat_template(None));
        }
    }

    #[test]
    fn unsupported_tokenizers_are_one_line_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        let mut w = GgufWriter::new();
        w.meta(
            "tokenizer.ggml.model",
            MetadataValue::String("llama".into()),
        );
        w.write(&path).unwrap();
        let e = Tokenizer::from_gguf(&path).unwrap_err().to_string();
        assert!(
            e.contains("unsupported GGUF tokenizer model `llama`"),
            "{e}"
        );
        assert!(e.contains("--tokenizer DIR") && !e.contains('\n'), "{e}");
        let e = pre_tokenizer("tekken").unwrap_err().to_string();
        assert!(e.contains("unsupported GGUF pre-tokenizer `tekken`"), "{e}");
    }
}
