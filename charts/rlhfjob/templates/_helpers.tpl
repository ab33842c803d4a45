{{/*
Names. Every namespaced object is named after the release (`rlhfjob.fullname`, the usual Helm
convention: "<release>-rlhfjob", or just the release name when it already contains "rlhfjob",
truncated to 63 characters). Cluster-wide objects (ClusterRole, ClusterRoleBinding, the
ValidatingAdmissionPolicy and its binding) add the release namespace, so two releases never
collide, whether they share a namespace or a name.
*/}}
{{- define "rlhfjob.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* Name of a cluster-wide object: the fullname plus the release namespace. */}}
{{- define "rlhfjob.clusterName" -}}
{{- printf "%s-%s" (include "rlhfjob.fullname" .) .Release.Namespace }}
{{- end }}

{{/* The operator's ServiceAccount. */}}
{{- define "rlhfjob.serviceAccountName" -}}
{{- include "rlhfjob.fullname" . }}
{{- end }}

{{/* The Secret holding the Ray token auth key (key `key`). */}}
{{- define "rlhfjob.rayAuthSecretName" -}}
{{- .Values.rayAuth.existingSecret | default (printf "%s-ray-auth-key" (include "rlhfjob.fullname" .)) }}
{{- end }}

{{/*
Labels. `app.kubernetes.io/name: rlhfjob` and `app.kubernetes.io/component: operator` are fixed
(no nameOverride): the per-job NetworkPolicies admit the operator's pods by these two labels
plus the release namespace.
*/}}
{{- define "rlhfjob.labels" -}}
app.kubernetes.io/name: rlhfjob
app.kubernetes.io/component: operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "rlhfjob.selector" -}}
app.kubernetes.io/name: rlhfjob
app.kubernetes.io/component: operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}
