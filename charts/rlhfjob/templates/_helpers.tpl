{{- define "rlhfjob.name" -}}rlhfjob-operator{{- end }}

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
