{{- define "baton.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "baton.selectorLabels" -}}
app.kubernetes.io/name: baton-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "baton.labels" -}}
{{ include "baton.selectorLabels" . }}
app.kubernetes.io/part-of: baton
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "baton.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "baton.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}
