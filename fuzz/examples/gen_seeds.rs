//! Writes the seed inputs of every target to `fuzz/seeds/<target>/<name>`
//! (replacing what is there). Run from anywhere:
//! `cargo run --manifest-path fuzz/Cargo.toml --example gen_seeds`.
use std::fs;
use std::path::Path;

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("seeds");
    for target in crosshost_fuzz::TARGETS {
        let dir = root.join(target);
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
    }
    let seeds = crosshost_fuzz::seeds::all();
    for seed in &seeds {
        fs::write(root.join(seed.target).join(&seed.name), &seed.bytes).unwrap();
    }
    println!("gen_seeds: {} seeds under {}", seeds.len(), root.display());
}
