//! Which files of a Hub repo a run needs, chosen from the repo's file list by the rules the
//! readers of a model folder follow (`ModelPath`, the tokenizer, the weight loader), so a
//! fetch downloads no more than is read: a repo's other formats (`*.bin`, `original/`,
//! a GGUF beside safetensors) and its README stay on the hub.

use std::path::Path;

use anyhow::{anyhow, bail};

use super::RepoId;

/// What a run reads from a repo.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want {
    /// A model: config, tokenizer and (unless `--load-format dummy`) its weights.
    Model { weights: bool },
    /// Only the tokenizer files (`--tokenizer`).
    Tokenizer,
}

/// The files to fetch. `index`, when set, is `model.safetensors.index.json`, to be fetched
/// first: the shards it names are fetched after it.
#[derive(Debug, PartialEq, Eq)]
pub struct Plan {
    pub files: Vec<String>,
    pub index: Option<String>,
}

const TOKENIZER_FILES: [&str; 3] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
];
const CONFIG_FILES: [&str; 2] = ["config.json", "generation_config.json"];
const INDEX: &str = "model.safetensors.index.json";

/// Picks from `repo_files` (the repo's `siblings`) what `want` needs. A repo with
/// `config.json` is a Hugging Face folder; one without must hold exactly one top-level
/// `.gguf` (as `ModelPath` reads a folder).
pub fn select(id: &RepoId, repo_files: &[String], want: Want) -> anyhow::Result<Plan> {
    let has = |name: &str| repo_files.iter().any(|f| f == name);
    let present = |names: &[&str]| -> Vec<String> {
        names
            .iter()
            .filter(|n| has(n))
            .map(|n| n.to_string())
            .collect()
    };
    // Only top-level files: a repo's subfolders hold other formats or other models.
    let top_level = |ext: &str| -> Vec<String> {
        let mut found: Vec<String> = repo_files
            .iter()
            .filter(|f| !f.contains('/') && f.to_ascii_lowercase().ends_with(ext))
            .cloned()
            .collect();
        found.sort();
        found
    };
    let weights = match want {
        Want::Tokenizer => {
            if !has("tokenizer.json") {
                bail!("{id} has no tokenizer.json, so it cannot serve as --tokenizer");
            }
            return Ok(Plan {
                files: present(&TOKENIZER_FILES),
                index: None,
            });
        }
        Want::Model { weights } => weights,
    };
    if !has("config.json") {
        let ggufs = top_level(".gguf");
        return match ggufs.len() {
            1 => Ok(Plan {
                files: ggufs,
                index: None,
            }),
            0 => Err(anyhow!(
                "{id} holds neither config.json nor a .gguf file; vllm-rs reads Hugging Face \
                 folders (config.json, safetensors) and GGUF files"
            )),
            n => Err(anyhow!(
                "{id} holds {n} .gguf files ({}); download the one you want and pass its path \
                 as --model",
                ggufs.join(", ")
            )),
        };
    }
    let mut files = present(&CONFIG_FILES);
    files.extend(present(&TOKENIZER_FILES));
    if !weights {
        return Ok(Plan { files, index: None });
    }
    // As the weight loader reads a folder: the index's shards, else model.safetensors, else
    // every *.safetensors.
    if has(INDEX) {
        return Ok(Plan {
            files,
            index: Some(INDEX.to_string()),
        });
    }
    let safetensors = if has("model.safetensors") {
        vec!["model.safetensors".to_string()]
    } else {
        top_level(".safetensors")
    };
    if safetensors.is_empty() {
        bail!(
            "{id} has no .safetensors weights (vllm-rs reads safetensors and GGUF, not \
             PyTorch .bin files); pass --load-format dummy for random weights"
        );
    }
    files.extend(safetensors);
    Ok(Plan { files, index: None })
}

/// The shard files that `model.safetensors.index.json` at `path` names, each once (as the
/// worker reads the index), each a plain file name inside the snapshot.
pub fn index_shards(path: &Path) -> anyhow::Result<Vec<String>> {
    let shards = vllm_worker::weights::index_shards(path)?;
    if let Some(bad) = shards.iter().find(|f| !is_plain_file_name(f)) {
        bail!("{}: unexpected shard name {bad:?}", path.display());
    }
    Ok(shards)
}

/// A name that stays inside the snapshot folder: relative, no `..`, no empty parts.
pub fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with('/')
        && !name.contains('\\')
        && name
            .split('/')
            .all(|p| !p.is_empty() && p != "." && p != "..")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> RepoId {
        RepoId::parse("o/m").unwrap()
    }

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_safetensors_repo_fetches_config_tokenizer_and_weights_only() {
        let repo = names(&[
            ".gitattributes",
            "README.md",
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "model.safetensors",
            "pytorch_model.bin",
            "original/consolidated.safetensors",
            "model-q4.gguf",
        ]);
        let plan = select(&id(), &repo, Want::Model { weights: true }).unwrap();
        assert_eq!(
            plan.files,
            names(&[
                "config.json",
                "generation_config.json",
                "tokenizer.json",
                "tokenizer_config.json",
                "model.safetensors",
            ])
        );
        assert_eq!(plan.index, None);
        let dummy = select(&id(), &repo, Want::Model { weights: false }).unwrap();
        assert!(!dummy.files.iter().any(|f| f.ends_with(".safetensors")));
        let tok = select(&id(), &repo, Want::Tokenizer).unwrap();
        assert_eq!(
            tok.files,
            names(&["tokenizer.json", "tokenizer_config.json"])
        );
    }

    #[test]
    fn shards_come_from_the_index() {
        let repo = names(&[
            "config.json",
            "tokenizer.json",
            "model.safetensors.index.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "consolidated.safetensors",
        ]);
        let plan = select(&id(), &repo, Want::Model { weights: true }).unwrap();
        assert_eq!(plan.files, names(&["config.json", "tokenizer.json"]));
        assert_eq!(plan.index.as_deref(), Some(INDEX));

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(INDEX);
        std::fs::write(
            &path,
            r#"{"weight_map": {"a": "model-00002-of-00002.safetensors",
                "b": "model-00001-of-00002.safetensors", "c": "model-00001-of-00002.safetensors"}}"#,
        )
        .unwrap();
        assert_eq!(
            index_shards(&path).unwrap(),
            names(&[
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors"
            ])
        );
        std::fs::write(&path, r#"{"weight_map": {"a": "../../x.safetensors"}}"#).unwrap();
        assert!(index_shards(&path).is_err());
    }

    #[test]
    fn gguf_repos_and_missing_weights() {
        let one = names(&["README.md", "m.Q4_K_M.gguf"]);
        let plan = select(&id(), &one, Want::Model { weights: true }).unwrap();
        assert_eq!(plan.files, names(&["m.Q4_K_M.gguf"]));
        let two = names(&["b.Q8_0.gguf", "a.Q4_K_M.gguf"]);
        let err = select(&id(), &two, Want::Model { weights: true }).unwrap_err();
        assert!(
            err.to_string()
                .contains("2 .gguf files (a.Q4_K_M.gguf, b.Q8_0.gguf)"),
            "{err}"
        );
        let bin = names(&["config.json", "tokenizer.json", "pytorch_model.bin"]);
        let err = select(&id(), &bin, Want::Model { weights: true }).unwrap_err();
        assert!(err.to_string().contains("no .safetensors"), "{err}");
        assert!(select(&id(), &bin, Want::Model { weights: false }).is_ok());
        assert!(select(&id(), &names(&["README.md"]), Want::Tokenizer).is_err());
    }

    #[test]
    fn plain_file_names() {
        for ok in ["a.json", "sub/a.json"] {
            assert!(is_plain_file_name(ok), "{ok}");
        }
        for bad in ["", "/a", "../a", "a/../b", "a//b", "./a", "a\\b"] {
            assert!(!is_plain_file_name(bad), "{bad}");
        }
    }
}
