//! End-to-end tests of a real GGUF model, SmolLM2-135M-Instruct in Q4_1 (`smollm2_gguf`):
//! its tokenizer rebuilt from the metadata against ids computed once in Python
//! (`scripts/gguf_tokenizer_reference.py`), and `vllm-rs serve --model FILE.gguf` on the
//! CPU answering completions and ChatML chat requests sensibly.

mod common;

use std::process::Command;

use common::{exe, smollm2_gguf, Server};
use serde_json::{json, Value};
use vllm_frontend::tokenizer::Tokenizer;

#[test]
fn the_gguf_tokenizer_matches_the_reference_ids() {
    let tok = Tokenizer::from_model_dir(&smollm2_gguf()).expect("tokenizer from GGUF");
    let data = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/data/smollm2_gguf_token_ids.json"),
    )
    .expect("reference ids");
    let cases: Vec<Value> = serde_json::from_str(&data).expect("json");
    assert!(cases.len() >= 8);
    for case in &cases {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        assert_eq!(tok.encode(text, false).unwrap(), want, "{text:?}");
        // add_bos_token is false: special tokens add nothing.
        assert_eq!(tok.encode(text, true).unwrap(), want, "{text:?}");
        assert_eq!(tok.decode(&want, false).unwrap(), text);
    }
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(
        (tok.eos_token(), tok.eos_token_id()),
        (Some("<|im_end|>"), Some(2))
    );
    assert_eq!(
        (tok.bos_token(), tok.bos_token_id()),
        (Some("<|im_start|>"), Some(1))
    );
    assert_eq!(tok.add_bos_token(), Some(false));
    assert!(tok.is_special(0) && tok.is_special(2) && !tok.is_special(504));
    assert_eq!(tok.decode(&[1, 4093, 198, 2], true).unwrap(), "user\n");
    assert!(tok
        .chat_template(None)
        .is_some_and(|t| t.contains("<|im_start|>")));
}

#[tokio::test(flavor = "multi_thread")]
async fn serves_the_gguf_on_the_cpu() {
    let model = smollm2_gguf();
    let server = Server::start_with_model(&model, &["--device", "cpu"]);
    let (status, body) = common::post_json(
        &server,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "temperature": 0, "max_tokens": 8}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let text = body["choices"][0]["text"].as_str().unwrap_or("");
    assert!(text.starts_with(" Paris"), "{body}");
    assert_eq!(body["usage"]["prompt_tokens"], 5, "{body}");

    let question = "What is the capital of France? Answer in one word.";
    let (status, body) = common::post_json(
        &server,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": question}],
                "temperature": 0, "max_tokens": 16}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let answer = body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or("");
    assert!(answer.contains("Paris"), "{body}");
    // The GGUF's ChatML template, with its default system prompt, was the prompt; the
    // answer ended at <|im_end|>, the GGUF's eos.
    let tok = Tokenizer::from_model_dir(&model).unwrap();
    let rendered = format!(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(
        body["usage"]["prompt_tokens"],
        tok.encode(&rendered, false).unwrap().len(),
        "{body}"
    );
    assert_eq!(body["choices"][0]["finish_reason"], "stop", "{body}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_folder_with_one_gguf_is_the_model() {
    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(smollm2_gguf(), dir.path().join("model.gguf")).unwrap();
    let server = Server::start_with_model(dir.path(), &["--device", "cpu"]);
    let (status, body) = common::post_json(
        &server,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "temperature": 0, "max_tokens": 3}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body["choices"][0]["text"]
            .as_str()
            .unwrap_or("")
            .starts_with(" Paris"),
        "{body}"
    );
}

#[test]
fn model_path_mistakes_are_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["a.gguf", "b.gguf"] {
        std::fs::write(dir.path().join(name), b"GGUF").unwrap();
    }
    let run = |args: &[&std::ffi::OsStr]| {
        let out = Command::new(exe())
            .args(["generate", "--prompt", "x", "--device", "cpu"])
            .args(args)
            .output()
            .expect("run");
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(!err.contains("panicked"), "{err}");
        err
    };
    let err = run(&["--model".as_ref(), dir.path().as_os_str()]);
    assert!(
        err.contains("holds 2 .gguf files (a.gguf, b.gguf)"),
        "{err}"
    );
    let model = smollm2_gguf();
    let err = run(&[
        "--model".as_ref(),
        model.as_os_str(),
        "--tokenizer".as_ref(),
        "/no/such/tokenizer".as_ref(),
    ]);
    assert!(
        err.contains("--tokenizer /no/such/tokenizer: no such directory"),
        "{err}"
    );
    let err = run(&["--model".as_ref(), dir.path().join("a.gguf").as_os_str()]);
    assert!(err.contains("GGUF file truncated"), "{err}");
}
