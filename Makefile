# pjrt-crosshost — the commands a person (and CI) runs. See README.md.
#   make demo   the main job: build the plugin and run the benchmark
#   make test   every test: cargo tests (incl. the C host program) + python_tests
PYTHON ?= python3
LIB := $(CURDIR)/target/release/libpjrt_crosshost.so

.PHONY: setup build test demo lint

setup:
	scripts/setup.sh

build: setup
	cargo build --release

test: setup build
	cargo test --release
	PJRT_CROSSHOST_LIB=$(LIB) $(PYTHON) -m pytest python_tests -q

demo: setup build
	cargo run --release --bin crosshost-bench

lint:
	cargo fmt --check
	cargo clippy --all-targets -- -D warnings
