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

{{/* The watched namespaces other than the release's, as a JSON list (none when watching all). */}}
{{- define "shoal.otherNamespaces" -}}
{{- $others := list }}
{{- if not .Values.operator.allNamespaces }}
{{- range (include "shoal.watchNamespaces" . | fromJsonArray) }}
{{- if ne . $.Release.Namespace }}
{{- $others = append $others . }}
{{- end }}
{{- end }}
{{- end }}
{{- toJson $others -}}
{{- end }}

{{/* "true" when Helm talks to a cluster: lookup answers nothing under `helm template` and client
  dry runs, so only a namespace known to exist tells. kube-system always does; the release's own
  may not yet (`--create-namespace` creates it after the templates are rendered). */}}
{{- define "shoal.onCluster" -}}
{{- if or (lookup "v1" "Namespace" "" "kube-system") (lookup "v1" "Namespace" "" .Release.Namespace) -}}
true
{{- end -}}
{{- end }}
