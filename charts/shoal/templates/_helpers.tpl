{{/* Labels on everything the chart creates. */}}
{{- define "shoal.labels" -}}
app.kubernetes.io/name: shoal-operator
app.kubernetes.io/component: operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: shoal
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* The operator pods' selector. */}}
{{- define "shoal.selector" -}}
app.kubernetes.io/name: shoal-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The namespaces the operator watches, as a JSON list (the release namespace by default). */}}
{{- define "shoal.watchNamespaces" -}}
{{- if .Values.operator.watchNamespaces -}}
{{- toJson .Values.operator.watchNamespaces -}}
{{- else -}}
{{- toJson (list .Release.Namespace) -}}
{{- end -}}
{{- end }}
