//! Benchmark workloads: a JSON-lines dataset file, or seeded random prompts.
//!
//! One request per line, a JSON object with the prompt as token ids or as text and,
//! optionally, its output length:
//!
//! ```text
//! {"prompt_token_ids": [1, 2, 3], "max_tokens": 16}
//! {"prompt": "Hello world", "output_len": 8}
//! ```
//!
//! `max_tokens` and `output_len` are the same thing (vLLM's offline format and its
//! benchmark datasets' names); other fields are ignored. Blank lines are skipped.

use std::path::Path;

use anyhow::{bail, Context};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;

use crate::tokenizer::Tokenizer;

/// A row's prompt, as the file gives it.
#[derive(Debug, Clone, PartialEq)]
pub enum DatasetPrompt {
    Tokens(Vec<u32>),
    Text(String),
}

/// One parsed line of a dataset file.
#[derive(Debug, Clone, PartialEq)]
pub struct DatasetRow {
    /// 1-based line number in the file, for error messages.
    pub line: usize,
    pub prompt: DatasetPrompt,
    /// `max_tokens` (or `output_len`) if the row gives one.
    pub max_tokens: Option<u32>,
}

/// A request ready for the engine.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchRequest {
    /// Where it came from: "line N" of the dataset, or "random prompt N".
    pub origin: String,
    pub prompt_token_ids: Vec<u32>,
    pub max_tokens: u32,
}

/// Reads and parses a dataset file; errors name the file and the line.
pub fn load_dataset(path: &Path) -> anyhow::Result<Vec<DatasetRow>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read dataset {}", path.display()))?;
    parse_dataset(&text).with_context(|| format!("dataset {}", path.display()))
}

/// Parses JSON-lines text into rows (blank lines skipped). An empty dataset is an error.
pub fn parse_dataset(text: &str) -> anyhow::Result<Vec<DatasetRow>> {
    let mut rows = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        if raw.trim().is_empty() {
            continue;
        }
        rows.push(parse_row(raw, line).with_context(|| format!("line {line}"))?);
    }
    if rows.is_empty() {
        bail!("the dataset is empty (no request lines)");
    }
    Ok(rows)
}

fn parse_row(raw: &str, line: usize) -> anyhow::Result<DatasetRow> {
    let value: Value = serde_json::from_str(raw).context("not valid JSON")?;
    let Value::Object(obj) = value else {
        bail!("expected a JSON object");
    };
    let prompt = match (obj.get("prompt_token_ids"), obj.get("prompt")) {
        (Some(_), Some(_)) => bail!("give either \"prompt_token_ids\" or \"prompt\", not both"),
        (Some(ids), None) => DatasetPrompt::Tokens(token_ids(ids)?),
        (None, Some(Value::String(s))) => DatasetPrompt::Text(s.clone()),
        (None, Some(_)) => bail!("\"prompt\" must be a string"),
        (None, None) => bail!("no \"prompt_token_ids\" or \"prompt\" field"),
    };
    match &prompt {
        DatasetPrompt::Tokens(ids) if ids.is_empty() => bail!("the prompt is empty"),
        DatasetPrompt::Text(s) if s.is_empty() => bail!("the prompt is empty"),
        _ => {}
    }
    let max_tokens = length_field(&obj, "max_tokens")?;
    let output_len = length_field(&obj, "output_len")?;
    let max_tokens = match (max_tokens, output_len) {
        (Some(a), Some(b)) if a != b => {
            bail!("\"max_tokens\" ({a}) and \"output_len\" ({b}) disagree")
        }
        (a, b) => a.or(b),
    };
    Ok(DatasetRow {
        line,
        prompt,
        max_tokens,
    })
}

fn token_ids(v: &Value) -> anyhow::Result<Vec<u32>> {
    let Value::Array(items) = v else {
        bail!("\"prompt_token_ids\" must be an array of token ids");
    };
    items
        .iter()
        .enumerate()
        .map(|(i, t)| {
            t.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .with_context(|| {
                    format!("\"prompt_token_ids\"[{i}] is {t}, not a token id (an integer >= 0)")
                })
        })
        .collect()
}

fn length_field(obj: &serde_json::Map<String, Value>, name: &str) -> anyhow::Result<Option<u32>> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64().and_then(|n| u32::try_from(n).ok()) {
            Some(0) => bail!("\"{name}\" must be at least 1"),
            Some(n) => Ok(Some(n)),
            None => bail!("\"{name}\" is {v}, not a positive integer"),
        },
    }
}

/// Turns rows into requests: text prompts are tokenized (with the tokenizer's special
/// tokens, as `generate` and the server do), and `max_tokens_override` (when given)
/// replaces every row's output length. A row without one and no override is an error.
pub fn to_requests(
    rows: &[DatasetRow],
    tokenizer: &Tokenizer,
    max_tokens_override: Option<u32>,
) -> anyhow::Result<Vec<BenchRequest>> {
    rows.iter()
        .map(|row| {
            let prompt_token_ids = match &row.prompt {
                DatasetPrompt::Tokens(ids) => ids.clone(),
                DatasetPrompt::Text(text) => tokenizer
                    .encode(text, true)
                    .with_context(|| format!("line {}: cannot tokenize the prompt", row.line))?,
            };
            let Some(max_tokens) = max_tokens_override.or(row.max_tokens) else {
                bail!(
                    "line {}: no \"max_tokens\" or \"output_len\" (give one, or pass --max-tokens)",
                    row.line
                );
            };
            Ok(BenchRequest {
                origin: format!("line {}", row.line),
                prompt_token_ids,
                max_tokens,
            })
        })
        .collect()
}

/// `num` requests of `input_len` random token ids in `0..vocab_size` each, seeded.
pub fn random_requests(
    num: usize,
    input_len: usize,
    output_len: u32,
    vocab_size: u32,
    seed: u64,
) -> Vec<BenchRequest> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..num)
        .map(|i| BenchRequest {
            origin: format!("random prompt {i}"),
            prompt_token_ids: random_token_ids(&mut rng, input_len, vocab_size),
            max_tokens: output_len,
        })
        .collect()
}

pub fn random_token_ids(rng: &mut StdRng, len: usize, vocab_size: u32) -> Vec<u32> {
    (0..len)
        .map(|_| rng.random_range(0..vocab_size.max(1)))
        .collect()
}

/// Checks every request against the engine's limits before anything is timed: token ids
/// inside the vocabulary, and prompt plus output within the context length. vLLM rejects
/// a prompt longer than the context; a request that fits its prompt but not its whole
/// `max_tokens` would silently stop early and skew the figures, so it is an error too.
pub fn check_requests(
    requests: &[BenchRequest],
    vocab_size: u32,
    max_model_len: u32,
) -> anyhow::Result<()> {
    for r in requests {
        if let Some(bad) = r.prompt_token_ids.iter().find(|&&t| t >= vocab_size) {
            bail!(
                "{}: token id {bad} is outside the model's vocabulary (size {vocab_size})",
                r.origin
            );
        }
        let prompt = r.prompt_token_ids.len() as u64;
        if prompt >= max_model_len as u64 {
            bail!(
                "{}: the prompt has {prompt} tokens, which does not fit the model's context \
                 length of {max_model_len} (--max-model-len)",
                r.origin
            );
        }
        if prompt + r.max_tokens as u64 > max_model_len as u64 {
            bail!(
                "{}: the prompt's {prompt} tokens plus max_tokens {} exceed the model's context \
                 length of {max_model_len} (--max-model-len)",
                r.origin,
                r.max_tokens
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_token_and_text_rows() {
        let text = "{\"prompt_token_ids\": [1, 2, 3], \"max_tokens\": 4}\n\n\
                    {\"prompt\": \"hi\", \"output_len\": 2, \"extra\": true}\n\
                    {\"prompt\": \"no length\"}\n";
        let rows = parse_dataset(text).unwrap();
        assert_eq!(
            rows,
            vec![
                DatasetRow {
                    line: 1,
                    prompt: DatasetPrompt::Tokens(vec![1, 2, 3]),
                    max_tokens: Some(4)
                },
                DatasetRow {
                    line: 3,
                    prompt: DatasetPrompt::Text("hi".into()),
                    max_tokens: Some(2)
                },
                DatasetRow {
                    line: 4,
                    prompt: DatasetPrompt::Text("no length".into()),
                    max_tokens: None
                },
            ]
        );
    }

    #[test]
    fn both_length_fields_must_agree() {
        let ok = parse_dataset("{\"prompt\": \"a\", \"max_tokens\": 3, \"output_len\": 3}");
        assert_eq!(ok.unwrap()[0].max_tokens, Some(3));
        let err =
            parse_dataset("{\"prompt\": \"a\", \"max_tokens\": 3, \"output_len\": 4}").unwrap_err();
        assert!(format!("{err:#}").contains("disagree"), "{err:#}");
    }

    fn err_of(text: &str) -> String {
        format!("{:#}", parse_dataset(text).unwrap_err())
    }

    #[test]
    fn errors_name_the_line() {
        let good = "{\"prompt_token_ids\": [1], \"max_tokens\": 1}\n";
        let cases = [
            ("not json", "not valid JSON"),
            ("[1, 2]", "expected a JSON object"),
            (
                "{\"max_tokens\": 3}",
                "no \"prompt_token_ids\" or \"prompt\"",
            ),
            ("{\"prompt\": 5}", "must be a string"),
            ("{\"prompt_token_ids\": [1, -2]}", "\"prompt_token_ids\"[1]"),
            ("{\"prompt_token_ids\": [1.5]}", "not a token id"),
            ("{\"prompt_token_ids\": \"1 2\"}", "must be an array"),
            ("{\"prompt_token_ids\": []}", "the prompt is empty"),
            ("{\"prompt\": \"\"}", "the prompt is empty"),
            ("{\"prompt\": \"a\", \"max_tokens\": 0}", "at least 1"),
            (
                "{\"prompt\": \"a\", \"max_tokens\": \"8\"}",
                "not a positive integer",
            ),
            ("{\"prompt\": \"a\", \"prompt_token_ids\": [1]}", "not both"),
        ];
        for (bad, why) in cases {
            let err = err_of(&format!("{good}{good}{bad}\n{good}"));
            assert!(err.starts_with("line 3: "), "{bad}: {err}");
            assert!(err.contains(why), "{bad}: {err}");
        }
    }

    #[test]
    fn an_empty_dataset_is_an_error() {
        assert!(err_of("").contains("empty"));
        assert!(err_of("\n  \n").contains("empty"));
    }

    #[test]
    fn a_missing_file_is_named() {
        let err = load_dataset(Path::new("/no/such/dataset.jsonl")).unwrap_err();
        assert!(
            format!("{err:#}").contains("/no/such/dataset.jsonl"),
            "{err:#}"
        );
    }

    #[test]
    fn random_requests_are_seeded_and_in_vocab() {
        let a = random_requests(3, 5, 7, 11, 42);
        let b = random_requests(3, 5, 7, 11, 42);
        let c = random_requests(3, 5, 7, 11, 43);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_eq!(a.len(), 3);
        for r in &a {
            assert_eq!(r.prompt_token_ids.len(), 5);
            assert_eq!(r.max_tokens, 7);
            assert!(r.prompt_token_ids.iter().all(|&t| t < 11));
        }
    }

    #[test]
    fn rows_become_requests_with_text_tokenized_and_lengths_resolved() {
        use vllm_fixtures::{write_tiny_model, TinyModelSpec};
        let dir = tempfile::tempdir().unwrap();
        write_tiny_model(dir.path(), &TinyModelSpec::qwen3_tiny()).unwrap();
        let tokenizer = Tokenizer::from_model_dir(dir.path()).unwrap();
        let rows = parse_dataset(
            "{\"prompt_token_ids\": [5, 6], \"max_tokens\": 3}\n{\"prompt\": \"Hello\"}",
        )
        .unwrap();
        let err = to_requests(&rows, &tokenizer, None).unwrap_err();
        assert!(
            err.to_string().starts_with("line 2: no \"max_tokens\""),
            "{err}"
        );
        let reqs = to_requests(&rows, &tokenizer, Some(4)).unwrap();
        assert_eq!(reqs[0].prompt_token_ids, vec![5, 6]);
        assert_eq!(reqs[0].max_tokens, 4);
        assert_eq!(reqs[0].origin, "line 1");
        assert_eq!(
            reqs[1].prompt_token_ids,
            tokenizer.encode("Hello", true).unwrap()
        );
        assert!(!reqs[1].prompt_token_ids.is_empty());
        assert_eq!(reqs[1].max_tokens, 4);
        let rows = &rows[..1];
        assert_eq!(
            to_requests(rows, &tokenizer, None).unwrap()[0].max_tokens,
            3
        );
    }

    #[test]
    fn requests_are_checked_against_the_engine_limits() {
        let req = |ids: Vec<u32>, max_tokens| BenchRequest {
            origin: "line 9".into(),
            prompt_token_ids: ids,
            max_tokens,
        };
        assert!(check_requests(&[req(vec![1, 2], 6)], 100, 8).is_ok());
        let e = check_requests(&[req(vec![1, 200], 1)], 100, 8).unwrap_err();
        assert!(e.to_string().contains("line 9: token id 200"), "{e}");
        let e = check_requests(&[req(vec![1; 8], 1)], 100, 8).unwrap_err();
        assert!(
            e.to_string().contains("line 9: the prompt has 8 tokens"),
            "{e}"
        );
        let e = check_requests(&[req(vec![1, 2], 7)], 100, 8).unwrap_err();
        assert!(e.to_string().contains("plus max_tokens 7"), "{e}");
    }
}
