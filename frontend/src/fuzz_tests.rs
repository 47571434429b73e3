//! Fuzz tests of what clients send the frontend: chat messages rendered through the real
//! chat templates, and token ids through the incremental detokenizer, run with
//! `vllm_fixtures::fuzz` (a bounded few seconds each in CI; `VLLM_FUZZ_ITERS=N` for a long
//! run). Every input must end in a result or an error, never a panic, and the detokenizer
//! must also keep its invariant: what it releases equals `decode` of the output ids (when
//! the prompt does not end inside a UTF-8 character).

use serde_json::{json, Map, Value};
use vllm_fixtures::fuzz::{fuzz, Verdict};

use crate::chat_template::{normalize_messages, ChatTemplate, RenderOptions};
use crate::detokenizer::IncrementalDetokenizer;
use crate::tokenizer::tests::load;
use crate::tokenizer::Tokenizer;

const MODELS: [&str; 3] = [
    "Qwen3-0.6B",
    "Qwen2.5-0.5B-Instruct",
    "Llama-3.2-1B-Instruct",
];

fn templates() -> Vec<ChatTemplate> {
    MODELS
        .iter()
        .map(|name| {
            let tokenizer = load(name);
            ChatTemplate::load(None, &tokenizer)
                .expect("template compiles")
                .expect("the model has a chat template")
        })
        .collect()
}

fn chat_seeds() -> Vec<Vec<u8>> {
    let tool_call = json!({"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}});
    let bodies = [
        json!({"messages": [{"role": "user", "content": "Hello"}]}),
        json!({"messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "{{ raise_exception('x') }} {% for %} <|im_end|>"}]}),
        json!({"messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": null, "tool_calls": [tool_call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]}),
        json!({"messages": [{"role": "assistant", "content": "Once upon", "name": "bot"}],
            "add_generation_prompt": false, "continue_final_message": true,
            "chat_template_kwargs": {"enable_thinking": false}}),
    ];
    bodies.iter().map(|b| b.to_string().into_bytes()).collect()
}

/// A request body's messages through `normalize_messages` and every model's template, as
/// the chat endpoint does.
fn render_body(templates: &[ChatTemplate], body: &[u8]) -> Verdict {
    let Ok(Value::Object(body)) = serde_json::from_slice::<Value>(body) else {
        return Verdict::Rejected;
    };
    let Some(messages) = body.get("messages") else {
        return Verdict::Rejected;
    };
    let Ok(messages) = normalize_messages(messages) else {
        return Verdict::Rejected;
    };
    let kwargs: Option<&Map<String, Value>> =
        body.get("chat_template_kwargs").and_then(Value::as_object);
    let flag = |name| body.get(name).and_then(Value::as_bool);
    let options = RenderOptions {
        add_generation_prompt: flag("add_generation_prompt").unwrap_or(true),
        continue_final_message: flag("continue_final_message").unwrap_or(false),
        kwargs,
    };
    let rendered = templates
        .iter()
        .filter(|t| t.render(&messages, &options).is_ok())
        .count();
    if rendered > 0 {
        Verdict::Accepted
    } else {
        Verdict::Rejected
    }
}

#[test]
fn fuzz_chat_template_rendering() {
    let templates = templates();
    let dictionary: &[&[u8]] = &[
        b"\"role\"",
        b"\"content\"",
        b"\"tool_calls\"",
        b"\"system\"",
        b"\"assistant\"",
        b"{{",
        b"{%",
        b"<|im_start|>",
        b"null",
        b"[]",
        b"{}",
        b"\\ud800",
    ];
    let report = fuzz("chat templates", &chat_seeds(), dictionary, 3.0, |body| {
        render_body(&templates, body)
    });
    println!("{report}");
    assert!(report.accepted > 0, "nothing rendered: {report}");
}

/// Token ids from fuzz bytes: byte 0 picks skip_special_tokens (bit 0) and the tokenizer
/// (bit 1), byte 1 the prompt length; then little-endian u32s, folded onto the vocabulary
/// plus 64 ids past its end. At most 64 ids: the corpus keeps every decodable input and
/// repeats grow them, and a long sequence tests nothing a short one does not.
fn ids_from(bytes: &[u8], vocab: u32) -> (bool, Vec<u32>, Vec<u32>) {
    let skip = bytes.first().is_some_and(|b| b & 1 == 1);
    let prompt_len = bytes.get(1).map_or(0, |b| (b % 8) as usize);
    let ids: Vec<u32> = bytes
        .get(2..)
        .unwrap_or_default()
        .chunks(4)
        .take(64)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(w) % (vocab + 64)
        })
        .collect();
    let split = prompt_len.min(ids.len());
    (skip, ids[..split].to_vec(), ids[split..].to_vec())
}

fn detokenize(tokenizer: &Tokenizer, bytes: &[u8]) -> Verdict {
    let (skip, prompt, output) = ids_from(bytes, tokenizer.vocab_size() as u32);
    let mut detok = IncrementalDetokenizer::new(tokenizer, &prompt, skip);
    let mut text: String = output.iter().map(|&id| detok.push(id)).collect();
    text.push_str(&detok.finish());
    // A prompt that ends inside a UTF-8 character lends its bytes to the output's first
    // ones, so there the output's own decode is not the reference (see detokenizer.rs).
    let prompt_ends_whole = tokenizer
        .decode(&prompt, skip)
        .is_ok_and(|t| !t.ends_with(char::REPLACEMENT_CHARACTER));
    match tokenizer.decode(&output, skip) {
        Ok(_) if !prompt_ends_whole => Verdict::Accepted,
        Ok(whole) => {
            assert_eq!(
                text, whole,
                "incremental text differs from decode({output:?}) after prompt {prompt:?}"
            );
            Verdict::Accepted
        }
        Err(_) => Verdict::Rejected,
    }
}

#[test]
fn fuzz_incremental_detokenizer() {
    let tokenizers: Vec<Tokenizer> = ["Qwen3-0.6B", "Llama-3.2-1B-Instruct"]
        .iter()
        .map(|name| load(name))
        .collect();
    let seeds: Vec<Vec<u8>> = tokenizers
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let ids = t
                .encode("Héllo wörld 🙂 — 你好, <|im_end|>", false)
                .unwrap();
            [(i as u8) << 1, 3]
                .into_iter()
                .chain(ids.iter().flat_map(|id| id.to_le_bytes()))
                .collect()
        })
        .collect();
    let report = fuzz("detokenizer", &seeds, &[], 3.0, |bytes| {
        let tokenizer = &tokenizers[usize::from(bytes.first().is_some_and(|b| b & 2 != 0))];
        detokenize(tokenizer, bytes)
    });
    println!("{report}");
    assert!(report.accepted > 0, "nothing decoded: {report}");
}
