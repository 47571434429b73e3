//! `HubSettings`: what the environment says about the Hugging Face Hub, read once and by
//! huggingface_hub's rules, so that a cache filled by Python tools is the one we read.
//!
//! - cache root: `$HF_HUB_CACHE`, else `$HF_HOME/hub`; `HF_HOME` defaults to
//!   `$XDG_CACHE_HOME/huggingface`, else `~/.cache/huggingface`;
//! - endpoint: `$HF_ENDPOINT`, else `https://huggingface.co`;
//! - token: `$HF_TOKEN`, else the file `$HF_TOKEN_PATH`, else `$HF_HOME/token` (where
//!   `huggingface-cli login` writes it);
//! - offline: `$HF_HUB_OFFLINE` is `1`, `true`, `yes` or `on` (any case).

use std::path::PathBuf;

use anyhow::bail;

pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

#[derive(Clone, PartialEq, Eq)]
pub struct HubSettings {
    /// The folder holding `models--{owner}--{name}` folders.
    pub cache_root: PathBuf,
    /// The hub's base URL, without a trailing `/`.
    pub endpoint: String,
    pub token: Option<String>,
    /// Never touch the network; use what the cache holds.
    pub offline: bool,
}

impl std::fmt::Debug for HubSettings {
    /// Says whether a token is set, never what it is.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HubSettings")
            .field("cache_root", &self.cache_root)
            .field("endpoint", &self.endpoint)
            .field("token", &self.token.as_ref().map(|_| "…"))
            .field("offline", &self.offline)
            .finish()
    }
}

impl HubSettings {
    pub fn from_env() -> anyhow::Result<HubSettings> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// The settings that environment `var` gives (empty values count as unset).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> anyhow::Result<HubSettings> {
        let var = |name: &str| var(name).filter(|v| !v.is_empty());
        let hf_home = match (var("HF_HOME"), var("XDG_CACHE_HOME"), var("HOME")) {
            (Some(home), _, _) => PathBuf::from(home),
            (None, Some(xdg), _) => PathBuf::from(xdg).join("huggingface"),
            (None, None, Some(home)) => PathBuf::from(home).join(".cache").join("huggingface"),
            (None, None, None) => bail!(
                "cannot place the Hugging Face cache: none of HF_HOME, XDG_CACHE_HOME and HOME is set"
            ),
        };
        let cache_root = var("HF_HUB_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| hf_home.join("hub"));
        let endpoint = var("HF_ENDPOINT")
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string())
            .trim_end_matches('/')
            .to_string();
        let token_file = var("HF_TOKEN_PATH")
            .map(PathBuf::from)
            .unwrap_or_else(|| hf_home.join("token"));
        let token = var("HF_TOKEN")
            .or_else(|| std::fs::read_to_string(&token_file).ok())
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty());
        let offline = var("HF_HUB_OFFLINE").is_some_and(|v| {
            ["1", "true", "yes", "on"]
                .iter()
                .any(|t| v.trim().eq_ignore_ascii_case(t))
        });
        Ok(HubSettings {
            cache_root,
            endpoint,
            token,
            offline,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(vars: &[(&str, &str)]) -> HubSettings {
        HubSettings::from_vars(|name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        })
        .unwrap()
    }

    #[test]
    fn the_cache_root_follows_huggingface_hub() {
        let s = settings(&[("HOME", "/home/u")]);
        assert_eq!(
            s.cache_root,
            PathBuf::from("/home/u/.cache/huggingface/hub")
        );
        assert_eq!(s.endpoint, "https://huggingface.co");
        assert!(!s.offline);
        let s = settings(&[("HOME", "/home/u"), ("XDG_CACHE_HOME", "/xdg")]);
        assert_eq!(s.cache_root, PathBuf::from("/xdg/huggingface/hub"));
        let s = settings(&[("HOME", "/home/u"), ("HF_HOME", "/hf")]);
        assert_eq!(s.cache_root, PathBuf::from("/hf/hub"));
        let s = settings(&[("HF_HOME", "/hf"), ("HF_HUB_CACHE", "/elsewhere")]);
        assert_eq!(s.cache_root, PathBuf::from("/elsewhere"));
        let s = settings(&[("HF_HOME", ""), ("HOME", "/home/u")]);
        assert_eq!(
            s.cache_root,
            PathBuf::from("/home/u/.cache/huggingface/hub")
        );
        assert!(HubSettings::from_vars(|_| None).is_err());
    }

    #[test]
    fn endpoint_offline_and_token() {
        let s = settings(&[("HF_HOME", "/nonexistent"), ("HF_ENDPOINT", "http://h:1/")]);
        assert_eq!(s.endpoint, "http://h:1");
        assert_eq!(s.token, None);
        for (value, offline) in [
            ("1", true),
            ("TRUE", true),
            ("yes", true),
            ("On", true),
            ("0", false),
            ("false", false),
            ("", false),
        ] {
            let s = settings(&[("HF_HOME", "/nonexistent"), ("HF_HUB_OFFLINE", value)]);
            assert_eq!(s.offline, offline, "HF_HUB_OFFLINE={value:?}");
        }

        let home = tempfile::tempdir().unwrap();
        let home_str = home.path().to_str().unwrap();
        std::fs::write(home.path().join("token"), "hf_file\n").unwrap();
        let s = settings(&[("HF_HOME", home_str)]);
        assert_eq!(s.token.as_deref(), Some("hf_file"));
        let s = settings(&[("HF_HOME", home_str), ("HF_TOKEN", "hf_env")]);
        assert_eq!(s.token.as_deref(), Some("hf_env"));
        let other = home.path().join("other");
        std::fs::write(&other, "hf_other").unwrap();
        let s = settings(&[
            ("HF_HOME", home_str),
            ("HF_TOKEN_PATH", other.to_str().unwrap()),
        ]);
        assert_eq!(s.token.as_deref(), Some("hf_other"));
        assert!(!format!("{s:?}").contains("hf_other"), "{s:?}");
    }
}
