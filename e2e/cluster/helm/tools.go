//go:build tools

// Package tools pins Helm, which build-helm.sh builds from this module.
package tools

import _ "helm.sh/helm/v4/cmd/helm"
