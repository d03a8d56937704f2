//go:build tools

// Package containerd pins the container runtime the e2e harness's real nodes run (containerd,
// its runc shim and ctr). Nothing here is compiled into ipwarden: the blank imports only let
// `go mod tidy` record every dependency in go.sum, so builds are reproducible.
package containerd

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/v2/cmd/ctr"
)
