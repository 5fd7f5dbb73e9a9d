# The two commands a new user needs (see README.md):
#   make run    build what is missing, boot a sandbox, run a command in it, snapshot it,
#               restore a clone and run the command there, showing the timings
#   make test   run every test (unit tests and real-guest integration tests)
#
# The guest kernel is built once and cached under ~/.cache/husk (kernel-config/build.sh);
# the initramfs and binaries live in target/.

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
CMD ?= /bin/busybox uname -a

.PHONY: run test lint bench

run:
	@kernel=$$(kernel-config/build.sh); initramfs=$$(guest-init/build-rootfs.sh); \
	cargo build --quiet --release --locked -p husk-vmm -p husk-host; \
	bin=target/release; dir=$$(mktemp -d /tmp/husk-run.XXXXXX); clone=; \
	trap 'kill $$base $$clone 2>/dev/null; rm -rf "$$dir"' EXIT; \
	echo "== 1. cold boot of $$kernel with $$initramfs" >&2; \
	$$bin/husk-vmm --kernel "$$kernel" --initramfs "$$initramfs" --serial "$$dir/boot.console" \
		--vsock "cid=3,path=$$dir/boot.vsock" --api-sock "$$dir/boot.api" > "$$dir/boot.out" & base=$$!; \
	$$bin/husk ping --wait-s 900 "$$dir/boot.vsock"; \
	echo "== 2. run in it: $(CMD)" >&2; \
	$$bin/husk exec "$$dir/boot.vsock" -- $(CMD); \
	echo "== 3. snapshot it (times in microseconds)" >&2; \
	$$bin/husk snapshot "$$dir/boot.api" "$$dir/snapshot"; \
	kill $$base; wait $$base || true; cat "$$dir/boot.out"; \
	echo "== 4. restore a clone of the snapshot (times in ms since its husk-vmm started)" >&2; \
	restored=$$($$bin/husk restore "$$dir/snapshot" --run-dir "$$dir" --name sandbox); \
	echo "$$restored"; clone=$$(echo "$$restored" | sed -n 's/.* pid=\([0-9]*\) .*/\1/p'); \
	echo "== 5. run in the clone: $(CMD)" >&2; \
	$$bin/husk exec "$$dir/sandbox-0.vsock" -- $(CMD)

test:
	@export HUSK_KERNEL=$$(kernel-config/build.sh) HUSK_INITRAMFS=$$(guest-init/build-rootfs.sh); \
	cargo test --workspace --locked

lint:
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --locked -- -D warnings
	# guest-init ships as a static musl binary: lint it as built.
	cargo clippy -p guest-init --target x86_64-unknown-linux-musl --locked -- -D warnings

bench:
	@export HUSK_KERNEL=$$(kernel-config/build.sh) HUSK_INITRAMFS=$$(guest-init/build-rootfs.sh); \
	cargo bench --locked --bench boot_timeline --bench devices --bench agent --bench snapshot
