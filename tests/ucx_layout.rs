//! The hand-written UCP declarations (src/transport/ucx/sys.rs) against the
//! system's UCX header: a C program compiled with `ucp/api/ucp.h` prints the
//! size and offset of every field we fill, and each must equal ours. A
//! wrong offset would hand UCX garbage in a field the mask says is set.
//! Skipped, saying so, where the header is not installed (libucx-dev).
use std::path::Path;
use std::process::Command;

use pjrt_crosshost::transport::ucx::sys::layout_report;

const HEADER: &str = "/usr/include/ucp/api/ucp.h";

fn c_expression(name: &str) -> String {
    match name.strip_prefix("sizeof ") {
        Some(ty) => format!("sizeof({ty})"),
        None => {
            let (ty, field) = name.split_once('.').expect("type.field");
            format!("offsetof({ty}, {field})")
        }
    }
}

#[test]
fn our_ucp_structs_match_the_system_header_field_by_field() {
    if !Path::new(HEADER).is_file() {
        println!("SKIPPED: {HEADER} is not installed (apt install libucx-dev)");
        return;
    }
    let ours = layout_report();
    let mut program = String::from(
        "#include <stddef.h>\n#include <stdio.h>\n#include <ucp/api/ucp.h>\nint main(void) {\n",
    );
    for (name, _) in &ours {
        program.push_str(&format!(
            "    printf(\"%s %zu\\n\", \"{name}\", (size_t){});\n",
            c_expression(name)
        ));
    }
    program.push_str("    return 0;\n}\n");
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("ucx-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let source = dir.join("layout.c");
    let binary = dir.join("layout");
    std::fs::write(&source, program).unwrap();
    let compiler = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let built = Command::new(&compiler)
        .arg(&source)
        .arg("-o")
        .arg(&binary)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {compiler}: {e}"));
    assert!(
        built.status.success(),
        "{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let run = Command::new(&binary).output().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let text = String::from_utf8(run.stdout).unwrap();
    let theirs: Vec<(String, usize)> = text
        .lines()
        .map(|line| {
            let (name, value) = line.rsplit_once(' ').unwrap();
            (name.to_string(), value.parse().unwrap())
        })
        .collect();
    assert_eq!(theirs.len(), ours.len());
    let wrong: Vec<String> = ours
        .iter()
        .zip(&theirs)
        .filter(|((_, a), (_, b))| a != b)
        .map(|((name, a), (_, b))| format!("{name}: ours {a}, the header's {b}"))
        .collect();
    assert!(wrong.is_empty(), "{wrong:#?}");
}
