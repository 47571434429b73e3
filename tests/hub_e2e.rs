//! `--model` as a Hugging Face Hub id, end to end: served from a cache folder laid out by
//! hand as the hub lays it out; fetched from a fake hub (an axum server in this test that
//! answers the hub's two endpoints, with a token, ETags and an LFS redirect to another
//! origin) into that layout, once; and the one-line errors of an unreachable hub, a
//! private repo without a token and an offline run with nothing cached.

mod common;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::response::Response;
use common::{exe, tiny_model, Server};
use serde_json::{json, Value};

const ID: &str = "someorg/tiny";
const COMMIT: &str = "5f2c0a6e1d9b3c7a8e4f60123456789abcdef012";
const UNREACHABLE: &str = "http://127.0.0.1:1";
/// The files of the tiny model, as `make-tiny-model` writes them.
const MODEL_FILES: [&str; 5] = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors",
];
/// Files the fake repo also holds, which a run must never fetch.
const OTHER_FILES: [&str; 3] = [".gitattributes", "README.md", "pytorch_model.bin"];
/// A second fake repo: the tiny model with `model.safetensors.index.json`, whose only
/// shard is `model.safetensors`, beside a safetensors file the index does not name.
const SHARDED: &str = "someorg/sharded";
const INDEX: &str = "model.safetensors.index.json";
const INDEX_JSON: &str = r#"{"weight_map": {"model.embed_tokens.weight": "model.safetensors"}}"#;
const UNNAMED: &str = "consolidated.safetensors";

/// A content name for a blob (FNV-1a, 64 bits): what an ETag is to the cache.
fn etag(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

fn read(file: &str) -> Vec<u8> {
    std::fs::read(tiny_model().join(file)).expect("read the tiny model")
}

/// `{hf_home}/hub/models--someorg--tiny` with the tiny model at COMMIT, built by hand as
/// huggingface_hub builds it: blobs named by ETag, relative links in the snapshot, and
/// `refs/main`.
fn hand_made_cache(hf_home: &Path) -> PathBuf {
    let repo = hf_home.join("hub").join("models--someorg--tiny");
    let snapshot = repo.join("snapshots").join(COMMIT);
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    for file in MODEL_FILES {
        let bytes = read(file);
        let tag = etag(&bytes);
        std::fs::write(repo.join("blobs").join(&tag), &bytes).unwrap();
        std::os::unix::fs::symlink(format!("../../blobs/{tag}"), snapshot.join(file)).unwrap();
    }
    std::fs::write(repo.join("refs").join("main"), COMMIT).unwrap();
    snapshot
}

/// Runs `vllm-rs ARGS` (split at spaces) with `HF_HOME=hf_home` and `env`, and no other
/// Hugging Face variable of the test's own environment.
fn vllm_rs(hf_home: &Path, args: &str, env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(exe());
    cmd.args(args.split_whitespace());
    clean_env(&mut cmd, hf_home, env);
    cmd.output().expect("run vllm-rs")
}

fn clean_env(cmd: &mut Command, hf_home: &Path, env: &[(&str, &str)]) {
    for (name, _) in std::env::vars_os() {
        let text = name.to_string_lossy();
        if text.starts_with("HF_") || text.starts_with("HUGGING") || text == "RUST_LOG" {
            cmd.env_remove(&name);
        }
    }
    cmd.env("HF_HOME", hf_home).envs(env.iter().copied());
}

/// `vllm-rs generate --model MODEL`, four greedy tokens on the CPU.
fn generate(hf_home: &Path, model: &str, env: &[(&str, &str)]) -> Output {
    let args = format!(
        "generate --model {model} --device cpu --prompt Hello --max-tokens 4 --ignore-eos \
         --temperature 0"
    );
    vllm_rs(hf_home, &args, env)
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A successful run's stderr.
fn succeeded(out: &Output) -> String {
    let err = stderr(out);
    assert!(out.status.success(), "{err}");
    err
}

/// A failed run whose whole stderr is one `error:` line; returns it.
fn one_line_error(out: &Output) -> String {
    let err = stderr(out);
    assert!(!out.status.success(), "expected a failure:\n{err}");
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "expected one line:\n{err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    lines[0].to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn serves_a_hub_id_from_a_hand_made_cache_offline() {
    let hf_home = tempfile::tempdir().unwrap();
    hand_made_cache(hf_home.path());
    let args: Vec<OsString> = ["--model", ID, "--device", "cpu"]
        .map(OsString::from)
        .to_vec();
    let mut server = Server::spawn_serve(&args, |cmd| {
        // Offline, with an endpoint that would fail at once if it were tried.
        clean_env(
            cmd,
            hf_home.path(),
            &[("HF_HUB_OFFLINE", "1"), ("HF_ENDPOINT", UNREACHABLE)],
        );
        cmd.env("RUST_LOG", "info");
    });
    server.wait_healthy(Duration::from_secs(120));

    let models: Value = reqwest::get(server.url("/v1/models"))
        .await
        .expect("models")
        .json()
        .await
        .expect("json");
    assert_eq!(models["data"][0]["id"], ID, "{models}");
    assert_eq!(models["data"][0]["root"], ID, "{models}");
    let (status, body) = common::post_json(
        &server,
        "/v1/completions",
        &json!({"model": ID, "prompt": "Hello", "max_tokens": 4, "ignore_eos": true}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["model"], ID);
    assert_eq!(body["usage"]["completion_tokens"], 4, "{body}");
    let log = server.log();
    assert!(log.contains(&format!("snapshots/{COMMIT}")), "{log}");
}

#[test]
fn the_cache_serves_every_command_and_revision() {
    let hf_home = tempfile::tempdir().unwrap();
    hand_made_cache(hf_home.path());
    // Online, but the hub is away: the cached snapshot of `main` serves, with a warning.
    let out = generate(hf_home.path(), ID, &[("HF_ENDPOINT", UNREACHABLE)]);
    let err = succeeded(&out);
    assert!(err.contains("using the cached snapshot"), "{err}");
    assert!(!String::from_utf8_lossy(&out.stdout).trim().is_empty());

    // A commit hash as --revision needs no ref; an unknown branch offline is an error.
    let offline = [("HF_HUB_OFFLINE", "yes")];
    let revision = |rev: &str| {
        let args = format!("generate --model {ID} --revision {rev} --prompt Hi --device cpu");
        vllm_rs(hf_home.path(), &args, &offline)
    };
    succeeded(&revision(COMMIT));
    let err = one_line_error(&revision("v2"));
    assert!(
        err.contains("someorg/tiny (revision v2) is not in the Hugging Face cache"),
        "{err}"
    );

    // `--tokenizer` takes an id too, and `bench` resolves one as `generate` does.
    let args = format!(
        "generate --model {} --tokenizer {ID} --prompt Hi --device cpu",
        tiny_model().display()
    );
    let err = succeeded(&vllm_rs(hf_home.path(), &args, &offline));
    assert!(err.contains(&format!("--tokenizer {ID}: ")), "{err}");
    let args = format!(
        "bench latency --model {ID} --input-len 4 --output-len 2 --num-iters-warmup 0 \
         --num-iters 1 --device cpu"
    );
    succeeded(&vllm_rs(hf_home.path(), &args, &offline));
}

#[test]
fn offline_with_nothing_cached_is_a_one_line_error() {
    let hf_home = tempfile::tempdir().unwrap();
    let out = generate(hf_home.path(), ID, &[("HF_HUB_OFFLINE", "1")]);
    let err = one_line_error(&out);
    assert!(err.contains(ID), "{err}");
    let repo = hf_home.path().join("hub").join("models--someorg--tiny");
    assert!(err.contains(&repo.display().to_string()), "{err}");
    assert!(err.contains("HF_HUB_OFFLINE"), "{err}");
}

#[test]
fn an_unreachable_hub_is_one_line_within_seconds() {
    let hf_home = tempfile::tempdir().unwrap();
    let start = Instant::now();
    let out = generate(hf_home.path(), ID, &[("HF_ENDPOINT", UNREACHABLE)]);
    let took = start.elapsed();
    let err = one_line_error(&out);
    assert!(
        err.starts_with(&format!(
            "error: cannot reach {UNREACHABLE} to fetch {ID} ("
        )),
        "{err}"
    );
    let cache = hf_home.path().join("hub");
    assert!(
        err.contains(&format!(
            "neither a local path nor in the cache at {}",
            cache.display()
        )),
        "{err}"
    );
    assert!(took < Duration::from_secs(10), "took {took:?}");
    assert!(!hf_home
        .path()
        .join("hub")
        .join("models--someorg--tiny")
        .join("refs")
        .exists());
}

/// A stand-in for huggingface.co: the model-info API and `resolve` on one origin, LFS
/// blobs on another (a second port), as the hub sends large files to its CDN.
struct FakeHub {
    base: String,
    state: Arc<HubState>,
}

struct HubState {
    token: Option<String>,
    lfs_base: String,
    /// Every request: `PATH` on the hub, `lfs PATH` on the CDN.
    log: Mutex<Vec<String>>,
    /// Requests to the CDN that carried an Authorization header.
    lfs_with_auth: Mutex<usize>,
    /// Answer every hub request with 503, as a hub in trouble does.
    broken: std::sync::atomic::AtomicBool,
}

impl FakeHub {
    fn start(token: Option<&str>) -> FakeHub {
        let hub = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let lfs = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let state = Arc::new(HubState {
            token: token.map(str::to_string),
            lfs_base: format!("http://{}", lfs.local_addr().unwrap()),
            log: Mutex::new(Vec::new()),
            lfs_with_auth: Mutex::new(0),
            broken: false.into(),
        });
        let base = format!("http://{}", hub.local_addr().unwrap());
        let st = state.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                for l in [&hub, &lfs] {
                    l.set_nonblocking(true).unwrap();
                }
                let hub = tokio::net::TcpListener::from_std(hub).unwrap();
                let lfs = tokio::net::TcpListener::from_std(lfs).unwrap();
                let hub_app = axum::Router::new()
                    .fallback(hub_answer)
                    .with_state(st.clone());
                let lfs_app = axum::Router::new().fallback(lfs_answer).with_state(st);
                let lfs_server = tokio::spawn(async move { axum::serve(lfs, lfs_app).await });
                let _ = axum::serve(hub, hub_app).await;
                let _ = lfs_server.await;
            });
        });
        FakeHub { base, state }
    }

    fn requests(&self) -> Vec<String> {
        self.state.log.lock().unwrap().clone()
    }
}

fn respond(status: StatusCode, headers: &[(&str, String)], body: Vec<u8>) -> Response {
    let mut builder = Response::builder().status(status);
    for (name, value) in headers {
        builder = builder.header(*name, value);
    }
    builder.body(Body::from(body)).unwrap()
}

async fn hub_answer(State(st): State<Arc<HubState>>, req: Request) -> Response {
    let path = req.uri().path().to_string();
    st.log.lock().unwrap().push(path.clone());
    if st.broken.load(std::sync::atomic::Ordering::Relaxed) {
        return respond(StatusCode::SERVICE_UNAVAILABLE, &[], Vec::new());
    }
    let auth = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    if let Some(token) = &st.token {
        if auth != Some(format!("Bearer {token}").as_str()) {
            // What the hub answers for a private repo to a caller without access.
            let code = ("x-error-code", "RepoNotFound".to_string());
            return respond(StatusCode::UNAUTHORIZED, &[code], b"{}".to_vec());
        }
    }
    let repo_files = |repo: &str| -> Vec<&'static str> {
        let mut files: Vec<&str> = MODEL_FILES
            .iter()
            .chain(OTHER_FILES.iter())
            .copied()
            .collect();
        if repo == SHARDED {
            files.extend([INDEX, UNNAMED]);
        }
        files
    };
    for repo in [ID, SHARDED] {
        if path == format!("/api/models/{repo}/revision/main") {
            let siblings: Vec<Value> = repo_files(repo)
                .iter()
                .map(|f| json!({"rfilename": f}))
                .collect();
            let body = json!({"id": repo, "sha": COMMIT, "siblings": siblings});
            let content = ("content-type", "application/json".to_string());
            return respond(StatusCode::OK, &[content], body.to_string().into_bytes());
        }
    }
    let file = [ID, SHARDED]
        .iter()
        .find_map(|repo| path.strip_prefix(&format!("/{repo}/resolve/{COMMIT}/")));
    let Some(file) = file else {
        let code = ("x-error-code", "RepoNotFound".to_string());
        return respond(StatusCode::NOT_FOUND, &[code], Vec::new());
    };
    let bytes = match file {
        f if MODEL_FILES.contains(&f) => read(f),
        INDEX => INDEX_JSON.as_bytes().to_vec(),
        _ => b"not a model file".to_vec(),
    };
    let tag = etag(&bytes);
    if file.ends_with(".safetensors") {
        // An LFS file: a redirect to the CDN, the blob's name in X-Linked-Etag.
        let headers = [
            ("location", format!("{}/blobs/{tag}", st.lfs_base)),
            ("x-linked-etag", format!("\"{tag}\"")),
            ("x-linked-size", bytes.len().to_string()),
            ("etag", "\"not-the-blob-name\"".to_string()),
        ];
        return respond(StatusCode::FOUND, &headers, Vec::new());
    }
    respond(StatusCode::OK, &[("etag", format!("\"{tag}\""))], bytes)
}

async fn lfs_answer(State(st): State<Arc<HubState>>, req: Request) -> Response {
    let path = req.uri().path().to_string();
    st.log.lock().unwrap().push(format!("lfs {path}"));
    if req.headers().contains_key(header::AUTHORIZATION) {
        *st.lfs_with_auth.lock().unwrap() += 1;
    }
    let bytes = read("model.safetensors");
    if path != format!("/blobs/{}", etag(&bytes)) {
        return respond(StatusCode::NOT_FOUND, &[], Vec::new());
    }
    respond(
        StatusCode::OK,
        &[("etag", "\"cdn-etag\"".to_string())],
        bytes,
    )
}

#[test]
fn fetches_from_the_hub_into_the_cache_once() {
    let hub = FakeHub::start(Some("hf_secret"));
    let hf_home = tempfile::tempdir().unwrap();
    let endpoint = ("HF_ENDPOINT", hub.base.as_str());

    let out = generate(hf_home.path(), ID, &[endpoint, ("HF_TOKEN", "hf_secret")]);
    succeeded(&out);
    assert!(!String::from_utf8_lossy(&out.stdout).trim().is_empty());

    // The cache, as huggingface_hub lays it out.
    let repo = hf_home.path().join("hub").join("models--someorg--tiny");
    let refs = std::fs::read_to_string(repo.join("refs").join("main")).unwrap();
    assert_eq!(refs, COMMIT);
    let snapshot = repo.join("snapshots").join(COMMIT);
    let mut linked: Vec<String> = std::fs::read_dir(&snapshot)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    linked.sort();
    let mut expected: Vec<String> = MODEL_FILES.iter().map(|s| s.to_string()).collect();
    expected.sort();
    assert_eq!(linked, expected, "only the files the model needs");
    for file in MODEL_FILES {
        let bytes = read(file);
        let target = std::fs::read_link(snapshot.join(file)).unwrap();
        assert_eq!(
            target,
            PathBuf::from(format!("../../blobs/{}", etag(&bytes))),
            "{file}"
        );
        assert_eq!(std::fs::read(snapshot.join(file)).unwrap(), bytes, "{file}");
    }
    let mut blobs: Vec<String> = std::fs::read_dir(repo.join("blobs"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    blobs.sort();
    let mut tags: Vec<String> = MODEL_FILES.iter().map(|f| etag(&read(f))).collect();
    tags.sort();
    assert_eq!(
        blobs, tags,
        "one complete blob per file, nothing left incomplete"
    );

    let first = hub.requests();
    let resolves = |log: &[String]| log.iter().filter(|r| r.contains("/resolve/")).count();
    assert_eq!(resolves(&first), MODEL_FILES.len(), "{first:?}");
    assert!(
        first.iter().any(|r| r.starts_with("lfs /blobs/")),
        "{first:?}"
    );
    for other in OTHER_FILES {
        assert!(
            !first.iter().any(|r| r.ends_with(other)),
            "{other}: {first:?}"
        );
    }
    assert_eq!(
        *hub.state.lfs_with_auth.lock().unwrap(),
        0,
        "the token stays on the hub"
    );

    // Again, the token now from the token file: the revision is looked up, nothing fetched.
    std::fs::write(hf_home.path().join("token"), "hf_secret\n").unwrap();
    succeeded(&generate(hf_home.path(), ID, &[endpoint]));
    let second = hub.requests()[first.len()..].to_vec();
    assert_eq!(second, vec![format!("/api/models/{ID}/revision/main")]);

    // With the snapshot gone but the blobs kept, each file is resolved again (to learn its
    // blob's name) and relinked; no bytes travel, the CDN is not asked.
    std::fs::remove_dir_all(&snapshot).unwrap();
    let before = hub.requests().len();
    succeeded(&generate(hf_home.path(), ID, &[endpoint]));
    let third = hub.requests()[before..].to_vec();
    assert_eq!(resolves(&third), MODEL_FILES.len(), "{third:?}");
    assert!(!third.iter().any(|r| r.starts_with("lfs")), "{third:?}");
    for file in MODEL_FILES {
        assert_eq!(
            std::fs::read(snapshot.join(file)).unwrap(),
            read(file),
            "{file}"
        );
    }

    // A hub in trouble (HTTP 503): the cached snapshot serves, with a warning.
    hub.state
        .broken
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let err = succeeded(&generate(hf_home.path(), ID, &[endpoint]));
    let warning = "(HTTP 503 Service Unavailable); using the cached snapshot";
    assert!(err.contains(warning), "{err}");
}

#[test]
fn a_sharded_repo_fetches_its_index_then_the_shards_it_names() {
    let hub = FakeHub::start(None);
    let hf_home = tempfile::tempdir().unwrap();
    succeeded(&generate(
        hf_home.path(),
        SHARDED,
        &[("HF_ENDPOINT", hub.base.as_str())],
    ));
    let snapshot = hf_home
        .path()
        .join("hub/models--someorg--sharded/snapshots")
        .join(COMMIT);
    assert_eq!(
        std::fs::read_to_string(snapshot.join(INDEX)).unwrap(),
        INDEX_JSON
    );
    assert_eq!(
        std::fs::read(snapshot.join("model.safetensors")).unwrap(),
        read("model.safetensors")
    );
    assert!(!snapshot.join(UNNAMED).exists());
    let log = hub.requests();
    assert!(!log.iter().any(|r| r.ends_with(UNNAMED)), "{log:?}");
}

#[test]
fn a_private_repo_without_a_token_is_a_one_line_error() {
    let hub = FakeHub::start(Some("hf_secret"));
    let hf_home = tempfile::tempdir().unwrap();
    let out = generate(hf_home.path(), ID, &[("HF_ENDPOINT", hub.base.as_str())]);
    let err = one_line_error(&out);
    assert!(err.contains(ID), "{err}");
    assert!(err.contains("HTTP 401"), "{err}");
    assert!(err.contains("private or gated"), "{err}");
    assert!(err.contains("set HF_TOKEN"), "{err}");
    let out = generate(
        hf_home.path(),
        ID,
        &[("HF_ENDPOINT", hub.base.as_str()), ("HF_TOKEN", "hf_wrong")],
    );
    let err = one_line_error(&out);
    assert!(err.contains("does not give access"), "{err}");
}
