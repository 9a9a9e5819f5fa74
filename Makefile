# pjrt-crosshost — the commands a person (and CI) runs. See README.md.
#   make demo   the main job: build the plugin and run the benchmark
#   make test   every test (scripts/test.sh): cargo tests, python_tests on both
#               backends, the JAX tests on JAX 0.10.2 and 0.12, the wheel
#               (pip install .) in fresh venvs of both, fuzz corpus
#   make bench-jax  the JAX-level benchmark (crosshost vs JAX's own path)
#   make bench-hosts  the same across two hosts of a two-host bed (root;
#               scripts/two-hosts.sh), with a raw TCP stream for scale
#   make bench-scale  one process on each host of an N-host bed (root;
#               scripts/n-hosts.sh), N = 2..64 (SCALE_MAX=16 stops earlier):
#               creation, fds, threads, RSS, TCP connections, etcd's CPU
#   make bench-soak  memory after load: 6 processes, one per host of an N-host
#               bed (root), all to all for 180 s; anonymous RSS after
#               malloc_trim over time, and the same harness without the plugin
#   make fuzz       1,000,000 executions of every fuzz target
#   make sanitize   the Rust tests under ASan/LSan (nightly)
PYTHON ?= python3
LIB := $(CURDIR)/target/release/libpjrt_crosshost.so
SCALE_MAX ?= 64

.PHONY: setup build test demo lint bench-jax bench-hosts bench-scale bench-soak fuzz sanitize

setup:
	scripts/setup.sh

build: setup
	cargo build --release
	scripts/split-debug.sh $(LIB)

test: setup build
	PYTHON=$(PYTHON) PJRT_CROSSHOST_LIB=$(LIB) scripts/test.sh

demo: setup build
	cargo run --release --bin crosshost-bench

lint:
	cargo fmt --check
	cargo clippy --all-targets -- -D warnings

bench-jax: setup build
	PJRT_CROSSHOST_LIB=$(LIB) $(PYTHON) bench/jax_device_put.py

bench-hosts: setup build
	PJRT_CROSSHOST_LIB=$(LIB) $(PYTHON) bench/jax_device_put.py --hosts

bench-scale: setup build
	PJRT_CROSSHOST_LIB=$(LIB) $(PYTHON) bench/scale.py --max $(SCALE_MAX)

bench-soak: setup build
	PJRT_CROSSHOST_LIB=$(LIB) $(PYTHON) bench/soak.py --n-hosts

fuzz: setup
	FUZZ_RUNS=1000000 FUZZ_GROW_CORPUS=1 scripts/fuzz-short.sh

sanitize: setup
	scripts/sanitize.sh
