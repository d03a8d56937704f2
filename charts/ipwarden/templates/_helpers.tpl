{{/* The release's base name for every object. */}}
{{- define "ipwarden.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels every object carries. */}}
{{- define "ipwarden.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ipwarden
{{- end -}}

{{/* Selector labels of one component; call with (dict "root" $ "component" "controller"). */}}
{{- define "ipwarden.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* The ServiceAccount name of one component; call like ipwarden.selectorLabels. */}}
{{- define "ipwarden.serviceAccountName" -}}
{{- $account := index .root.Values .component "serviceAccount" -}}
{{- if $account.name -}}
{{- $account.name -}}
{{- else -}}
{{- printf "%s-%s" (include "ipwarden.fullname" .root) .component -}}
{{- end -}}
{{- end -}}

{{/* The image reference. */}}
{{- define "ipwarden.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* The restricted container securityContext both components start from. */}}
{{- define "ipwarden.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* The conflist the agent's init container installs on every node. */}}
{{- define "ipwarden.conflist" -}}
{{- $ipam := dict "type" "ipwarden-cni" "socket" (printf "%s/agent.sock" .Values.agent.socketDir) "timeoutSeconds" .Values.cni.timeoutSeconds -}}
{{- with .Values.cni.pools }}{{ $_ := set $ipam "pools" . }}{{ end -}}
{{- $main := merge (dict "ipam" $ipam) (deepCopy .Values.cni.plugin) -}}
{{- $plugins := prepend (deepCopy .Values.cni.chainedPlugins) $main -}}
{{- dict "cniVersion" .Values.cni.cniVersion "name" .Values.cni.networkName "plugins" $plugins | toPrettyJson -}}
{{- end -}}
