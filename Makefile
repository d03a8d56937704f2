# The project's entry points. `make test` is the test command CI runs (.ci/run); `make demo`
# is the main job on the local default. Both install what they need themselves.
.PHONY: test demo soak churn-bench scale-bench peer-bench node-bench cluster-up cluster-down controlplane tools node deps image

# Where cargo puts what it builds (CARGO_TARGET_DIR when set).
TARGET_DIR := $(or $(CARGO_TARGET_DIR),target)

deps:
	bash e2e/cluster/install-deps.sh

controlplane: deps
	@echo "controlplane: Kubernetes from its Go modules (cached; a cold build takes about 8 minutes on 2 cores)"
	bash e2e/cluster/build-controlplane.sh >/dev/null

# Helm and KubeVirt's CRDs, built from their pinned Go modules like the control plane (the
# chart tests run helm; the KubeVirt tests install the CRDs).
tools: deps
	bash e2e/cluster/build-helm.sh >/dev/null
	bash e2e/cluster/build-kubevirt-crds.sh >/dev/null

# What the real nodes run besides ipwarden: kubelet, containerd, CRI-O and the reference CNI
# plugins from their pinned Go modules, and the node's images (docs/testing.md, "Real nodes").
node: deps
	@echo "node: kubelet, containerd and CNI plugins from their Go modules (cached; a cold build takes about 5 minutes on 2 cores)"
	bash e2e/cluster/build-node.sh >/dev/null
	@echo "node: CRI-O from its Go module (cached; a cold build takes about 1.5 minutes on 2 cores, plus its download)"
	bash e2e/cluster/build-crio.sh >/dev/null
	@echo "node: the Debian base of ipwarden's image, for the test image the chart runs on a real node (cached; debootstrap, half a minute here)"
	bash e2e/image/build-base.sh >/dev/null

test: controlplane tools node
	cargo fmt --all -- --check
	cargo clippy --locked --workspace --all-targets -- -D warnings
	cargo test --locked --workspace

# A longer run of the chaos suites than CI's (see docs/testing.md).
soak: controlplane
	IPWARDEN_CHAOS_ROUNDS=40 cargo test --locked --test chaos

# The demo runs the binaries this build just made (never an older copy), where cargo put them.
# DEMO_ARGS: any `ipwarden-e2e up` flag, e.g. DEMO_ARGS=--real-nodes=1 for a real kubelet and
# containerd beside the simulated nodes (with --runtime crio: CRI-O instead of containerd), or
# DEMO_ARGS="--nodes 0 --real-nodes 1 --install chart"
# for ipwarden installed from its Helm chart on a real node (root; docs/testing.md, "Real nodes"
# and "The chart on a real node").
DEMO_ARGS ?=
demo: controlplane
	@echo "demo: building ipwarden and the test harness (cargo build; a few minutes the first time)"
	cargo build --quiet --locked --workspace --bins
	$(TARGET_DIR)/debug/ipwarden-e2e up --demo --ipwarden $(TARGET_DIR)/debug/ipwarden --kubeconfig .e2e/kubeconfig $(DEMO_ARGS)

# The churn benchmark (docs/benchmarks.md): release binaries, defaults (CHURN_ARGS to change
# them, e.g. CHURN_ARGS="--nodes 4 --burst 50 --bursts 5" for the allocation speed bursts), a
# report at the end. Not part of `make test`.
CHURN_ARGS ?=
churn-bench: controlplane
	cargo build --release --locked --workspace --bins
	$(TARGET_DIR)/release/ipwarden-e2e churn --ipwarden $(TARGET_DIR)/release/ipwarden $(CHURN_ARGS)

# The scale benchmark (docs/benchmarks.md, "Scale"): release binaries, 1,000 nodes, 30,000 pods
# in 300 pools by default (SCALE_FLAGS to change them), a report at the end and in
# .e2e/scale-report.json. Not part of `make test`.
SCALE_FLAGS ?=
scale-bench: controlplane
	cargo build --release --locked --workspace --bins
	$(TARGET_DIR)/release/ipwarden-e2e scale --ipwarden $(TARGET_DIR)/release/ipwarden $(SCALE_FLAGS)

# The node benchmark on real nodes (docs/benchmarks.md, "Real nodes"; root): create,
# re-create, recover and delete of 20 Deployments of 10 pods on 2 real nodes, host-local then
# ipwarden and Whereabouts (built from its module on first use), each with an ample and an
# exact pool (NODE_BENCH_ARGS to change them). Not part of
# `make test`, which runs a small one (tests/node_bench_smoke.rs).
NODE_BENCH_ARGS ?=
node-bench: controlplane tools node deps
	bash e2e/cluster/build-whereabouts.sh >/dev/null
	cargo build --release --locked --workspace --bins
	$(TARGET_DIR)/release/ipwarden-e2e node-bench --ipwarden $(TARGET_DIR)/release/ipwarden $(NODE_BENCH_ARGS)

# The churn benchmark of ipwarden and its peers back to back, same seed and workload, with a
# comparison (docs/benchmarks.md, "Peers"). Builds the peers from their pinned Go modules the
# first time. Not part of `make test`.
PEER_BENCH_ARGS ?=
peer-bench: controlplane
	bash e2e/cluster/build-whereabouts.sh >/dev/null
	cargo build --release --locked --workspace --bins
	$(TARGET_DIR)/release/ipwarden-e2e churn --ipam ipwarden,whereabouts,whereabouts-nodeslices \
		--ipwarden $(TARGET_DIR)/release/ipwarden $(PEER_BENCH_ARGS)

# The chart's image, built from the Dockerfile with podman on a Debian base made from Debian's
# packages (nothing is pulled from a registry), then checked by running it (docs/install.md,
# "Building the image"). Needs root. IMAGE=<registry>/ipwarden:<tag> to name it. Not part of
# `make test`.
image:
	bash e2e/image/build-image.sh

# A cluster running ipwarden in the background (docs/testing.md, "A cluster to poke at").
# CLUSTER_ARGS: --bare for nodes on host-local without ipwarden; any `ipwarden-e2e up` flag, e.g.
# CLUSTER_ARGS="--controller-arg=--full-scan-interval-seconds=5 --agent-arg=--release-sandbox-grace-seconds=5",
# or CLUSTER_ARGS=--real-nodes=1 for a real kubelet and containerd besides (root).
CLUSTER_ARGS ?=
cluster-up:
	bash e2e/cluster/cluster-up.sh $(CLUSTER_ARGS)

cluster-down:
	bash e2e/cluster/cluster-down.sh
