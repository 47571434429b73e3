//! Reading typed fields out of a request's JSON object. Every failure is a 400 whose
//! `param` is the field and whose message names the field, the value given and what is
//! allowed ("max_tokens must be an integer in [1, 32767], got -1."), as vLLM's messages do;
//! serde's wording ("invalid value: integer `-1`, expected u32") never reaches a client.
//! Fields outside the endpoint's list are refused rather than silently ignored, and `null`
//! counts as absent.

use serde_json::{Map, Value};

use super::body::kind_of;
use super::ApiError;

/// The fields of one request body.
pub struct Fields<'a> {
    object: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    /// Wraps `object`, refusing any field not in one of `known`.
    pub fn new(object: &'a Map<String, Value>, known: &[&[&str]]) -> Result<Self, ApiError> {
        if let Some(unknown) = object
            .keys()
            .find(|k| !known.iter().any(|list| list.contains(&k.as_str())))
        {
            return Err(ApiError::invalid_param(
                unknown.clone(),
                format!("Unsupported field `{unknown}`: vllm-rs does not implement it."),
            ));
        }
        Ok(Self { object })
    }

    /// The field's value; `None` when absent or null.
    pub fn get(&self, name: &str) -> Option<&'a Value> {
        self.object.get(name).filter(|v| !v.is_null())
    }

    /// An integer in `[min, max]`; `why` (may be empty) says where the bound comes from.
    pub fn int(&self, name: &str, min: i64, max: i64, why: &str) -> Result<Option<i64>, ApiError> {
        let Some(value) = self.get(name) else {
            return Ok(None);
        };
        int_in(value, min, max).map(Some).map_err(|()| {
            ApiError::invalid_param(name, out_of_range(name, "an integer", min, max, why, value))
        })
    }

    /// An integer in `[min, max]`, as a `u32` (both bounds must fit).
    pub fn u32(&self, name: &str, min: u32, max: u32, why: &str) -> Result<Option<u32>, ApiError> {
        Ok(self
            .int(name, min.into(), max.into(), why)?
            .and_then(|v| u32::try_from(v).ok()))
    }

    /// A number; `allowed` describes the range ("in (0, 1]"), which the sampling
    /// parameters' own validation enforces.
    pub fn number(&self, name: &str, allowed: &str) -> Result<Option<f32>, ApiError> {
        let Some(value) = self.get(name) else {
            return Ok(None);
        };
        match value.as_f64() {
            Some(v) => Ok(Some(v as f32)),
            None => Err(ApiError::invalid_param(
                name,
                format!("{name} must be a number {allowed}, got {}.", shown(value)),
            )),
        }
    }

    pub fn bool(&self, name: &str) -> Result<Option<bool>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(ApiError::invalid_param(
                name,
                format!("{name} must be true or false, got {}.", shown(other)),
            )),
        }
    }

    pub fn string(&self, name: &str) -> Result<Option<&'a str>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(other) => Err(ApiError::invalid_param(
                name,
                format!("{name} must be a string, got {}.", shown(other)),
            )),
        }
    }

    pub fn object(&self, name: &str) -> Result<Option<&'a Map<String, Value>>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Object(m)) => Ok(Some(m)),
            Some(other) => Err(ApiError::invalid_param(
                name,
                format!("{name} must be an object, got {}.", shown(other)),
            )),
        }
    }

    /// A list of token ids, each in `[0, vocab_size)`.
    pub fn token_ids(&self, name: &str, vocab_size: u32) -> Result<Option<Vec<u32>>, ApiError> {
        self.get(name)
            .map(|v| token_ids(name, v, vocab_size).map_err(|m| ApiError::invalid_param(name, m)))
            .transpose()
    }

    /// `stream_options.include_usage`, and that the options are only given with a stream.
    pub fn include_usage(&self, stream: bool) -> Result<bool, ApiError> {
        let Some(options) = self.object("stream_options")? else {
            return Ok(false);
        };
        if !stream {
            return Err(ApiError::invalid_param(
                "stream_options",
                "Stream options can only be defined when `stream=True`.",
            ));
        }
        match options.get("include_usage") {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(other) => Err(ApiError::invalid_param(
                "stream_options",
                format!(
                    "stream_options.include_usage must be true or false, got {}.",
                    shown(other)
                ),
            )),
        }
    }
}

/// `value` as an integer in `[min, max]`.
fn int_in(value: &Value, min: i64, max: i64) -> Result<i64, ()> {
    let v = value.as_i64().ok_or(())?;
    if (min..=max).contains(&v) {
        Ok(v)
    } else {
        Err(())
    }
}

fn out_of_range(name: &str, what: &str, min: i64, max: i64, why: &str, value: &Value) -> String {
    let why = if why.is_empty() {
        String::new()
    } else {
        format!(" ({why})")
    };
    format!(
        "{name} must be {what} in [{min}, {max}]{why}, got {}.",
        shown(value)
    )
}

/// A list of token ids, each in `[0, vocab_size)`; the message names the bad element.
pub fn token_ids(name: &str, value: &Value, vocab_size: u32) -> Result<Vec<u32>, String> {
    let Value::Array(items) = value else {
        return Err(format!(
            "{name} must be a list of token ids, got {}.",
            shown(value)
        ));
    };
    let max = i64::from(vocab_size) - 1;
    items
        .iter()
        .enumerate()
        .map(|(i, item)| match int_in(item, 0, max) {
            Ok(id) => Ok(id as u32),
            Err(()) => Err(format!(
                "{name}[{i}] must be a token id in [0, {max}] (the vocabulary has {vocab_size} tokens), got {}.",
                shown(item)
            )),
        })
        .collect()
}

/// A value as a message shows it: its JSON, cut short when long, and its kind.
pub fn shown(value: &Value) -> String {
    let json = value.to_string();
    let json = if json.chars().count() > 60 {
        format!("{}…", json.chars().take(60).collect::<String>())
    } else {
        json
    };
    match value {
        Value::Number(_) | Value::Bool(_) | Value::Null => json,
        other => format!("{} {json}", kind_of(other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fields(v: &Value) -> Fields<'_> {
        Fields::new(v.as_object().unwrap(), &[&["a", "b", "t"]]).unwrap()
    }

    #[test]
    fn messages_name_the_field_the_value_and_the_range() {
        let v = json!({"a": -1, "b": "x", "t": [1, 600]});
        let f = fields(&v);
        let e = f.u32("a", 1, 100, "").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("a"));
        assert_eq!(e.message, "a must be an integer in [1, 100], got -1.");
        let e = f.u32("b", 1, 64, "--max-num-seqs").unwrap_err();
        assert_eq!(
            e.message,
            "b must be an integer in [1, 64] (--max-num-seqs), got a string \"x\"."
        );
        let e = f.number("b", "in (0, 1]").unwrap_err();
        assert_eq!(
            e.message,
            "b must be a number in (0, 1], got a string \"x\"."
        );
        let e = f.token_ids("t", 512).unwrap_err();
        assert_eq!(
            e.message,
            "t[1] must be a token id in [0, 511] (the vocabulary has 512 tokens), got 600."
        );
        assert_eq!(f.bool("missing").unwrap(), None);
    }

    #[test]
    fn unknown_fields_are_refused_and_null_is_absent() {
        let v = json!({"a": null, "zzz": 1});
        let e = Fields::new(v.as_object().unwrap(), &[&["a"]])
            .err()
            .unwrap();
        assert_eq!(e.param.as_deref(), Some("zzz"));
        let v = json!({"a": null});
        let f = Fields::new(v.as_object().unwrap(), &[&["a"]]).unwrap();
        assert_eq!(f.u32("a", 0, 1, "").unwrap(), None);
    }
}
