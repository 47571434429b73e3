//! `RepoCache`: one repo's folder in the Hugging Face cache, laid out exactly as
//! huggingface_hub lays it out, so that either tool reuses what the other fetched:
//!
//! ```text
//! {cache_root}/models--{owner}--{name}/
//!     refs/{revision}            the commit hash the revision (branch, tag) pointed at
//!     blobs/{etag}               each file's bytes, named by the hub's ETag
//!     snapshots/{commit}/{file}  a relative symlink to ../../blobs/{etag}
//! ```

use std::path::{Path, PathBuf};

use anyhow::Context;

use super::RepoId;

pub struct RepoCache {
    dir: PathBuf,
}

/// A full git commit hash (40 hex digits), which a revision may be instead of a branch.
pub fn is_commit_hash(revision: &str) -> bool {
    revision.len() == 40 && revision.bytes().all(|b| b.is_ascii_hexdigit())
}

impl RepoCache {
    pub fn new(cache_root: &Path, id: &RepoId) -> RepoCache {
        let name = format!("models--{}", id.as_str().replace('/', "--"));
        RepoCache {
            dir: cache_root.join(name),
        }
    }

    /// `models--{owner}--{name}`.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn snapshot_dir(&self, commit: &str) -> PathBuf {
        self.dir.join("snapshots").join(commit)
    }

    pub fn blob_path(&self, etag: &str) -> PathBuf {
        self.dir.join("blobs").join(etag)
    }

    /// Where a blob is written before it is complete; the process id keeps two concurrent
    /// downloads apart, and the rename that completes it is atomic.
    pub fn incomplete_path(&self, etag: &str) -> PathBuf {
        self.dir
            .join("blobs")
            .join(format!("{etag}.{}.incomplete", std::process::id()))
    }

    /// The commit `revision` names in the cache: itself when it is a commit hash, else what
    /// `refs/{revision}` holds.
    pub fn cached_commit(&self, revision: &str) -> Option<String> {
        if is_commit_hash(revision) {
            return Some(revision.to_ascii_lowercase());
        }
        let text = std::fs::read_to_string(self.dir.join("refs").join(revision)).ok()?;
        let commit = text.trim();
        is_commit_hash(commit).then(|| commit.to_string())
    }

    /// The snapshot folder of `revision`, if the cache holds one.
    pub fn cached_snapshot(&self, revision: &str) -> Option<PathBuf> {
        let dir = self.snapshot_dir(&self.cached_commit(revision)?);
        dir.is_dir().then_some(dir)
    }

    /// Whether `file` of `commit` is in the cache (its link resolves to a blob).
    pub fn has_file(&self, commit: &str, file: &str) -> bool {
        self.snapshot_dir(commit).join(file).is_file()
    }

    /// Records that `revision` points at `commit`.
    pub fn write_ref(&self, revision: &str, commit: &str) -> anyhow::Result<()> {
        let path = self.dir.join("refs").join(revision);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(&path, commit).with_context(|| format!("cannot write {}", path.display()))
    }

    /// Links `snapshots/{commit}/{file}` to `blobs/{etag}` by a relative symlink, replacing
    /// a link that is there already (say, a dangling one whose blob was deleted).
    pub fn link(&self, commit: &str, file: &str, etag: &str) -> anyhow::Result<()> {
        let link = self.snapshot_dir(commit).join(file);
        let parent = link.parent().unwrap_or(&self.dir);
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create {}", parent.display()))?;
        // From snapshots/{commit}/{a/b/file} back up to the repo folder: one `..` per
        // folder of the file's path, plus two.
        let depth = Path::new(file).components().count() + 1;
        let mut target = PathBuf::new();
        for _ in 0..depth {
            target.push("..");
        }
        target.push("blobs");
        target.push(etag);
        if std::fs::symlink_metadata(&link).is_ok() {
            std::fs::remove_file(&link)
                .with_context(|| format!("cannot replace {}", link.display()))?;
        }
        std::os::unix::fs::symlink(&target, &link)
            .with_context(|| format!("cannot link {}", link.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

    #[test]
    fn lays_out_refs_blobs_and_relative_links() {
        let root = tempfile::tempdir().unwrap();
        let id = RepoId::parse("someorg/tiny").unwrap();
        let cache = RepoCache::new(root.path(), &id);
        assert_eq!(cache.dir(), root.path().join("models--someorg--tiny"));
        assert_eq!(cache.cached_snapshot("main"), None);

        std::fs::create_dir_all(cache.blob_path("e1").parent().unwrap()).unwrap();
        std::fs::write(cache.blob_path("e1"), "{}").unwrap();
        cache.link(COMMIT, "config.json", "e1").unwrap();
        cache.link(COMMIT, "sub/dir/x.json", "e1").unwrap();
        let link = cache.snapshot_dir(COMMIT).join("config.json");
        assert_eq!(
            std::fs::read_link(&link).unwrap(),
            PathBuf::from("../../blobs/e1")
        );
        assert_eq!(
            std::fs::read_link(cache.snapshot_dir(COMMIT).join("sub/dir/x.json")).unwrap(),
            PathBuf::from("../../../../blobs/e1")
        );
        assert!(cache.has_file(COMMIT, "sub/dir/x.json"));
        assert_eq!(std::fs::read_to_string(&link).unwrap(), "{}");
        assert!(cache.has_file(COMMIT, "config.json"));
        assert!(!cache.has_file(COMMIT, "tokenizer.json"));

        // A branch needs its ref; a commit hash is its own.
        assert_eq!(cache.cached_snapshot("main"), None);
        assert_eq!(
            cache.cached_snapshot(COMMIT),
            Some(cache.snapshot_dir(COMMIT))
        );
        cache.write_ref("main", COMMIT).unwrap();
        cache.write_ref("refs/pr/1", COMMIT).unwrap();
        assert_eq!(
            cache.cached_snapshot("main"),
            Some(cache.snapshot_dir(COMMIT))
        );
        assert_eq!(cache.cached_commit("refs/pr/1").as_deref(), Some(COMMIT));

        // A link whose blob is gone is not a cached file, and is replaced by a new link.
        std::fs::remove_file(cache.blob_path("e1")).unwrap();
        assert!(!cache.has_file(COMMIT, "config.json"));
        std::fs::write(cache.blob_path("e2"), "[]").unwrap();
        cache.link(COMMIT, "config.json", "e2").unwrap();
        assert_eq!(std::fs::read_to_string(&link).unwrap(), "[]");
    }
}
