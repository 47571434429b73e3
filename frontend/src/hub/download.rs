//! `HubClient`: the two HTTP calls a fetch makes, as huggingface_hub makes them.
//!
//! - `GET {endpoint}/api/models/{id}/revision/{revision}`: the commit (`sha`) the revision
//!   points at and the repo's files (`siblings[].rfilename`);
//! - `GET {endpoint}/{id}/resolve/{commit}/{file}`: the file. Large (LFS) files answer with
//!   a redirect to a CDN whose `X-Linked-Etag` names the blob; small ones answer at once
//!   with an `ETag`. Redirects are followed by hand, to read that header on the way and to
//!   send the token only to the hub itself.
//!
//! The token goes as `Authorization: Bearer …`. Connecting gives up after
//! [`CONNECT_TIMEOUT`], so an unreachable hub fails within seconds.

use std::io::Write;
use std::time::Duration;

use anyhow::anyhow;
use reqwest::header::{HeaderMap, AUTHORIZATION, ETAG, LOCATION};
use reqwest::{StatusCode, Url};

use super::cache::{is_commit_hash, RepoCache};
use super::files::is_plain_file_name;
use super::{HubSettings, RepoId};

pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a download may stall (no bytes at all) before it counts as lost.
const READ_TIMEOUT: Duration = Duration::from_secs(60);
const MAX_REDIRECTS: usize = 10;

/// Why a call to the hub failed.
#[derive(Debug)]
pub enum HubError {
    /// No answer at all: DNS, refused connection, timeout, TLS. Carries the innermost cause.
    Unreachable(String),
    /// The hub answered with an error status.
    Status {
        status: StatusCode,
        /// `X-Error-Code` (`RepoNotFound`, `RevisionNotFound`, `GatedRepo`, `EntryNotFound`).
        code: Option<String>,
        url: String,
    },
    Other(anyhow::Error),
}

impl From<anyhow::Error> for HubError {
    fn from(e: anyhow::Error) -> Self {
        HubError::Other(e)
    }
}

impl From<std::io::Error> for HubError {
    fn from(e: std::io::Error) -> Self {
        HubError::Other(e.into())
    }
}

/// What the API says of one revision of a repo.
#[derive(Debug)]
pub struct RepoInfo {
    /// The commit hash.
    pub sha: String,
    /// Every file of the repo at that commit, by its path in the repo.
    pub files: Vec<String>,
}

pub struct HubClient {
    http: reqwest::Client,
    endpoint: Url,
    token: Option<String>,
}

impl HubClient {
    pub fn new(settings: &HubSettings) -> anyhow::Result<HubClient> {
        let endpoint = Url::parse(&settings.endpoint)
            .map_err(|e| anyhow!("HF_ENDPOINT={} is not a URL: {e}", settings.endpoint))?;
        let http = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .read_timeout(READ_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("vllm-rs/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| anyhow!("cannot build the HTTP client: {e}"))?;
        Ok(HubClient {
            http,
            endpoint,
            token: settings.token.clone(),
        })
    }

    fn url(&self, path: &str) -> Result<Url, HubError> {
        let base = self.endpoint.as_str().trim_end_matches('/');
        Url::parse(&format!("{base}/{path}"))
            .map_err(|e| HubError::Other(anyhow!("bad hub URL {base}/{path}: {e}")))
    }

    /// A GET of `url`, with the token when `url` is on the hub itself.
    async fn get(&self, url: Url) -> Result<reqwest::Response, HubError> {
        let mut request = self.http.get(url.clone());
        if let Some(token) = self
            .token
            .as_ref()
            .filter(|_| url.origin() == self.endpoint.origin())
        {
            request = request.header(AUTHORIZATION, format!("Bearer {token}"));
        }
        request.send().await.map_err(|e| unreachable(&e))
    }

    pub async fn repo_info(&self, id: &RepoId, revision: &str) -> Result<RepoInfo, HubError> {
        #[derive(serde::Deserialize)]
        struct Sibling {
            rfilename: String,
        }
        #[derive(serde::Deserialize)]
        struct Info {
            sha: String,
            #[serde(default)]
            siblings: Vec<Sibling>,
        }
        let url = self.url(&format!(
            "api/models/{id}/revision/{}",
            encode(revision, false)
        ))?;
        let response = self.get(url.clone()).await?;
        let response = check(response)?;
        let body = response.bytes().await.map_err(|e| unreachable(&e))?;
        let info: Info = serde_json::from_slice(&body)
            .map_err(|e| anyhow!("{url} answered with unexpected JSON: {e}"))?;
        if !is_commit_hash(&info.sha) {
            return Err(
                anyhow!("{url} answered with sha {:?}, not a commit hash", info.sha).into(),
            );
        }
        Ok(RepoInfo {
            sha: info.sha.to_ascii_lowercase(),
            files: info.siblings.into_iter().map(|s| s.rfilename).collect(),
        })
    }

    /// Makes `snapshots/{commit}/{file}` of the cache a link to the file's blob,
    /// downloading the blob unless the cache holds it already. No request at all when the
    /// snapshot holds the file.
    pub async fn fetch_file(
        &self,
        id: &RepoId,
        commit: &str,
        file: &str,
        cache: &RepoCache,
    ) -> Result<(), HubError> {
        if cache.has_file(commit, file) {
            tracing::debug!("{id}: {file} is cached");
            return Ok(());
        }
        if !is_plain_file_name(file) {
            return Err(anyhow!("{id}: unexpected file name {file:?}").into());
        }
        let mut url = self.url(&format!("{id}/resolve/{commit}/{}", encode(file, true)))?;
        let mut linked = Linked::default();
        let mut response = None;
        for _ in 0..=MAX_REDIRECTS {
            let r = self.get(url.clone()).await?;
            if !r.status().is_redirection() {
                response = Some(r);
                break;
            }
            linked.read(r.headers());
            // The same bytes under another name (or another commit): no need to go on to
            // the CDN.
            if let Some(etag) = linked.etag.as_deref().filter(|e| is_blob_name(e)) {
                if cache.blob_path(etag).is_file() {
                    cache.link(commit, file, etag)?;
                    return Ok(());
                }
            }
            let location = r
                .headers()
                .get(LOCATION)
                .and_then(|v| v.to_str().ok())
                .ok_or_else(|| anyhow!("{url} redirects without a Location"))?;
            url = url
                .join(location)
                .map_err(|e| anyhow!("{url} redirects to a bad Location {location:?}: {e}"))?;
        }
        let Some(response) = response else {
            return Err(anyhow!("{id}: {file}: more than {MAX_REDIRECTS} redirects").into());
        };
        let mut response = check(response)?;
        linked.read(response.headers());
        let etag = linked
            .etag
            .or_else(|| header(response.headers(), ETAG.as_str()).map(normalize_etag))
            .ok_or_else(|| anyhow!("{url} answered {file} without an ETag"))?;
        if !is_blob_name(&etag) {
            return Err(anyhow!("{url} answered with an unusable ETag {etag:?}").into());
        }
        let blob = cache.blob_path(&etag);
        if !blob.is_file() {
            let size = response.content_length().or(linked.size);
            tracing::info!(
                "downloading {id} {file}{}",
                size.map(|s| format!(" ({})", indicatif::HumanBytes(s)))
                    .unwrap_or_default()
            );
            if let Some(parent) = blob.parent() {
                std::fs::create_dir_all(parent)?;
            }
            let partial = cache.incomplete_path(&etag);
            let result = write_body(&mut response, &partial, file, size).await;
            if let Err(e) = result {
                let _ = std::fs::remove_file(&partial);
                return Err(e);
            }
            std::fs::rename(&partial, &blob)?;
        }
        cache.link(commit, file, &etag)?;
        Ok(())
    }
}

/// Streams the response body into `path`, with a progress bar on stderr (drawn only when
/// stderr is a terminal). The file is written synchronously: the launcher does nothing
/// else while it fetches.
async fn write_body(
    response: &mut reqwest::Response,
    path: &std::path::Path,
    file: &str,
    size: Option<u64>,
) -> Result<(), HubError> {
    let bar = indicatif::ProgressBar::new(size.unwrap_or(0));
    let style = indicatif::ProgressStyle::with_template(
        "{msg} {bar:40} {bytes}/{total_bytes} {bytes_per_sec} [{elapsed_precise}<{eta_precise}]",
    )
    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    bar.set_style(style);
    bar.set_message(file.to_string());
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut written = 0u64;
    loop {
        let chunk = response.chunk().await.map_err(|e| {
            HubError::Other(anyhow!("the download of {file} broke off: {}", cause(&e)))
        })?;
        let Some(chunk) = chunk else { break };
        out.write_all(&chunk)?;
        written += chunk.len() as u64;
        bar.inc(chunk.len() as u64);
    }
    out.flush()?;
    bar.finish();
    match size {
        Some(size) if size != written => {
            Err(anyhow!("the download of {file} stopped at {written} of {size} bytes").into())
        }
        _ => Ok(()),
    }
}

/// The `X-Linked-Etag` and `X-Linked-Size` of an LFS file, from the first response that
/// carries them (the hub's redirect; the CDN's own ETag is not the blob's name).
#[derive(Default)]
struct Linked {
    etag: Option<String>,
    size: Option<u64>,
}

impl Linked {
    fn read(&mut self, headers: &HeaderMap) {
        if self.etag.is_none() {
            self.etag = header(headers, "x-linked-etag").map(normalize_etag);
        }
        if self.size.is_none() {
            self.size = header(headers, "x-linked-size").and_then(|s| s.parse().ok());
        }
    }
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// `W/"abc"` → `abc`, as huggingface_hub names blobs.
fn normalize_etag(etag: &str) -> String {
    etag.trim()
        .trim_start_matches("W/")
        .trim_matches('"')
        .to_string()
}

/// An ETag that is safe as a file name in `blobs/`.
fn is_blob_name(etag: &str) -> bool {
    !etag.is_empty()
        && !etag.starts_with('.')
        && etag
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

/// The response if its status is a success, else its status and `X-Error-Code`.
fn check(response: reqwest::Response) -> Result<reqwest::Response, HubError> {
    let status = response.status();
    if status.is_success() {
        return Ok(response);
    }
    Err(HubError::Status {
        status,
        code: header(response.headers(), "x-error-code").map(str::to_string),
        url: response.url().to_string(),
    })
}

fn unreachable(e: &reqwest::Error) -> HubError {
    HubError::Unreachable(cause(e))
}

/// The innermost cause of a request error ("Connection refused (os error 111)", "failed
/// to lookup address information: …"): reqwest's own message only names the URL.
fn cause(e: &reqwest::Error) -> String {
    let mut inner: &dyn std::error::Error = e;
    while let Some(source) = inner.source() {
        inner = source;
    }
    let text = inner.to_string();
    if e.is_timeout() && !text.contains("timed out") {
        format!("timed out: {text}")
    } else {
        text
    }
}

/// Percent-encodes all but RFC 3986's unreserved characters (and `/` if `keep_slash`), as
/// huggingface_hub quotes revisions (`refs/pr/1` → `refs%2Fpr%2F1`) and file paths.
fn encode(text: &str, keep_slash: bool) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric()
            || matches!(b, b'-' | b'_' | b'.' | b'~')
            || (keep_slash && b == b'/')
        {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl HubError {
    /// The one-line error a user reads: what went wrong with `id` (and `file`), and what to
    /// do about it.
    pub fn into_error(
        self,
        id: &RepoId,
        revision: &str,
        file: Option<&str>,
        settings: &HubSettings,
    ) -> anyhow::Error {
        let endpoint = &settings.endpoint;
        match self {
            HubError::Unreachable(cause) => match file {
                Some(file) => anyhow!("cannot reach {endpoint} to fetch {file} of {id} ({cause})"),
                None => anyhow!("cannot reach {endpoint} to fetch {id} ({cause})"),
            },
            HubError::Other(e) => e,
            HubError::Status { status, code, url } => {
                let code_text = code.as_deref().unwrap_or("");
                let token_hint = if settings.token.is_some() {
                    "the token in HF_TOKEN (or the token file) does not give access to it"
                } else {
                    "if you have access, set HF_TOKEN to a token with it"
                };
                match (status.as_u16(), code_text) {
                    (_, "RevisionNotFound") => {
                        anyhow!("{id} has no revision {revision:?} on {endpoint} (HTTP {status})")
                    }
                    (_, "EntryNotFound") => anyhow!(
                        "{id} has no file {} at revision {revision:?} (HTTP {status})",
                        file.unwrap_or("?")
                    ),
                    (_, "GatedRepo") => anyhow!(
                        "{id} is gated on {endpoint} (HTTP {status}): accept its terms on \
                         {endpoint}/{id}; {token_hint}"
                    ),
                    (401 | 403 | 404, _) => anyhow!(
                        "{id}: not found on {endpoint}, or private or gated (HTTP {status}); \
                         {token_hint}"
                    ),
                    _ => anyhow!("{url} answered HTTP {status}"),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etags_and_encoding() {
        assert_eq!(normalize_etag("W/\"abc\""), "abc");
        assert_eq!(normalize_etag("\"a1b2\""), "a1b2");
        assert!(is_blob_name("a1b2-c_d.e"));
        for bad in ["", "../x", "a/b", ".hidden", "a b"] {
            assert!(!is_blob_name(bad), "{bad}");
        }
        assert_eq!(encode("refs/pr/1", false), "refs%2Fpr%2F1");
        assert_eq!(encode("main", false), "main");
        assert_eq!(encode("sub dir/a+b.json", true), "sub%20dir/a%2Bb.json");
    }

    #[test]
    fn status_errors_are_one_line_and_name_the_token() {
        let id = RepoId::parse("o/m").unwrap();
        let mut settings =
            HubSettings::from_vars(|n| (n == "HF_HOME").then(|| "/x".into())).expect("settings");
        let status = |code: u16, x: Option<&str>| HubError::Status {
            status: StatusCode::from_u16(code).unwrap(),
            code: x.map(str::to_string),
            url: "u".into(),
        };
        let text = |e: HubError, s: &HubSettings| e.into_error(&id, "main", None, s).to_string();
        let e = text(status(401, Some("RepoNotFound")), &settings);
        assert!(
            e.contains("o/m: not found on https://huggingface.co, or private or gated (HTTP 401"),
            "{e}"
        );
        assert!(e.contains("set HF_TOKEN"), "{e}");
        assert!(!e.contains('\n'), "{e}");
        settings.token = Some("t".into());
        let e = text(status(403, Some("GatedRepo")), &settings);
        assert!(e.contains("gated") && e.contains("HF_TOKEN"), "{e}");
        let e = text(status(404, Some("RevisionNotFound")), &settings);
        assert!(e.contains("no revision \"main\""), "{e}");
        let e = text(status(500, None), &settings);
        assert!(e.contains("HTTP 500"), "{e}");
    }
}
