//go:build tools

// Package crio pins the second container runtime the e2e harness's real nodes can run: CRI-O
// (its daemon, and copyimg, the image copier of its test suite, which puts the node's locally
// made images into CRI-O's storage: there is no registry). Its pinns helper is C, built from
// the same module's sources. Nothing here is compiled into ipwarden: the blank imports only let
// `go mod tidy` record every dependency in go.sum, so builds are reproducible.
package crio

import (
	_ "github.com/cri-o/cri-o/cmd/crio"
	_ "github.com/cri-o/cri-o/test/copyimg"
)
