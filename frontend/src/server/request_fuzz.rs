//! Fuzz test of the OpenAI request parsing: completion request bodies through every check
//! `create_completion` makes before it tokenizes or touches the engine (the body, each
//! field, the sampling parameters, the prompt, the sequence bound), with the limits of a
//! small served model. Every input ends in a request or an `ApiError`, never a panic.

use serde_json::json;
use vllm_fixtures::fuzz::{fuzz, Verdict};

use super::body::parse_object;
use super::completions::{Prompt, FIELDS};
use super::fields::Fields;
use super::request_fields::{
    check_sequences, read_max_tokens, SamplingFields, MAX_TOP_LOGPROBS, SAMPLING_FIELDS,
};
use super::ApiError;

const VOCAB: u32 = 512;
const MAX_NUM_SEQS: u32 = 64;
const MAX_MODEL_LEN: u32 = 4096;

fn read_completion(body: &[u8]) -> Result<(), ApiError> {
    let object = parse_object(body)?;
    let f = Fields::new(&object, &[FIELDS, SAMPLING_FIELDS])?;
    f.string("model")?;
    let sampling = SamplingFields::read(&f, VOCAB, MAX_NUM_SEQS)?;
    let max_tokens = read_max_tokens(&f, "max_tokens", MAX_MODEL_LEN)?;
    let logprobs = f.u32("logprobs", 0, MAX_TOP_LOGPROBS, "")?;
    f.bool("echo")?;
    let stream = f.bool("stream")?.unwrap_or(false);
    f.include_usage(stream)?;
    let prompt = Prompt::read(f.get("prompt"), VOCAB)?;
    check_sequences(sampling.n.unwrap_or(1), prompt.len(), MAX_NUM_SEQS)?;
    sampling.sampling_params(max_tokens.unwrap_or(16), logprobs, VOCAB)?;
    sampling.text_options();
    Ok(())
}

#[test]
fn fuzz_completion_request_parsing() {
    let seeds: Vec<Vec<u8>> = [
        json!({"model": "m", "prompt": "Hello", "max_tokens": 8}),
        json!({"prompt": [1, 2, 3], "n": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 20,
               "min_p": 0.1, "seed": 7, "stop": ["\n", "END"], "stop_token_ids": [5],
               "logprobs": 3, "presence_penalty": 0.5, "frequency_penalty": -0.5,
               "repetition_penalty": 1.1, "logit_bias": {"5": -100, "7": 3.5},
               "ignore_eos": true, "min_tokens": 2, "skip_special_tokens": false,
               "include_stop_str_in_output": true, "priority": 1}),
        json!({"prompt": [[1, 2], [3, 4]], "stream": true, "stream_options": {"include_usage": true},
               "echo": true, "max_tokens": 1}),
        json!({"prompt": ["a", "b", "c"], "best_of": 1, "user": "u", "suffix": null}),
    ]
    .iter()
    .map(|v| v.to_string().into_bytes())
    .collect();
    let dictionary: &[&[u8]] = &[
        b"\"n\"",
        b"\"prompt\"",
        b"\"max_tokens\"",
        b"\"logit_bias\"",
        b"\"stop\"",
        b"\"temperature\"",
        b"1e309",
        b"-1",
        b"4294967296",
        b"NaN",
        b"null",
        b"true",
        b"[]",
        b"{}",
        b"\"\\ud800\"",
        b"9223372036854775807",
    ];
    let report = fuzz("completion requests", &seeds, dictionary, 3.0, |body| {
        match read_completion(body) {
            Ok(()) => Verdict::Accepted,
            Err(e) => {
                // The error must render as OpenAI's shape with a message.
                let body = e.body();
                assert!(
                    body["error"]["message"]
                        .as_str()
                        .is_some_and(|m| !m.is_empty()),
                    "{body}"
                );
                Verdict::Rejected
            }
        }
    });
    println!("{report}");
    assert!(report.accepted > 0, "no request parsed: {report}");
}
