//! Without libFuzzer: the committed seeds are what the generator makes, and
//! every committed seed and minimized-corpus input passes its target's check
//! (open findings, fuzz/artifacts-found/, are in tests/findings.rs). Runs on
//! stable: `cargo test` in fuzz/.
use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use crosshost_fuzz::{check_for, seeds, TARGETS};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn committed_seeds_are_the_generated_ones() {
    let mut expected: BTreeMap<(String, String), Vec<u8>> = BTreeMap::new();
    for seed in seeds::all() {
        let previous = expected.insert((seed.target.to_string(), seed.name.clone()), seed.bytes);
        assert!(
            previous.is_none(),
            "seed {}/{} twice",
            seed.target,
            seed.name
        );
    }
    let mut committed = BTreeMap::new();
    for target in TARGETS {
        let dir = root().join("seeds").join(target);
        for entry in fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let entry = entry.unwrap();
            let name = entry.file_name().into_string().unwrap();
            committed.insert((target.to_string(), name), fs::read(entry.path()).unwrap());
        }
    }
    assert!(
        committed == expected,
        "fuzz/seeds/ is stale: run `cargo run --example gen_seeds` in fuzz/"
    );
}

#[test]
fn every_seed_and_corpus_input_passes_its_check() {
    let mut replayed = 0;
    for target in TARGETS {
        let check = check_for(target).unwrap();
        for dir in ["seeds", "corpus"] {
            let Ok(entries) = fs::read_dir(root().join(dir).join(target)) else {
                continue;
            };
            for entry in entries {
                check(&fs::read(entry.unwrap().path()).unwrap());
                replayed += 1;
            }
        }
    }
    assert!(replayed > 0);
}
