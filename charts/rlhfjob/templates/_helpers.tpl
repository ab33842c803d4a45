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
The API server's addresses, a JSON list of CIDR:PORT,...: a job's head reaches the API server
there only. `networkPolicy.apiServerCIDRs` when given; otherwise derived at install from the
`kubernetes` Service of `default` (its cluster IPs on its ports) and its EndpointSlices (the API
servers' own addresses and ports, what a CNI sees once the Service is translated). `helm
template` and client-side dry runs read no cluster, so there the value must be given; with
neither, rendering fails. Derived addresses are those of the install: run `helm upgrade` when
the control plane's change (or give a range that holds them).
*/}}
{{- define "rlhfjob.apiServerCIDRs" -}}
{{- $found := .Values.networkPolicy.apiServerCIDRs | default list }}
{{- if not $found }}
{{- $service := lookup "v1" "Service" "default" "kubernetes" }}
{{- if $service }}
{{- $ports := list }}
{{- range $service.spec.ports }}{{ $ports = append $ports (toString (int .port)) }}{{ end }}
{{- range ($service.spec.clusterIPs | default (list $service.spec.clusterIP)) }}
{{- $found = append $found (include "rlhfjob.hostCIDR" (list . $ports)) }}
{{- end }}
{{- end }}
{{- $slices := lookup "discovery.k8s.io/v1" "EndpointSlice" "default" "" }}
{{- range ($slices.items | default list) }}
{{- if eq (get (.metadata.labels | default dict) "kubernetes.io/service-name") "kubernetes" }}
{{- $ports := list }}
{{- range (.ports | default list) }}{{ $ports = append $ports (toString (int .port)) }}{{ end }}
{{- range (.endpoints | default list) }}
{{- range .addresses }}
{{- $found = append $found (include "rlhfjob.hostCIDR" (list . $ports)) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- if not $found }}
{{- fail "networkPolicy.apiServerCIDRs: none given, and none derived (helm template and client-side dry runs read no cluster). Give the API server's addresses as CIDR:PORT: the kubernetes Service's cluster IP on 443 and its endpoints (kubectl get endpointslices -n default -l kubernetes.io/service-name=kubernetes)" }}
{{- end }}
{{- $found | uniq | toJson }}
{{- end }}

{{/* One address as a CIDR of itself, with its ports: (list ADDRESS PORTS). */}}
{{- define "rlhfjob.hostCIDR" -}}
{{- $address := index . 0 }}
{{- $ports := index . 1 }}
{{- printf "%s/%s" $address (ternary "128" "32" (contains ":" $address)) }}
{{- if $ports }}:{{ join "," $ports }}{{ end }}
{{- end }}
