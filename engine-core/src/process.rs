//! Child processes of a run: how they are started, watched and ended.
//!
//! Every process of a run is the same `vllm-rs` binary in another role. Children get their
//! own process group, so a Ctrl-C in the terminal reaches only the launcher, which then
//! shuts its children down in order instead of letting them die mid-step. A child exits by
//! itself when its parent dies ([`exit_when_parent_dies`]), so none is ever left behind.
//! Parents reap their children: every path that ends a child waits on it, and a process
//! ended by its parent's death first kills and reaps the children it still has, so none is
//! left a zombie or handed to init.

use std::path::Path;
use std::process::ExitStatus;
use std::sync::Mutex;
use std::time::Duration;

use tokio::process::{Child, Command};

/// Pids of this process's children that are not reaped yet, for the parent-death backstop.
static UNREAPED: Mutex<Vec<u32>> = Mutex::new(Vec::new());

fn unreaped() -> std::sync::MutexGuard<'static, Vec<u32>> {
    UNREAPED.lock().unwrap_or_else(|p| p.into_inner())
}

/// A child process of this run, killed when dropped.
pub struct ChildProcess {
    /// What the child is, for messages: "engine-core", "worker rank 1".
    pub name: String,
    child: Child,
}

impl ChildProcess {
    /// Starts `exe args…` in its own process group, inheriting stdout and stderr so its
    /// logs reach the user.
    pub fn spawn(name: String, exe: &Path, args: &[String]) -> anyhow::Result<Self> {
        let mut cmd = Command::new(exe);
        cmd.args(args)
            .process_group(0)
            .kill_on_drop(true)
            .stdin(std::process::Stdio::null());
        let child = cmd
            .spawn()
            .map_err(|e| anyhow::anyhow!("cannot start {name} ({}): {e}", exe.display()))?;
        unreaped().extend(child.id());
        Ok(Self { name, child })
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// The exit status if the child has ended (and is now reaped), without waiting.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        let pid = self.child.id();
        let status = self.child.try_wait().ok().flatten();
        if status.is_some() {
            unreaped().retain(|&p| Some(p) != pid);
        }
        status
    }

    /// Kills the child (if it still runs) and reaps it.
    pub async fn kill(&mut self) -> Option<ExitStatus> {
        let pid = self.child.id();
        let _ = self.child.start_kill();
        let status = self.child.wait().await.ok();
        unreaped().retain(|&p| Some(p) != pid);
        status
    }

    /// Waits up to `grace` for the child to exit by itself, then kills it.
    pub async fn wait_or_kill(&mut self, grace: Duration) -> Option<ExitStatus> {
        let pid = self.child.id();
        match tokio::time::timeout(grace, self.child.wait()).await {
            Ok(status) => {
                unreaped().retain(|&p| Some(p) != pid);
                status.ok()
            }
            Err(_) => {
                tracing::warn!("{} did not exit within {grace:?}; killing it", self.name);
                self.kill().await
            }
        }
    }
}

impl Drop for ChildProcess {
    /// Tokio kills a dropped child and reaps it in the background; its pid is no longer
    /// ours to signal.
    fn drop(&mut self) {
        if let Some(pid) = self.child.id() {
            unreaped().retain(|&p| p != pid);
        }
    }
}

/// Kills and reaps every child not reaped yet (blocking), before this process exits.
fn kill_and_reap_children() {
    let pids = std::mem::take(&mut *unreaped());
    for pid in pids {
        let Ok(pid) = libc::pid_t::try_from(pid) else {
            continue;
        };
        // SAFETY: kill(2) and waitpid(2) on a child of this process that no one has reaped
        // (a pid leaves the list when it is reaped), so it cannot be another's process.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
            libc::waitpid(pid, std::ptr::null_mut(), 0);
        }
    }
}

/// Describes how a process ended: "exit code 1", "signal 9 (SIGKILL)".
pub fn describe_exit(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit code {code}"),
        (None, Some(sig)) => format!("signal {sig} ({})", signal_name(sig)),
        _ => "unknown status".to_string(),
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGKILL => "SIGKILL",
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        _ => "signal",
    }
}

/// Ends this process when its parent dies. The parent's pid is read now; a thread checks
/// twice a second whether we were re-parented. (PR_SET_PDEATHSIG would fire when the
/// *thread* that spawned us exits, which tokio's blocking pool does routinely.)
pub fn exit_when_parent_dies(what: &'static str) {
    exit_when_parent_dies_after(what, Duration::ZERO);
}

/// As [`exit_when_parent_dies`], but first gives the process `grace` to end by itself: a
/// process with children of its own (the engine-core) notices the lost parent on its
/// sockets and stops and reaps them. If it has not ended by then, the children it still
/// has are killed and reaped before it exits, so none is left to init.
pub fn exit_when_parent_dies_after(what: &'static str, grace: Duration) {
    let parent = std::os::unix::process::parent_id();
    std::thread::spawn(move || loop {
        std::thread::sleep(Duration::from_millis(500));
        if std::os::unix::process::parent_id() != parent {
            eprintln!("{what}: parent process {parent} is gone; exiting");
            std::thread::sleep(grace);
            kill_and_reap_children();
            std::process::exit(1);
        }
    });
}
