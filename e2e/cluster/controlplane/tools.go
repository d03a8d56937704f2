//go:build tools

// Package controlplane pins the Kubernetes and etcd commands the e2e harness builds.
// Nothing here is compiled into ipwarden: the blank imports only let `go mod tidy`
// record every dependency of those commands in go.sum, so builds are reproducible.
package controlplane

import (
	_ "go.etcd.io/etcd/server/v3"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
