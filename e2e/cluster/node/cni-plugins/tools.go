//go:build tools

// Package cniplugins pins the reference CNI plugins the e2e harness's real nodes chain with
// ipwarden-cni, as the chart's conflist does (ptp, portmap, and loopback for the runtime's lo).
// Nothing here is compiled into ipwarden: the blank imports only let `go mod tidy` record every
// dependency in go.sum, so builds are reproducible.
package cniplugins

import (
	_ "github.com/containernetworking/plugins/plugins/main/bridge"
	_ "github.com/containernetworking/plugins/plugins/main/loopback"
	_ "github.com/containernetworking/plugins/plugins/main/ptp"
	_ "github.com/containernetworking/plugins/plugins/meta/portmap"
)
