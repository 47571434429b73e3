//! Child processes of a run: how they are started, watched and ended.
//!
//! Every process of a run is the same `vllm-rs` binary in another role. Children get their
//! own process group, so a Ctrl-C in the terminal reaches only the launcher, which then
//! shuts its children down in order instead of letting them die mid-step. A child exits by
//! itself when its parent dies ([`exit_when_parent_dies`]), so none is ever left behind.

use std::path::Path;
use std::process::ExitStatus;
use std::time::Duration;

use tokio::process::{Child, Command};

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
        Ok(Self { name, child })
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// The exit status if the child has ended, without waiting.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Kills the child (if it still runs) and reaps it.
    pub async fn kill(&mut self) -> Option<ExitStatus> {
        let _ = self.child.start_kill();
        self.child.wait().await.ok()
    }

    /// Waits up to `grace` for the child to exit by itself, then kills it.
    pub async fn wait_or_kill(&mut self, grace: Duration) -> Option<ExitStatus> {
        match tokio::time::timeout(grace, self.child.wait()).await {
            Ok(status) => status.ok(),
            Err(_) => {
                tracing::warn!("{} did not exit within {grace:?}; killing it", self.name);
                self.kill().await
            }
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
    let parent = std::os::unix::process::parent_id();
    std::thread::spawn(move || loop {
        std::thread::sleep(Duration::from_millis(500));
        if std::os::unix::process::parent_id() != parent {
            eprintln!("{what}: parent process {parent} is gone; exiting");
            std::process::exit(1);
        }
    });
}
