# The two commands a new user needs (see README.md):
#   make run    build what is missing, start the daemon, build a template (one boot and a
#               snapshot), fill a warm pool, create a sandbox from it, run a command in it,
#               destroy it, showing the timings
#   make test   run every test (unit tests and real-guest integration tests), two test
#               binaries at a time (HUSK_TEST_JOBS; tests/run.sh)
#
# The guest kernel is built once and cached under ~/.cache/husk (kernel-config/build.sh);
# the initramfs and binaries live in target/.

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
CMD ?= /bin/busybox uname -a

.PHONY: run test test-hostile test-kvm-amd lint bench

run:
	@kernel=$$(kernel-config/build.sh); initramfs=$$(guest-init/build-rootfs.sh); \
	cargo build --quiet --release --locked -p husk-vmm -p husk-cli -p husk-jailer; \
	husk=$$PWD/target/release/husk; dir=$$(mktemp -d /tmp/husk-run.XXXXXX); daemon=; \
	export HUSK_HOST=$$dir/husk.sock; \
	trap '{ [ -z "$$daemon" ] || kill $$daemon; wait; pkill -9 -f "$$dir"; } 2>/dev/null || true; rm -rf "$$dir"' EXIT; \
	echo "== 1. start the daemon (husk serve, state in $$dir)" >&2; \
	$$husk serve --state-dir "$$dir" --kernel "$$kernel" --initramfs "$$initramfs" 2> "$$dir/daemon.log" & daemon=$$!; \
	for i in $$(seq 100); do $$husk template ls >/dev/null 2>&1 && break; sleep 0.1; done; \
	echo "== 2. build a template: boot $$kernel once, snapshot it" >&2; \
	$$husk template build base; \
	echo "== 3. fill a warm pool of 2 clones (restored, then paused)" >&2; \
	start=$$(date +%s%N); $$husk pool set base 2 >/dev/null; \
	until $$husk pool ls --json | grep -q '"ready": 2'; do sleep 0.2; done; \
	echo "pool ready in $$(( ($$(date +%s%N) - start) / 1000000 )) ms" >&2; \
	echo "== 4. create a sandbox from the pool and run in it: $(CMD)" >&2; \
	start=$$(date +%s%N); $$husk run --rm base -- $(CMD); \
	echo "create + exec + destroy in $$(( ($$(date +%s%N) - start) / 1000000 )) ms" >&2; \
	echo "== 5. the pool, refilled" >&2; \
	$$husk pool ls; $$husk pool set base 0 >/dev/null; $$husk ps

test:
	@export HUSK_KERNEL=$$(kernel-config/build.sh) HUSK_INITRAMFS=$$(guest-init/build-rootfs.sh) \
		HUSK_TEST_PYTHON=$$(tests/py/setup.sh) HUSK_TEST_JS=$$(tests/js/setup.sh); \
	cargo build --workspace --bins --locked; \
	tests/run.sh

# The hostile-guest tests (fork bombs, a memory hog, vsock and console
# floods): minutes of emulated guest work each on a PVM host, so they are a
# tier of their own (ignored by `make test`; CI runs them when its time
# allows, see .ci/run). The test binary runs without cargo, as tests/run.sh
# runs them, so that cargo's build lock is free for another job meanwhile.
test-hostile:
	@export HUSK_KERNEL=$$(kernel-config/build.sh) HUSK_INITRAMFS=$$(guest-init/build-rootfs.sh); \
	bin=$$(cargo test --locked -p husk-vmm --test agent --no-run --message-format=json \
		| sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n 1); \
	[ -n "$$bin" ] || { echo "no agent test binary" >&2; exit 1; }; \
	cd vmm && "$$bin" --ignored floods_fork_bombs a_detached_fork_bomb a_guest_flooding

# The real-guest tests again on a second KVM: kvm_amd (ordinary KVM with
# nested paging, as on AMD hardware) in a Debian VM under QEMU's TCG
# (tests/second-kvm/run.sh), with the very binaries `make test` built (the
# workspace's, found by name). Which binaries:
# every one whose tests boot a guest: the VMM's (boot, agent, files, vsock,
# block, net, snapshot / restore / diff, clones, TSC and CPUID) and the
# daemon's (templates, pools, hibernation, the REST API, the E2B SDKs);
# those without a guest run here only (everything in that VM is translated,
# 6-20x slower).
KVM_AMD_TESTS ?= boot vsock block net agent snapshot daemon
test-kvm-amd:
	@export HUSK_KERNEL=$$(kernel-config/build.sh) HUSK_INITRAMFS=$$(guest-init/build-rootfs.sh) \
		HUSK_TEST_PYTHON=$$(tests/py/setup.sh) HUSK_TEST_JS=$$(tests/js/setup.sh); \
	cargo build --workspace --bins --locked; \
	built=$$(cargo test --workspace --locked --no-run --message-format=json | grep '"kind":\["test"\]'); \
	specs=(); for name in $(KVM_AMD_TESTS); do \
		line=$$(grep "\"name\":\"$$name\"" <<<"$$built" | tail -n 1); \
		bin=$$(sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' <<<"$$line"); \
		manifest=$$(sed -n 's/.*"manifest_path":"\([^"]*\)".*/\1/p' <<<"$$line"); \
		[ -n "$$bin" ] && [ -n "$$manifest" ] || { echo "no test binary named $$name" >&2; exit 1; }; \
		specs+=("$$name=$${manifest%/Cargo.toml}:$$bin"); \
	done; \
	tests/second-kvm/suite.sh --l1 2400 kvm_amd "$${specs[@]}"

lint:
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --locked -- -D warnings
	# The embedding library's documentation, every public item of it.
	RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --locked -p husk-core -p husk-types
	# guest-init ships as a static musl binary: lint it as built.
	cargo clippy -p guest-init --target x86_64-unknown-linux-musl --locked -- -D warnings

bench:
	@export HUSK_KERNEL=$$(kernel-config/build.sh) HUSK_INITRAMFS=$$(guest-init/build-rootfs.sh); \
	cargo build --release --locked -p husk-cli -p husk-jailer -p husk-shim; \
	cargo bench --locked --bench micro --bench boot_timeline --bench devices --bench agent --bench snapshot --bench daemon --bench shares --bench containerd
