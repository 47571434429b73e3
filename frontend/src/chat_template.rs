//! Hugging Face chat templates, rendered with minijinja the way transformers renders them
//! with jinja2: `trim_blocks` and `lstrip_blocks`, loop controls, Python string and dict
//! methods (`.strip()`, `.startswith()`, `.split()`, `.items()`, ... through
//! minijinja-contrib's pycompat), a `tojson` that writes what Python's `json.dumps` writes,
//! `raise_exception` and `strftime_now`.
//!
//! The context is transformers': `messages`, `add_generation_prompt`, `tools` (none),
//! `documents` (none), the `bos_token` / `eos_token` strings the tokenizer config has, and
//! the request's `chat_template_kwargs` (Qwen3's `enable_thinking`, Llama's `date_string`).
//! The rendered text already holds the special tokens the model wants, so it is tokenized
//! without adding any (as vLLM does).

use std::path::Path;

use anyhow::{anyhow, Context};
use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use serde_json::{Map, Value as Json};

use crate::tokenizer::Tokenizer;

const TEMPLATE_NAME: &str = "chat_template";

/// Roles a message may have (OpenAI's, `developer` and `function` included).
pub const ROLES: &[&str] = &[
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "function",
];

/// Context names a request's `chat_template_kwargs` may not replace.
const RESERVED_KWARGS: &[&str] = &[
    "messages",
    "add_generation_prompt",
    "continue_final_message",
];

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

/// What to render: normalized messages (see [`normalize_messages`]) and the options.
#[derive(Debug, Clone, Default)]
pub struct RenderOptions<'a> {
    pub add_generation_prompt: bool,
    pub continue_final_message: bool,
    pub kwargs: Option<&'a Map<String, Json>>,
}

/// A request that cannot be rendered: the client's fault (a 400), with the field to blame.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatTemplateError {
    pub param: &'static str,
    pub message: String,
}

impl std::fmt::Display for ChatTemplateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ChatTemplateError {}

fn bad(param: &'static str, message: impl Into<String>) -> ChatTemplateError {
    ChatTemplateError {
        param,
        message: message.into(),
    }
}

impl ChatTemplate {
    /// Compiles `source`; the special tokens are the tokenizer config's.
    pub fn new(
        source: &str,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> anyhow::Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| anyhow!("cannot compile the chat template: {e:#}"))?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.map(str::to_string),
            eos_token: eos_token.map(str::to_string),
        })
    }

    /// The template a server uses: `--chat-template FILE` when given, else the tokenizer's
    /// "default" one; `None` when there is neither (chat requests then fail with a 400).
    pub fn load(
        file: Option<&Path>,
        tokenizer: &Tokenizer,
    ) -> anyhow::Result<Option<ChatTemplate>> {
        let source = match file {
            Some(path) => std::fs::read_to_string(path)
                .with_context(|| format!("cannot read the chat template {}", path.display()))?,
            None => match tokenizer.chat_template(None) {
                Some(t) => t.to_string(),
                None => return Ok(None),
            },
        };
        let template = ChatTemplate::new(&source, tokenizer.bos_token(), tokenizer.eos_token());
        match (template, file) {
            (Ok(t), _) => Ok(Some(t)),
            (Err(e), Some(path)) => Err(e.context(format!("in {}", path.display()))),
            (Err(e), None) => {
                tracing::warn!("the model's chat template is unusable, chat is disabled: {e:#}");
                Ok(None)
            }
        }
    }

    /// Renders normalized `messages`.
    pub fn render(
        &self,
        messages: &[Json],
        options: &RenderOptions,
    ) -> Result<String, ChatTemplateError> {
        if options.add_generation_prompt && options.continue_final_message {
            return Err(bad(
                "continue_final_message",
                "continue_final_message and add_generation_prompt cannot both be true.",
            ));
        }
        let mut ctx: Map<String, Json> = Map::new();
        for (key, value) in options.kwargs.into_iter().flatten() {
            if RESERVED_KWARGS.contains(&key.as_str()) {
                return Err(bad(
                    "chat_template_kwargs",
                    format!("chat_template_kwargs may not set `{key}`."),
                ));
            }
            ctx.insert(key.clone(), value.clone());
        }
        for (key, token) in [
            ("bos_token", &self.bos_token),
            ("eos_token", &self.eos_token),
        ] {
            if let Some(token) = token {
                ctx.entry(key)
                    .or_insert_with(|| Json::String(token.clone()));
            }
        }
        ctx.entry("tools").or_insert(Json::Null);
        ctx.entry("documents").or_insert(Json::Null);
        ctx.insert("messages".into(), Json::Array(messages.to_vec()));
        ctx.insert(
            "add_generation_prompt".into(),
            Json::Bool(options.add_generation_prompt),
        );

        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| bad("messages", format!("chat template error: {e}")))?;
        let text = template
            .render(Value::from_serialize(&ctx))
            .map_err(|e| bad("messages", format!("chat template error: {}", describe(&e))))?;
        if options.continue_final_message {
            return continue_final(text, messages);
        }
        Ok(text)
    }
}

/// An error's message with its causes (raise_exception's message is the detail).
fn describe(e: &Error) -> String {
    let mut out = match e.detail() {
        Some(detail) if e.kind() == ErrorKind::InvalidOperation => detail.to_string(),
        _ => e.to_string(),
    };
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        out.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    out
}

/// transformers' `continue_final_message`: the rendering is cut right after the final
/// message's content, so the model continues it instead of starting a new turn.
fn continue_final(text: String, messages: &[Json]) -> Result<String, ChatTemplateError> {
    let final_message = messages
        .last()
        .and_then(|m| m.get("content"))
        .and_then(Json::as_str)
        .unwrap_or("");
    let stripped = final_message.trim();
    let Some(loc) = text.rfind(stripped) else {
        return Err(bad(
            "continue_final_message",
            "continue_final_message is set but the final message does not appear in the chat after applying the chat template.",
        ));
    };
    let lstripped = final_message.trim_start();
    let end = if text[loc..].starts_with(lstripped) {
        loc + lstripped.len()
    } else {
        loc + stripped.len()
    };
    Ok(text[..end].to_string())
}

/// Checks a request's `messages` and puts them in the shape templates expect: every
/// message an object with a known `role`; `content` a string, with a list of
/// `{"type": "text", "text"}` parts joined by newlines (vLLM's "string" content format) and
/// a null content (an assistant's tool call) made empty. Other fields pass through.
pub fn normalize_messages(messages: &Json) -> Result<Vec<Json>, ChatTemplateError> {
    let Some(list) = messages.as_array() else {
        return Err(bad(
            "messages",
            "messages must be a list of message objects.",
        ));
    };
    if list.is_empty() {
        return Err(bad("messages", "messages must not be empty."));
    }
    list.iter()
        .enumerate()
        .map(|(i, m)| normalize_message(i, m))
        .collect()
}

fn normalize_message(i: usize, message: &Json) -> Result<Json, ChatTemplateError> {
    let Some(object) = message.as_object() else {
        return Err(bad("messages", format!("messages[{i}] must be an object.")));
    };
    match object.get("role") {
        Some(Json::String(role)) if ROLES.contains(&role.as_str()) => {}
        Some(Json::String(role)) => {
            return Err(bad(
                "messages",
                format!(
                    "messages[{i}].role `{role}` is not one of {}.",
                    ROLES.join(", ")
                ),
            ))
        }
        _ => {
            return Err(bad(
                "messages",
                format!("messages[{i}] needs a string `role`."),
            ))
        }
    }
    let content = match object.get("content") {
        None | Some(Json::Null) => String::new(),
        Some(Json::String(s)) => s.clone(),
        Some(Json::Array(parts)) => {
            let mut texts = Vec::new();
            for (j, part) in parts.iter().enumerate() {
                texts.push(text_part(i, j, part)?);
            }
            texts.join("\n")
        }
        Some(_) => {
            return Err(bad(
                "messages",
                format!("messages[{i}].content must be a string or a list of content parts."),
            ))
        }
    };
    let mut out = object.clone();
    out.insert("content".into(), Json::String(content));
    Ok(Json::Object(out))
}

fn text_part(i: usize, j: usize, part: &Json) -> Result<String, ChatTemplateError> {
    let kind = part.get("type").and_then(Json::as_str);
    match (kind, part.get("text")) {
        (Some("text"), Some(Json::String(text))) => Ok(text.clone()),
        (Some("text"), _) => Err(bad(
            "messages",
            format!("messages[{i}].content[{j}] is a text part without a string `text`."),
        )),
        (Some(k @ ("image_url" | "image" | "image_pil" | "image_embeds" | "input_image")), _) => {
            Err(bad(
                "messages",
                format!("messages[{i}].content[{j}] is an image (`{k}`): image inputs are not supported, this server is text-only."),
            ))
        }
        (Some(k), _) => Err(bad(
            "messages",
            format!("messages[{i}].content[{j}] has type `{k}`: only text parts are supported."),
        )),
        (None, _) => Err(bad(
            "messages",
            format!("messages[{i}].content[{j}] needs a string `type`."),
        )),
    }
}

/// `raise_exception(message)`: the template refuses the conversation.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the local time, formatted by the C library's strftime (which
/// Python's `datetime.strftime` follows for the usual directives).
fn strftime_now(format: String) -> Result<String, Error> {
    let c_format = std::ffi::CString::new(format)
        .map_err(|_| Error::new(ErrorKind::InvalidOperation, "strftime_now: NUL in format"))?;
    // SAFETY: time/localtime_r/strftime with valid pointers; strftime writes at most
    // buf.len() bytes and returns how many it wrote.
    unsafe {
        let now = libc::time(std::ptr::null_mut());
        let mut tm: libc::tm = std::mem::zeroed();
        if libc::localtime_r(&now, &mut tm).is_null() {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "strftime_now: no local time",
            ));
        }
        let mut buf = vec![0u8; 256];
        let n = libc::strftime(buf.as_mut_ptr().cast(), buf.len(), c_format.as_ptr(), &tm);
        buf.truncate(n);
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)`, so `", "` and `": "` separate items, or
/// `","` and newlines with an indent.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => Some(" ".repeat(usize::try_from(v).unwrap_or(0))),
        },
    };
    let (item_sep, key_sep) = match &separators {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair",
            ))
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    let style = JsonStyle {
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    style.write(&json, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

struct JsonStyle {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl JsonStyle {
    fn newline(&self, depth: usize, out: &mut String) {
        if let Some(indent) = &self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(indent);
            }
        }
    }

    fn write(&self, value: &Json, depth: usize, out: &mut String) {
        match value {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Number(n) => out.push_str(&n.to_string()),
            Json::String(s) => self.write_str(s, out),
            Json::Array(items) if items.is_empty() => out.push_str("[]"),
            Json::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(depth + 1, out);
                    self.write(item, depth + 1, out);
                }
                self.newline(depth, out);
                out.push(']');
            }
            Json::Object(map) if map.is_empty() => out.push_str("{}"),
            Json::Object(map) => {
                let mut entries: Vec<(&String, &Json)> = map.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (key, item)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(depth + 1, out);
                    self.write_str(key, out);
                    out.push_str(&self.key_sep);
                    self.write(item, depth + 1, out);
                }
                self.newline(depth, out);
                out.push('}');
            }
        }
    }

    fn write_str(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && (c as u32) > 0x7e) => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::tests::{load, model_dir};
    use serde_json::json;

    fn render(
        source: &str,
        messages: Json,
        options: &RenderOptions,
    ) -> Result<String, ChatTemplateError> {
        let template = ChatTemplate::new(source, Some("<s>"), Some("</s>")).unwrap();
        template.render(&normalize_messages(&messages).unwrap(), options)
    }

    /// The reference renderings of scripts/make_chat_template_ids.py (Python jinja2 the way
    /// transformers sets it up, tokenized by the `tokenizers` package): same text, same ids.
    #[test]
    fn renders_like_hugging_face() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/chat_template_ids.json");
        let data: Json = serde_json::from_str(
            &std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
        )
        .unwrap();
        let cases = data["cases"].as_array().unwrap();
        assert!(cases.len() >= 15, "too few reference cases");
        let mut models_seen = std::collections::BTreeSet::new();
        for case in cases {
            let model = case["model"].as_str().unwrap();
            models_seen.insert(model.to_string());
            let name = format!("{model}/{}", case["case"].as_str().unwrap());
            let tok = load(model);
            let _ = model_dir(model);
            let template = ChatTemplate::load(None, &tok)
                .unwrap()
                .expect("model has a template");
            let messages = normalize_messages(&case["messages"]).unwrap();
            let options = RenderOptions {
                add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
                continue_final_message: case["continue_final_message"].as_bool().unwrap(),
                kwargs: case["chat_template_kwargs"].as_object(),
            };
            let text = template
                .render(&messages, &options)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(text, case["text"].as_str().unwrap(), "{name}: text differs");
            let ids: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
            assert_eq!(tok.encode(&text, false).unwrap(), ids, "{name}: ids differ");
        }
        assert_eq!(models_seen.len(), 3, "{models_seen:?}");
    }

    #[test]
    fn pycompat_loop_controls_and_raise_exception() {
        let source = "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}\
            {{ m.content.strip().upper() }}|{{ m.content.startswith(' a') }}|{{ m.content.split(',')[1] }};\
            {% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}\
            {% for k, v in extra.items() %}{{ k }}={{ v }}{% endfor %}";
        let kwargs = json!({"extra": {"x": 1}});
        let text = render(
            source,
            json!([
                {"role": "system", "content": "skip"},
                {"role": "user", "content": " a,b "},
                {"role": "user", "content": "c,d"},
                {"role": "user", "content": "never"}
            ]),
            &RenderOptions {
                kwargs: kwargs.as_object(),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(text, "A,B|True|b ;C,D|False|d;x=1");

        let err = render(
            "{{ raise_exception('Only user roles here') }}",
            json!([{"role": "user", "content": "x"}]),
            &RenderOptions::default(),
        )
        .unwrap_err();
        assert!(err.message.contains("Only user roles here"), "{err}");
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let kwargs = json!({"obj": {"b": [1, 2.5, "é\"\n"], "a": null, "c": true}});
        let out = render(
            "{{ obj | tojson }}#{{ obj | tojson(indent=2) }}#{{ obj.b | tojson(ensure_ascii=true) }}",
            json!([{"role": "user", "content": "x"}]),
            &RenderOptions {
                kwargs: kwargs.as_object(),
                ..Default::default()
            },
        )
        .unwrap();
        let (flat, rest) = out.split_once('#').unwrap();
        let (indented, ascii) = rest.split_once('#').unwrap();
        // serde_json sorts keys here; Python would keep insertion order: both sorted.
        assert_eq!(flat, r#"{"a": null, "b": [1, 2.5, "é\"\n"], "c": true}"#);
        assert_eq!(indented, "{\n  \"a\": null,\n  \"b\": [\n    1,\n    2.5,\n    \"é\\\"\\n\"\n  ],\n  \"c\": true\n}");
        assert_eq!(ascii, r#"[1, 2.5, "\u00e9\"\n"]"#);
    }

    #[test]
    fn strftime_now_formats_today() {
        let out = render(
            "{{ strftime_now('%Y') }}",
            json!([{"role": "user", "content": "x"}]),
            &RenderOptions::default(),
        )
        .unwrap();
        assert_eq!(out.len(), 4);
        assert!(out.starts_with("20"), "{out}");
    }

    #[test]
    fn messages_are_checked_and_parts_joined() {
        let ok = normalize_messages(&json!([
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "n"},
            {"role": "assistant", "content": null}
        ]))
        .unwrap();
        assert_eq!(
            ok[0],
            json!({"role": "user", "content": "a\nb", "name": "n"})
        );
        assert_eq!(ok[1]["content"], "");

        let err = |m: Json| normalize_messages(&m).unwrap_err().message;
        assert!(err(json!([])).contains("must not be empty"));
        assert!(err(json!("hi")).contains("must be a list"));
        assert!(err(json!([{"role": "wizard", "content": "x"}])).contains("`wizard` is not one of"));
        assert!(err(json!([{"content": "x"}])).contains("needs a string `role`"));
        assert!(err(json!([{"role": "user", "content": 3}])).contains("must be a string or a list"));
        let image = json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]);
        assert!(err(image).contains("image inputs are not supported"));
    }

    #[test]
    fn continue_final_message_and_reserved_kwargs() {
        let chatml =
            "{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}<|end|>{% endfor %}\
            {% if add_generation_prompt %}<|assistant|>{% endif %}";
        let msgs = json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon "}]);
        let cont = RenderOptions {
            continue_final_message: true,
            ..Default::default()
        };
        assert_eq!(
            render(chatml, msgs.clone(), &cont).unwrap(),
            "<|user|>hi<|end|><|assistant|>Once upon"
        );
        let both = RenderOptions {
            add_generation_prompt: true,
            continue_final_message: true,
            kwargs: None,
        };
        assert_eq!(
            render(chatml, msgs.clone(), &both).unwrap_err().param,
            "continue_final_message"
        );
        let kwargs = json!({"messages": []});
        let reserved = RenderOptions {
            kwargs: kwargs.as_object(),
            ..Default::default()
        };
        assert_eq!(
            render(chatml, msgs, &reserved).unwrap_err().param,
            "chat_template_kwargs"
        );
    }

    #[test]
    fn chat_template_file_overrides_the_tokenizers() {
        let tok = load("Qwen2.5-0.5B-Instruct");
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("t.jinja");
        std::fs::write(
            &file,
            "{% for m in messages %}[{{ m.content }}]{% endfor %}{{ eos_token }}",
        )
        .unwrap();
        let t = ChatTemplate::load(Some(&file), &tok).unwrap().unwrap();
        let msgs = normalize_messages(&json!([{"role": "user", "content": "x"}])).unwrap();
        assert_eq!(
            t.render(&msgs, &RenderOptions::default()).unwrap(),
            "[x]<|im_end|>"
        );
        let missing = ChatTemplate::load(Some(&dir.path().join("nope")), &tok).unwrap_err();
        assert!(
            format!("{missing:#}").contains("cannot read the chat template"),
            "{missing:#}"
        );
        std::fs::write(&file, "{% for %}").unwrap();
        assert!(ChatTemplate::load(Some(&file), &tok).is_err());
    }
}
