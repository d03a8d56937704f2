//go:build tools

// Package kubelet pins the kubelet the e2e harness's real nodes run: the same Kubernetes
// release as the control plane. Nothing here is compiled into ipwarden: the blank import only
// lets `go mod tidy` record every dependency in go.sum, so builds are reproducible.
package kubelet

import (
	_ "k8s.io/kubernetes/cmd/kubelet"
)
