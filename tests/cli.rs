//! The `vllm-rs` command line: `generate` end to end, and the errors a user meets first.

mod common;

use std::process::Command;

use common::{exe, tiny_model};

#[test]
fn generate_prints_a_completion() {
    let out = Command::new(exe())
        .args(["generate", "--model"])
        .arg(tiny_model())
        .args([
            "--prompt",
            "Hello",
            "--max-tokens",
            "8",
            "--ignore-eos",
            "--temperature",
            "0",
        ])
        .output()
        .expect("run generate");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!String::from_utf8_lossy(&out.stdout).trim().is_empty());
}

#[test]
fn a_missing_model_is_a_one_line_error() {
    let out = Command::new(exe())
        .args(["generate", "--model", "/no/such/model", "--prompt", "x"])
        .output()
        .expect("run");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("no such model file or directory"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn an_unsupported_architecture_is_reported_not_panicked() {
    let dir = tempfile::tempdir().expect("tempdir");
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
    ] {
        std::fs::copy(tiny_model().join(f), dir.path().join(f)).expect("copy");
    }
    let config = std::fs::read_to_string(tiny_model().join("config.json")).expect("config");
    let config = config.replace("Qwen3ForCausalLM", "MambaForCausalLM");
    std::fs::write(dir.path().join("config.json"), config).expect("write");
    let out = Command::new(exe())
        .args(["generate", "--model"])
        .arg(dir.path())
        .args(["--prompt", "x"])
        .output()
        .expect("run");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("MambaForCausalLM"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn load_format_dummy_needs_only_config_and_tokenizer() {
    let dir = tempfile::tempdir().expect("tempdir");
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(tiny_model().join(f), dir.path().join(f)).expect("copy");
    }
    let generate = |extra: &[&str]| {
        Command::new(exe())
            .args(["generate", "--device", "cpu", "--model"])
            .arg(dir.path())
            .args(["--prompt", "Hello", "--max-tokens", "8", "--ignore-eos"])
            .args(["--temperature", "0"])
            .args(extra)
            .output()
            .expect("run generate")
    };
    let out = generate(&["--load-format", "dummy"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!String::from_utf8_lossy(&out.stdout).trim().is_empty());

    // Without the flag the missing checkpoint is still a clear error.
    let out = generate(&[]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no *.safetensors weights"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");

    // A format this engine does not read is clap's error.
    let out = generate(&["--load-format", "gguf"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("invalid value 'gguf'"), "{stderr}");
}

#[test]
fn compile_kernels_without_nvrtc_or_with_a_bad_arch_is_a_clear_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let run_in = |cache_dir: &std::path::Path, args: &[&str]| {
        let out = Command::new(exe())
            .arg("compile-kernels")
            .arg("--cache-dir")
            .arg(cache_dir)
            .args(args)
            .env("CUDA_HOME", "/nonexistent")
            .env("LD_LIBRARY_PATH", "")
            .output()
            .expect("run compile-kernels");
        assert!(!out.status.success(), "{args:?} succeeded");
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(!stderr.contains("panicked"), "{stderr}");
        stderr
    };
    let run = |args: &[&str]| run_in(dir.path(), args);
    assert!(run(&["--arch", "90"]).contains("--arch 90: expected sm_"));
    assert!(run(&["--dtype", "auto"]).contains("--dtype auto"));
    assert!(run(&["--dtype", "int8"]).contains("--dtype int8"));
    // Where the loader finds NVRTC by itself (ldconfig's cache) the run compiles instead.
    let system_nvrtc = Command::new("ldconfig")
        .arg("-p")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("libnvrtc.so.13"));
    if !system_nvrtc {
        let stderr = run(&["--dtype", "float32"]);
        assert!(
            stderr.contains("NVRTC (libnvrtc.so.13) not found"),
            "{stderr}"
        );
    }
    // A cache folder that cannot be made fails before any compile, rather than reporting
    // a path with no file.
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"not a folder").expect("write");
    let stderr = run_in(&file, &["--dtype", "float32"]);
    assert!(stderr.contains("cannot write the kernel cache"), "{stderr}");
}
