//! Builds `tests/c/plugin_roundtrip.c` with the system C compiler and runs it
//! against the cdylib cargo built for this profile: a plain C program that
//! `dlopen`s the plugin, as a framework does, must round-trip buffers.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The plugin's cdylib for this profile. Cargo builds only the rlib for an
/// integration test, so on a fresh clone `target/<profile>/` has no cdylib
/// (or a stale one): the test builds it itself, once per test process, a
/// no-op when it is fresh. (`cargo test` does not hold the build lock while
/// tests run.)
fn cdylib_path() -> PathBuf {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        let exe = std::env::current_exe().expect("current_exe");
        let profile_dir = exe
            .parent()
            .and_then(Path::parent)
            .expect("test executable is in <target>/<profile>/deps");
        let release = profile_dir.file_name().is_some_and(|n| n == "release");
        let target_dir = profile_dir.parent().expect("<target>/<profile>");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
        let mut build = Command::new(&cargo);
        build
            .args(["build", "--lib", "--quiet"])
            .arg("--manifest-path")
            .arg(manifest_dir().join("Cargo.toml"))
            .arg("--target-dir")
            .arg(target_dir);
        if release {
            build.arg("--release");
        }
        let out = build
            .output()
            .unwrap_or_else(|e| panic!("cannot run `{cargo} build`: {e}"));
        assert!(
            out.status.success(),
            "building the cdylib for the C program failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let lib = target_dir
            .join(if release { "release" } else { "debug" })
            .join("libpjrt_crosshost.so");
        assert!(lib.is_file(), "{} was not built", lib.display());
        lib
    })
    .clone()
}

/// Compiles the C program once per test process, under cargo's scratch
/// directory for integration tests (inside `target/`, not the system's
/// temp dir, where every run would leave a directory behind).
fn c_program() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| {
        let root = manifest_dir();
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("c-program-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create temp dir");
        let exe = dir.join("plugin_roundtrip");
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
        let out = Command::new(&cc)
            .arg("-std=c11")
            .arg("-Wall")
            .arg("-Werror")
            .arg("-D_GNU_SOURCE")
            .arg("-I")
            .arg(root.join("pjrt_c_api"))
            .arg("-I")
            .arg(root.join("include"))
            .arg(root.join("tests/c/plugin_roundtrip.c"))
            .arg("-o")
            .arg(&exe)
            .arg("-ldl")
            .output()
            .unwrap_or_else(|e| panic!("cannot run C compiler `{cc}`: {e}"));
        assert!(
            out.status.success(),
            "compiling tests/c/plugin_roundtrip.c failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        exe
    })
}

fn run(lib: &Path) -> Output {
    Command::new(c_program())
        .arg(lib)
        .output()
        .expect("run plugin_roundtrip")
}

fn describe(out: &Output) -> String {
    format!(
        "status {:?}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn c_program_dlopens_the_plugin_and_round_trips_buffers() {
    let out = run(&cdylib_path());
    assert!(out.status.success(), "{}", describe(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("plugin_roundtrip: OK"),
        "{}",
        describe(&out)
    );
}

#[test]
fn c_program_fails_with_a_message_when_the_library_does_not_exist() {
    let missing = std::env::temp_dir().join("no-such-dir-pjrt-crosshost/libnothing.so");
    let out = run(&missing);
    assert!(!out.status.success(), "{}", describe(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("FAILED"),
        "{}",
        describe(&out)
    );
}

#[test]
fn c_program_fails_when_given_a_library_without_get_pjrt_api() {
    // libc is always present and has no GetPjrtApi: the negative control
    // for the symbol check.
    let libc = Path::new("/lib/x86_64-linux-gnu/libc.so.6");
    let libc = if libc.exists() {
        libc.to_path_buf()
    } else {
        PathBuf::from("libc.so.6")
    };
    let out = run(&libc);
    assert!(!out.status.success(), "{}", describe(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("GetPjrtApi"),
        "{}",
        describe(&out)
    );
}
