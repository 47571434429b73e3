//! Hugging Face Hub ids as `--model` and `--tokenizer`. A value that names no local path and
//! reads as a repo id (`owner/name`, or a bare `name`) is found in, or fetched into, the
//! standard Hugging Face cache once, in the launcher, before anything reads the model; the
//! flags then name the local snapshot folder, so the argument checks, the tokenizer, the
//! engine-core and the workers only ever see local files.
//!
//! `settings` reads the environment (`HF_HOME`, `HF_HUB_CACHE`, `HF_ENDPOINT`, `HF_TOKEN`,
//! `HF_HUB_OFFLINE`), `cache` owns the cache's layout, `files` picks what to fetch from a
//! repo, and `download` talks HTTP to the hub.

mod cache;
mod download;
mod files;
mod settings;

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context};

pub use cache::RepoCache;
pub use files::Want;
pub use settings::HubSettings;

use crate::args::{EngineArgs, LoadFormat};
use download::{HubClient, HubError};

/// A Hugging Face repo id, checked against the hub's rules (huggingface_hub's
/// `validate_repo_id`): `owner/name` or `name`, each part of ASCII letters, digits, `_`, `-`
/// and `.`, starting and ending with a letter, digit or `_`, with no `--` or `..`, no
/// `.git` ending, and a name of at most 96 characters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoId(String);

impl RepoId {
    pub fn parse(value: &str) -> Option<RepoId> {
        let (owner, name) = match value.split_once('/') {
            Some((owner, name)) => (Some(owner), name),
            None => (None, value),
        };
        let part_ok = |p: &str| {
            let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
            !p.is_empty()
                && p.chars().all(|c| word(c) || c == '-' || c == '.')
                && p.starts_with(word)
                && p.ends_with(word)
        };
        let ok = owner.is_none_or(part_ok)
            && part_ok(name)
            && name.len() <= 96
            && !value.contains("--")
            && !value.contains("..")
            && !value.ends_with(".git");
        ok.then(|| RepoId(value.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for RepoId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The Hub id that a `--model` or `--tokenizer` value names, or None when it is to be read
/// as a local path: one that exists always is, and so is anything that is no valid repo id
/// (`./x`, `/abs/path`, `a/b/c`) or that ends in `.gguf` (a GGUF file is a local file).
pub fn hub_id(value: &Path) -> Option<RepoId> {
    if value.exists() {
        return None;
    }
    let text = value.to_str()?;
    if text.to_ascii_lowercase().ends_with(".gguf") {
        return None;
    }
    RepoId::parse(text)
}

/// Replaces a `--model` or `--tokenizer` that names a Hub id by the local snapshot folder of
/// that repo, fetching what is missing (or, with `HF_HUB_OFFLINE`, finding it in the cache
/// only). The id typed stays as `model_id`, the default served model name. Local paths are
/// left as they are; a process that reads no model does not call this.
pub fn resolve_model_args(args: &mut EngineArgs) -> anyhow::Result<()> {
    let model_id = hub_id(&args.model);
    let tokenizer_id = args.tokenizer.as_deref().and_then(hub_id);
    if model_id.is_none() && tokenizer_id.is_none() {
        return Ok(());
    }
    let settings = HubSettings::from_env()?;
    // The launcher has no runtime yet; one thread is all a download needs.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut model_dir = None;
    if let Some(id) = &model_id {
        let want = Want::Model {
            weights: args.load_format != LoadFormat::Dummy,
        };
        let dir = rt.block_on(snapshot(id, &args.revision, want, &settings))?;
        tracing::info!("--model {id}: {}", dir.display());
        args.model = dir.clone();
        args.model_id = Some(id.to_string());
        model_dir = Some(dir);
    }
    if let Some(id) = &tokenizer_id {
        let revision = args.tokenizer_revision.as_deref().unwrap_or("main");
        // The model's own snapshot already holds its tokenizer files.
        let same_as_model = model_id.as_ref() == Some(id) && revision == args.revision;
        let dir = match model_dir.filter(|_| same_as_model) {
            Some(dir) => dir,
            None => rt.block_on(snapshot(id, revision, Want::Tokenizer, &settings))?,
        };
        tracing::info!("--tokenizer {id}: {}", dir.display());
        args.tokenizer = Some(dir);
    }
    Ok(())
}

/// The local snapshot folder of `revision` of repo `id`, holding what `want` needs.
pub async fn snapshot(
    id: &RepoId,
    revision: &str,
    want: Want,
    settings: &HubSettings,
) -> anyhow::Result<PathBuf> {
    let cache = RepoCache::new(&settings.cache_root, id);
    if settings.offline {
        return cache.cached_snapshot(revision).ok_or_else(|| {
            anyhow!(
                "{id} (revision {revision}) is not in the Hugging Face cache ({} holds no snapshot \
                 of it) and HF_HUB_OFFLINE is set; fetch it where the hub is reachable, or pass a \
                 local folder",
                cache.dir().display()
            )
        });
    }
    let client = HubClient::new(settings)?;
    let info = match client.repo_info(id, revision).await {
        Ok(info) => info,
        Err(e) => {
            // As huggingface_hub does: when the hub is away (or failing), a snapshot cached
            // before serves. A hub that answers "not found" or "denied" is believed.
            let away = match &e {
                HubError::Unreachable(cause) => Some(cause.clone()),
                HubError::Status { status, .. } if status.is_server_error() => {
                    Some(format!("HTTP {status}"))
                }
                _ => None,
            };
            match (away, cache.cached_snapshot(revision)) {
                (Some(why), Some(dir)) => {
                    tracing::warn!(
                        "cannot reach {} ({why}); using the cached snapshot {}",
                        settings.endpoint,
                        dir.display()
                    );
                    return Ok(dir);
                }
                (Some(_), None) if matches!(e, HubError::Unreachable(_)) => bail!(
                    "{}, and it is neither a local path nor in the cache at {}; pass a local \
                     folder, or point HF_HOME at a cache that holds it",
                    e.into_error(id, revision, None, settings),
                    settings.cache_root.display()
                ),
                _ => return Err(e.into_error(id, revision, None, settings)),
            }
        }
    };
    let commit = info.sha.as_str();
    let files::Plan {
        files: mut fetched,
        index,
    } = files::select(id, &info.files, want)?;
    let fetch = |file: String| {
        let client = &client;
        let cache = &cache;
        async move {
            client
                .fetch_file(id, commit, &file, cache)
                .await
                .map_err(|e| e.into_error(id, revision, Some(&file), settings))
        }
    };
    if let Some(index) = index {
        fetch(index.clone()).await?;
        let shards = files::index_shards(&cache.snapshot_dir(commit).join(&index))?;
        for shard in shards {
            if !info.files.contains(&shard) {
                bail!("{id}: {index} names {shard}, which the repo does not hold");
            }
            if !fetched.contains(&shard) {
                fetched.push(shard);
            }
        }
    }
    for file in fetched {
        fetch(file).await?;
    }
    if revision != commit {
        cache
            .write_ref(revision, commit)
            .with_context(|| format!("cannot record {id}'s revision {revision} in the cache"))?;
    }
    Ok(cache.snapshot_dir(commit))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_ids_follow_the_hubs_rules() {
        for ok in [
            "Qwen/Qwen3-0.6B",
            "gpt2",
            "meta-llama/Llama-3.2-1B-Instruct",
            "someorg/tiny",
            "a_b/c.d",
            "_x/y_",
        ] {
            assert_eq!(RepoId::parse(ok).map(|r| r.0), Some(ok.to_string()), "{ok}");
        }
        for bad in [
            "",
            "./x",
            "../x",
            "/abs/path",
            "a/b/c",
            "a/",
            "/a",
            "-a/b",
            "a/b-",
            "a/.b",
            "a--b/c",
            "a/b..c",
            "a/b.git",
            "a b/c",
            "~/models/x",
            "a\\b",
            &"x".repeat(97),
        ] {
            assert_eq!(RepoId::parse(bad), None, "{bad:?}");
        }
        assert!(RepoId::parse(&"x".repeat(96)).is_some());
    }

    #[test]
    fn a_local_path_wins_over_an_id() {
        let dir = tempfile::tempdir().unwrap();
        let local = dir.path().join("someorg").join("tiny");
        std::fs::create_dir_all(&local).unwrap();
        // An absolute path is never an id, whether it exists or not.
        assert_eq!(hub_id(&local), None);
        assert_eq!(hub_id(&dir.path().join("nope")), None);
        // Unit tests run in the crate's folder: `src/hub` and `src` exist there, so they are
        // local paths though they read as ids; `src/nothing-here` does not, so it is an id.
        assert_eq!(hub_id(Path::new("src/hub")), None);
        assert_eq!(hub_id(Path::new("src")), None);
        assert_eq!(
            hub_id(Path::new("src/nothing-here")),
            RepoId::parse("src/nothing-here")
        );
        assert_eq!(hub_id(Path::new("./someorg/tiny")), None);
        assert_eq!(hub_id(Path::new("a/b/c")), None);
        assert_eq!(hub_id(Path::new("model.gguf")), None);
        assert_eq!(hub_id(Path::new("Model.GGUF")), None);
        assert_eq!(hub_id(Path::new("gpt2")), RepoId::parse("gpt2"));
    }
}
