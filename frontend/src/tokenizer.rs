//! The model's tokenizer: `tokenizer.json` through the `tokenizers` crate, plus the facts of
//! `tokenizer_config.json` the frontend needs (eos/bos tokens, `add_bos_token`, the raw
//! chat template strings, kept for the chat templating code); or, for a GGUF model, the
//! same rebuilt from the file's metadata (`gguf_tokenizer`).
//!
//! Cheap to clone: the loaded tokenizer sits behind an `Arc`, so every request's
//! detokenizer can hold one.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;

use anyhow::{anyhow, bail, Context};
use serde_json::Value;
use vllm_worker::model_path::ModelPath;
use vllm_worker::weights::gguf::GgufFile;

/// A chat template from `tokenizer_config.json` (or `chat_template.jinja`), unrendered.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatTemplate {
    /// "default" for a template given as a plain string.
    pub name: String,
    pub template: String,
}

#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
    eos_token: Option<String>,
    bos_token: Option<String>,
    eos_token_id: Option<u32>,
    bos_token_id: Option<u32>,
    add_bos_token: Option<bool>,
    chat_templates: Vec<ChatTemplate>,
    special_token_ids: Arc<BTreeSet<u32>>,
    /// tokenizers' `get_vocab_size(true)` builds the whole vocabulary map: counted once.
    vocab_size: usize,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("eos_token", &self.eos_token)
            .field("bos_token", &self.bos_token)
            .finish_non_exhaustive()
    }
}

/// The parts of `tokenizer_config.json` we read.
#[derive(Debug, Default)]
pub(crate) struct TokenizerConfig {
    pub(crate) eos_token: Option<String>,
    pub(crate) bos_token: Option<String>,
    pub(crate) add_bos_token: Option<bool>,
    pub(crate) chat_templates: Vec<ChatTemplate>,
}

impl Tokenizer {
    /// Loads `tokenizer.json` and, when present, `tokenizer_config.json` and
    /// `chat_template.jinja` from a Hugging Face model folder; or the tokenizer in the
    /// metadata of the GGUF file that `dir` names (`ModelPath`).
    pub fn from_model_dir(dir: &Path) -> anyhow::Result<Tokenizer> {
        if let Ok(ModelPath::Gguf(file)) = ModelPath::resolve(dir) {
            return Self::from_gguf(&file);
        }
        let json_path = dir.join("tokenizer.json");
        if !json_path.is_file() {
            bail!("no tokenizer.json in {}", dir.display());
        }
        let inner = tokenizers::Tokenizer::from_file(&json_path)
            .map_err(|e| anyhow!("cannot load {}: {e}", json_path.display()))?;
        let mut config = read_config(&dir.join("tokenizer_config.json"))?;
        let jinja = dir.join("chat_template.jinja");
        if config.chat_templates.is_empty() && jinja.is_file() {
            let template = std::fs::read_to_string(&jinja)
                .with_context(|| format!("cannot read {}", jinja.display()))?;
            config.chat_templates.push(ChatTemplate {
                name: "default".into(),
                template,
            });
        }
        Ok(Self::new(inner, config))
    }

    /// The tokenizer of GGUF file `path`, from its metadata.
    pub fn from_gguf(path: &Path) -> anyhow::Result<Tokenizer> {
        let file = GgufFile::open(path)?;
        let (inner, config) = crate::gguf_tokenizer::from_gguf(&file)?;
        Ok(Self::new(inner, config))
    }

    fn new(inner: tokenizers::Tokenizer, config: TokenizerConfig) -> Tokenizer {
        let special_token_ids = inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, token)| token.special)
            .map(|(id, _)| id)
            .collect();
        let id_of = |t: &Option<String>| t.as_deref().and_then(|t| inner.token_to_id(t));
        Tokenizer {
            vocab_size: inner.get_vocab_size(true),
            eos_token_id: id_of(&config.eos_token),
            bos_token_id: id_of(&config.bos_token),
            eos_token: config.eos_token,
            bos_token: config.bos_token,
            add_bos_token: config.add_bos_token,
            chat_templates: config.chat_templates,
            special_token_ids: Arc::new(special_token_ids),
            inner: Arc::new(inner),
        }
    }

    /// Token ids of `text`; with `add_special_tokens` the tokenizer's post-processor adds
    /// what the model expects (Llama 3's bos, for example).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> anyhow::Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| anyhow!("cannot tokenize text: {e}"))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text of `ids`. Ids outside the vocabulary are skipped; bytes that do not form UTF-8
    /// become U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> anyhow::Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| anyhow!("cannot decode token ids: {e}"))
    }

    /// Number of tokens, added tokens included (the model's embedding may be larger).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token's string in the vocabulary (byte-level BPE spells a space as "Ġ").
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token_id
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    /// `add_bos_token` of tokenizer_config.json, when it says.
    pub fn add_bos_token(&self) -> Option<bool> {
        self.add_bos_token
    }

    pub fn special_token_ids(&self) -> &BTreeSet<u32> {
        &self.special_token_ids
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.special_token_ids.contains(&id)
    }

    /// All chat templates, in the order the config lists them.
    pub fn chat_templates(&self) -> &[ChatTemplate] {
        &self.chat_templates
    }

    /// The template of that name, or the "default" one when `name` is None.
    pub fn chat_template(&self, name: Option<&str>) -> Option<&str> {
        let name = name.unwrap_or("default");
        self.chat_templates
            .iter()
            .find(|t| t.name == name)
            .map(|t| t.template.as_str())
    }
}

/// Reads `tokenizer_config.json`; a missing file means no config, a malformed one is an
/// error.
fn read_config(path: &Path) -> anyhow::Result<TokenizerConfig> {
    if !path.is_file() {
        return Ok(TokenizerConfig::default());
    }
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let json: Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    parse_config(&json).with_context(|| format!("malformed {}", path.display()))
}

fn parse_config(json: &Value) -> anyhow::Result<TokenizerConfig> {
    Ok(TokenizerConfig {
        eos_token: special_token(json, "eos_token")?,
        bos_token: special_token(json, "bos_token")?,
        add_bos_token: match json.get("add_bos_token") {
            None | Some(Value::Null) => None,
            Some(Value::Bool(b)) => Some(*b),
            Some(other) => bail!("add_bos_token must be a boolean, got {other}"),
        },
        chat_templates: chat_templates(json.get("chat_template"))?,
    })
}

/// A special token is written either as its string or as an AddedToken object
/// `{"content": ..., ...}`.
fn special_token(json: &Value, key: &str) -> anyhow::Result<Option<String>> {
    match json.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Object(o)) => match o.get("content") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => bail!("{key} is an object without a string \"content\""),
        },
        Some(other) => bail!("{key} must be a string or an object, got {other}"),
    }
}

/// `chat_template` is a string, or a list of `{"name", "template"}`.
fn chat_templates(value: Option<&Value>) -> anyhow::Result<Vec<ChatTemplate>> {
    match value {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![ChatTemplate {
            name: "default".into(),
            template: s.clone(),
        }]),
        Some(Value::Array(items)) => items.iter().map(named_template).collect(),
        Some(_) => bail!("chat_template must be a string or a list of {{name, template}}"),
    }
}

fn named_template(item: &Value) -> anyhow::Result<ChatTemplate> {
    match (item.get("name"), item.get("template")) {
        (Some(Value::String(name)), Some(Value::String(template))) => Ok(ChatTemplate {
            name: name.clone(),
            template: template.clone(),
        }),
        _ => bail!("each chat_template entry needs a string \"name\" and \"template\""),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::path::PathBuf;

    /// A reference model folder (configuration and tokenizer files, no weights) from
    /// `tests/data/models/<name>`, whose `tokenizer.json` is stored gzipped: it is
    /// decompressed once into `<temp>/vllm-rs-test-models/<name>-<crc32>` (the gzip
    /// trailer's CRC, so a changed file gets a fresh folder) and reused by later runs.
    /// Panics when the data is missing, since the tests are meaningless without it.
    pub(crate) fn model_dir(name: &str) -> PathBuf {
        static DIRS: std::sync::Mutex<BTreeMap<String, PathBuf>> =
            std::sync::Mutex::new(BTreeMap::new());
        let mut dirs = DIRS.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(dir) = dirs.get(name) {
            return dir.clone();
        }
        let src = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/data/models")
            .join(name);
        let dir = unpack_model(&src, name)
            .unwrap_or_else(|e| panic!("reference model {}: {e:#}", src.display()));
        dirs.insert(name.to_string(), dir.clone());
        dir
    }

    fn unpack_model(src: &Path, name: &str) -> anyhow::Result<PathBuf> {
        use anyhow::Context;
        use std::io::Read;
        let gz_path = src.join("tokenizer.json.gz");
        let gz = std::fs::read(&gz_path).with_context(|| format!("{}", gz_path.display()))?;
        anyhow::ensure!(gz.len() > 8, "{} is truncated", gz_path.display());
        let crc = u32::from_le_bytes(gz[gz.len() - 8..gz.len() - 4].try_into()?);
        let root = std::env::temp_dir().join("vllm-rs-test-models");
        let dir = root.join(format!("{name}-{crc:08x}"));
        if dir.join("tokenizer.json").is_file() {
            return Ok(dir);
        }
        std::fs::create_dir_all(&root)?;
        // Unpack into a private folder, then rename it into place: a concurrent test
        // process never sees a half-written folder.
        let tmp = tempfile::Builder::new()
            .prefix(&format!(".{name}-"))
            .tempdir_in(&root)?;
        let mut json = Vec::new();
        flate2::read::GzDecoder::new(&gz[..]).read_to_end(&mut json)?;
        std::fs::write(tmp.path().join("tokenizer.json"), json)?;
        for entry in std::fs::read_dir(src)? {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "json") {
                std::fs::copy(&path, tmp.path().join(path.file_name().unwrap()))?;
            }
        }
        let tmp = tmp.keep();
        if std::fs::rename(&tmp, &dir).is_err() {
            // Another process got there first; its folder is as good as ours.
            let _ = std::fs::remove_dir_all(&tmp);
            anyhow::ensure!(
                dir.join("tokenizer.json").is_file(),
                "cannot create {}",
                dir.display()
            );
        }
        Ok(dir)
    }

    pub(crate) fn load(name: &str) -> Tokenizer {
        Tokenizer::from_model_dir(&model_dir(name)).expect("reference tokenizer loads")
    }

    #[test]
    fn qwen_encodes_hello_world() {
        for name in ["Qwen3-0.6B", "Qwen2.5-0.5B-Instruct"] {
            let tok = load(name);
            assert_eq!(tok.encode("Hello world", false).unwrap(), [9707, 1879]);
            assert_eq!(tok.encode("Hello world", true).unwrap(), [9707, 1879]);
            assert_eq!(tok.eos_token(), Some("<|im_end|>"));
            assert_eq!(tok.eos_token_id(), Some(151645));
            assert_eq!(tok.bos_token_id(), None);
            assert_eq!(tok.add_bos_token(), Some(false));
            assert!(tok.is_special(151645));
            assert!(!tok.is_special(9707));
            assert!(tok
                .chat_template(None)
                .is_some_and(|t| t.contains("im_start")));
        }
    }

    #[test]
    fn llama_encodes_hello_world_and_prepends_bos() {
        let tok = load("Llama-3.2-1B-Instruct");
        assert_eq!(tok.encode("Hello world", false).unwrap(), [9906, 1917]);
        assert_eq!(
            tok.encode("Hello world", true).unwrap(),
            [128000, 9906, 1917]
        );
        assert_eq!(tok.bos_token_id(), Some(128000));
        assert_eq!(tok.eos_token(), Some("<|eot_id|>"));
        assert_eq!(tok.eos_token_id(), Some(128009));
        assert_eq!(tok.vocab_size(), 128256);
        assert!(tok.special_token_ids().contains(&128000));
    }

    #[test]
    fn decode_and_lookups_round_trip() {
        let tok = load("Qwen3-0.6B");
        let ids = tok.encode("Hello world <|im_end|>", false).unwrap();
        assert_eq!(ids.last(), Some(&151645));
        assert_eq!(tok.decode(&ids, false).unwrap(), "Hello world <|im_end|>");
        assert_eq!(tok.decode(&ids, true).unwrap(), "Hello world ");
        assert_eq!(tok.id_to_token(1879).as_deref(), Some("Ġworld"));
        assert_eq!(tok.token_to_id("Ġworld"), Some(1879));
        assert_eq!(tok.token_to_id("<|im_end|>"), Some(151645));
    }

    #[test]
    fn config_accepts_object_tokens_and_named_templates() {
        let json = serde_json::json!({
            "eos_token": {"content": "</s>", "lstrip": false},
            "bos_token": "<s>",
            "add_bos_token": true,
            "chat_template": [
                {"name": "default", "template": "A"},
                {"name": "tool_use", "template": "B"}
            ]
        });
        let config = parse_config(&json).unwrap();
        assert_eq!(config.eos_token.as_deref(), Some("</s>"));
        assert_eq!(config.bos_token.as_deref(), Some("<s>"));
        assert_eq!(config.add_bos_token, Some(true));
        assert_eq!(config.chat_templates.len(), 2);
        assert_eq!(config.chat_templates[1].name, "tool_use");
    }

    #[test]
    fn malformed_files_give_clear_errors() {
        let bad = parse_config(&serde_json::json!({"eos_token": 3})).unwrap_err();
        assert!(bad.to_string().contains("eos_token"), "{bad}");
        let bad = parse_config(&serde_json::json!({"chat_template": [{"name": "x"}]}));
        assert!(bad.is_err());

        let dir = tempfile::tempdir().unwrap();
        let err = Tokenizer::from_model_dir(dir.path()).unwrap_err();
        assert!(err.to_string().starts_with("no tokenizer.json in"), "{err}");
        std::fs::write(dir.path().join("tokenizer.json"), "{").unwrap();
        let err = Tokenizer::from_model_dir(dir.path()).unwrap_err();
        assert!(err.to_string().starts_with("cannot load"), "{err}");

        let good = model_dir("Qwen3-0.6B").join("tokenizer.json");
        std::fs::copy(good, dir.path().join("tokenizer.json")).unwrap();
        std::fs::write(dir.path().join("tokenizer_config.json"), "not json").unwrap();
        let err = Tokenizer::from_model_dir(dir.path()).unwrap_err();
        assert!(err.to_string().contains("is not valid JSON"), "{err}");
    }
}
