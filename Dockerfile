# syntax=docker/dockerfile:1
# The ipwarden image: one binary for every role (controller, agent, CNI plugin, CLI).
#
#   docker build -t ipwarden:0.1.0 .
#
# Stage 1 builds the release binary from the locked dependency graph; stage 2 is a slim
# Debian with only that binary (plus the `ipwarden-cni` name the CNI plugin is invoked by).
# Debian rather than distroless because the agent's init container copies the plugin and the
# conflist onto the host with `cmp`, `cp`, `sync` and `mv` (an atomic install needs a shell,
# not a new subcommand), and the binary links glibc.

# Builder and runtime share a Debian release, so the binary's glibc matches.
ARG RUST_IMAGE=rust:1.95-slim-bookworm
ARG BASE_IMAGE=debian:bookworm-slim

FROM ${RUST_IMAGE} AS build
WORKDIR /src
# Dependencies first, so a source change reuses the cached dependency layer.
COPY Cargo.toml Cargo.lock ./
COPY e2e/Cargo.toml e2e/Cargo.toml
RUN mkdir -p src e2e/src benches \
    && echo 'fn main() {}' > src/main.rs \
    && touch src/lib.rs e2e/src/lib.rs benches/sweep.rs \
    && cargo fetch --locked
COPY src src
COPY benches benches
ENV CARGO_PROFILE_RELEASE_STRIP=symbols
RUN cargo build --release --locked -p ipwarden --bin ipwarden

FROM ${BASE_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="ipwarden" \
      org.opencontainers.image.description="Kubernetes IPAM with a StatefulSet-aware IP garbage collector" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /src/target/release/ipwarden /usr/local/bin/ipwarden
RUN ln -s ipwarden /usr/local/bin/ipwarden-cni
# The controller and the CLI run as this user; the agent's chart sets its own user (root with
# no capabilities) because it writes into root-owned host directories.
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/ipwarden"]
