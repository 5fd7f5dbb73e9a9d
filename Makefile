# The two commands a new user needs (see README.md):
#   make run    build what is missing, boot a sandbox, run a command in it, show the timings
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
	cargo build --quiet --release --locked -p husk-vmm; \
	echo "booting $$kernel with $$initramfs, then running: $(CMD)" >&2; \
	target/release/husk-vmm --kernel "$$kernel" --initramfs "$$initramfs" \
		--cmdline "-- $(CMD)"

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
