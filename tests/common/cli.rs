//! Running the `xquant` binary from tests.

use std::path::PathBuf;
use std::process::Command;

/// Output of one run.
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

pub fn xquant(args: &[&str]) -> Run {
    xquant_env(args, &[])
}

/// `xquant` with environment variables set.
pub fn xquant_env(args: &[&str], vars: &[(&str, &str)]) -> Run {
    let out = Command::new(env!("CARGO_BIN_EXE_xquant"))
        .args(args)
        .envs(vars.iter().copied())
        .output()
        .expect("xquant runs");
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// A fresh temporary path for this test process.
pub fn temp_path(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("xquant-tests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir.join(name)
}

/// Asserts a failed run: non-zero exit, exactly one line on stderr naming `needle`, no panic.
pub fn assert_one_line_error(r: &Run, needle: &str) {
    assert_ne!(r.code, 0, "expected failure, stdout: {}", r.stdout);
    let lines: Vec<&str> = r.stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(
        lines.len(),
        1,
        "expected one stderr line, got: {:?}",
        r.stderr
    );
    assert!(
        lines[0].contains(needle),
        "stderr {:?} does not mention {needle:?}",
        lines[0]
    );
    assert!(
        !r.stderr.contains("panicked") && !r.stderr.contains("internal error"),
        "{}",
        r.stderr
    );
}
