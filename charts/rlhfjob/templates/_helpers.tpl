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

{{/*
A CEL expression for the list `leaf` of the pod overrides at `place` in the RLHFJob `root`
(object or oldObject), or [] where a step is missing. `place` is dotted below spec; a step
ending in "?" is nullable, so it is also checked against null.
*/}}
{{- define "rlhfjob.podList" -}}
{{- $root := index . 0 -}}
{{- $expr := printf "%s.spec" $root -}}
{{- $checks := list (printf "%s != null" $root) (printf "has(%s)" $expr) -}}
{{- range splitList "." (printf "%s.%s" (index . 1) (index . 2)) -}}
{{- $expr = printf "%s.%s" $expr (trimSuffix "?" .) -}}
{{- $checks = append $checks (printf "has(%s)" $expr) -}}
{{- if hasSuffix "?" . }}{{ $checks = append $checks (printf "%s != null" $expr) }}{{ end -}}
{{- end -}}
({{ join " && " $checks }} ? {{ $expr }} : [])
{{- end }}

{{/*
A CEL expression: the names of the Secrets the pod overrides at `place` of `root` read into the
environment (env valueFrom.secretKeyRef, envFrom secretRef).
*/}}
{{- define "rlhfjob.podSecretRefs" -}}
{{- $root := index . 0 -}}{{- $place := index . 1 -}}
{{ include "rlhfjob.podList" (list $root $place "env") }}.filter(e, has(e.valueFrom) && e.valueFrom != null && has(e.valueFrom.secretKeyRef) && e.valueFrom.secretKeyRef != null).map(e, e.valueFrom.secretKeyRef.name) + {{ include "rlhfjob.podList" (list $root $place "envFrom") }}.filter(e, has(e.secretRef) && e.secretRef != null).map(e, e.secretRef.name)
{{- end }}
